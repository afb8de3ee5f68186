"""An engine started with a subclass of hotweights' worker extension installs as one started with hotweights' own:
``hotweights.install`` takes the install session through the extension (not vLLM's zero-configuration weights path,
as when the route compared the class's name with hotweights' own), and what it serves equals a fresh engine on the
new weights."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights.handles import as_engine

from ..conftest import our_shm
from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine
from .own_extension import EXTENSION

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
Served = tuple[Any, TinyCheckpoint, TinyCheckpoint]


@pytest.fixture(scope="module")
def engine(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> Iterator[tuple[Any, TinyCheckpoint, TinyCheckpoint]]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=EXTENSION)
    assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
    yield llm, a, b
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_a_subclass_of_the_extension_takes_the_session_and_installs_exactly(engine: Served) -> None:
    llm, a, b = engine
    assert a.fresh != b.fresh  # the two weight sets serve different tokens
    assert llm.collective_rpc("own_hello") == ["hello from a subclass"]  # the engine runs the subclass
    assert greedy_vllm(llm) == a.fresh
    handle = as_engine(llm)
    assert handle.facts.worker_extension == EXTENSION and handle.workers.extension
    assert handle.route == "extension"
    report = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert report.adapter == "multiprocess-shm", report  # the session through the extension
    assert greedy_vllm(llm) == b.fresh
    assert llm.llm_engine.get_weight_version() == "1"
    report = hotweights.install(llm, a.state_dict(), weight_version=2)
    assert report.adapter == "multiprocess-shm"
    assert greedy_vllm(llm) == a.fresh
    assert llm.llm_engine.get_weight_version() == "2"
    assert our_shm() == []
