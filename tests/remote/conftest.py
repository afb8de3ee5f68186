"""Remote-engine tests: the tiny policies they serve; no test leaves shared-memory segments of this process behind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hotweights.testing import build_tiny_model, greedy_hf, save_tiny_model

from ..conftest import our_shm


@pytest.fixture(autouse=True)
def shm_clean() -> Iterator[None]:
    """No test leaves shared-memory segments of this process behind (but the files a live transport reuses)."""
    yield
    assert our_shm() == []


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two tiny fp32 Qwen2 policies (A served at start, B installed), A's directory and HF's greedy outputs."""
    a, b = build_tiny_model("qwen2", 0), build_tiny_model("qwen2", 1)
    path = save_tiny_model(a, tmp_path_factory.mktemp("remote-A"))
    return {"A": a, "B": b, "path": path, "hf": {"A": greedy_hf(a), "B": greedy_hf(b)}}
