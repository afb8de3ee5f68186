"""Remote-engine tests: the tiny policies they serve; no test leaves shared-memory segments of this process behind."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotweights.testing import build_tiny_model, greedy_hf, save_tiny_model
from hotweights.transports import shm


def own_segments() -> list[str]:
    """This process's shared-memory files, less those live shm transports keep for their next install."""
    gc.collect()
    held = {p.name for p in shm._HELD}
    return sorted(p.name for p in Path("/dev/shm").glob(f"hotweights-{os.getpid()}-*") if p.name not in held)


@pytest.fixture(autouse=True)
def shm_clean() -> Iterator[None]:
    """No test leaves shared-memory segments of this process behind (but the files a live transport reuses)."""
    yield
    assert own_segments() == []


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two tiny fp32 Qwen2 policies (A served at start, B installed), A's directory and HF's greedy outputs."""
    a, b = build_tiny_model("qwen2", 0), build_tiny_model("qwen2", 1)
    path = save_tiny_model(a, tmp_path_factory.mktemp("remote-A"))
    return {"A": a, "B": b, "path": path, "hf": {"A": greedy_hf(a), "B": greedy_hf(b)}}
