"""An engine started from a Hub id, with no model directory: validated on the trainer's side from the snapshot in
the local Hugging Face cache, and by its worker at ``begin`` against the checkpoint it serves."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .conftest import TinyCheckpoint, Variant

# A fresh Python and engine of their own (~70 s): in the long profile (`make test-matrix`); the worker's own check
# runs in the default run (test_multiprocess.py), the Hub cache lookup in tests/unit/test_expected.py.
pytestmark = [pytest.mark.engine, pytest.mark.matrix]


def test_a_hub_id_engine_is_validated_on_both_sides_and_installs_exactly(
    tmp_path: Path, checkpoint: Callable[[Variant, int], TinyCheckpoint]
) -> None:
    a, b = (
        checkpoint(Variant("qwen2", torch.float32, tie=False), 1),
        checkpoint(Variant("qwen2", torch.float32, tie=False), 2),
    )
    assert a.fresh != b.fresh
    script = Path(__file__).with_name("hub_engine.py")
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "hub"), "acme/tiny-qwen2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["a"] == a.fresh  # the engine serves the cached snapshot, A
    assert out["trainer_knows"] is True  # read from the snapshot on the trainer's side (was: a warning, no check)
    q, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    assert out["worker_refused"] == [["missing", norm], ["shape", q]]  # the worker's own check, typed
    assert out["after_refusal"] == a.fresh and out["version_after_refusal"] == out["version_before"]
    assert out["b"] == b.fresh, out["report"]
