"""An ``AsyncLLM`` with ``data_parallel_size=2`` (one engine core per rank): an install reaches every rank and is
proven to, request by request routed to each rank, against a freshly started engine on each checkpoint. The engine
runs in its own process (``dp_engine.py``): vLLM's data-parallel start needs a ``__main__`` guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .conftest import TinyCheckpoint, Variant

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


def test_an_install_reaches_and_is_read_back_on_every_data_parallel_rank(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    assert a.fresh != b.fresh
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("dp_engine.py")), str(a.path), str(b.path)],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["num_workers"] == 2 and "2 data-parallel ranks" in result["describe"]
    assert result["status_answers"] == 2  # every rank's worker answers (vLLM's collective_rpc returns rank 0's)
    assert result["start"] == [a.fresh, a.fresh]
    for tag, ckpt, version in (("b", b, "1"), ("a", a, "2")):
        step = result[tag]
        assert step["adapter"] == "multiprocess-shm"
        assert step["ranks"] == [ckpt.fresh, ckpt.fresh], tag  # requests routed to rank 0 and to rank 1
        assert step["engine_version"] == version  # vLLM raises when the ranks' versions differ
        assert step["readback_unreadable"] is not None  # both ranks' workers read back (the fewest verified)
