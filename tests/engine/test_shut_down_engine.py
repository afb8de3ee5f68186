"""An in-process engine that was shut down serves nothing: an install into it is refused, typed, before anything is
written (it failed deep in vLLM before, with a bare ``AssertionError`` and "Still serving: v1")."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hotweights

from .conftest import TinyCheckpoint, Variant, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


def test_an_install_into_a_shut_down_inprocess_engine_raises_engine_died(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        hotweights.install(llm, b.state_dict(), weight_version=1)  # the engine's handle and gate exist
    finally:
        stop_engine(llm)  # what vLLM's own finalizer runs (llm.llm_engine.engine_core.shutdown())
    with pytest.raises(hotweights.EngineDiedError, match="shut down") as died:
        hotweights.install(llm, a.state_dict(), weight_version=2)
    message = str(died.value)
    assert "start a new engine" in message and "writes nothing into it" in message
    assert "Still serving" not in message and "AssertionError" not in message
    with pytest.raises(hotweights.EngineDiedError, match="shut down"):  # an adapter used directly: the same
        hotweights.adapter_for(llm).install(
            hotweights.WeightUpdateManifest.from_state_dict(a.state_dict(), weight_version=3), a.state_dict()
        )
