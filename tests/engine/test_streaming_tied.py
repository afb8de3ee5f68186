"""Streaming installs into a multiprocess engine serving a tied Llama: the LM head that borrows the embedding must
follow it, although the embedding arrives in the first bucket and the layers after it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights import WeightUpdateManifest
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.transports import make_transport

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("llama", torch.float32, tie=True)


@pytest.fixture(scope="module")
def tied(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[tuple[Any, TinyCheckpoint, TinyCheckpoint]]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    yield llm, a, b
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@pytest.mark.parametrize(("method", "keep"), [("reload", False), ("direct", False), ("direct", True)])
def test_streaming_into_a_tied_model(tied: tuple[Any, TinyCheckpoint, TinyCheckpoint], method: str, keep: bool) -> None:
    llm, a, b = tied
    transport = make_transport("shm", keep_segments=keep)
    adapter = VLLMMultiprocessAdapter(
        llm, transport=transport, bucket_bytes=100_000, commit="streaming", install_method=method
    )
    try:
        start = adapter.active_weight_version or 0  # the engine's version line, shared by every adapter on it
        for i, ckpt in enumerate((b, a, b)):
            sd = ckpt.state_dict()
            assert "lm_head.weight" in sd  # tied: in the state dict, not in the checkpoint
            report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=start + i + 1), sd)
            assert report.skipped and report.skipped[0].startswith("lm_head.weight")
            assert greedy_vllm(llm) == ckpt.fresh
        assert b.fresh == b.hf and a.fresh != b.fresh
    finally:
        adapter.close()
