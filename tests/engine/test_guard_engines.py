"""The family guard on the engine kinds async RL runs: an ``AsyncLLM`` is probed by default (not refused) on a
family nobody has proven, and a fault planted in the engine's own reload (a layer left stale, two experts swapped,
a norm scaled by 1.01) fails the install closed: the version unchanged, new requests refused, and the next good
install serves the new weights exactly."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import FamilyProbeError, PartialUpdateError
from hotweights.core import families
from hotweights.testing import EventLoopThread, start_async_engine

from .conftest import TinyCheckpoint, Variant
from .faulty import EXTENSION, FAULT_FILE, plant
from .test_async_llm import greedy

pytestmark = pytest.mark.engine

MOE = Variant("qwen3_moe", torch.float32, tie=False)
#: Faults in the engine's own reload that serve wrong tokens silently unless the guard catches them.
FAULTS = {
    "a layer's tensor left stale": "stale layers.1.self_attn.o_proj",
    "two experts swapped": "swap 0 1",
    "a norm scaled by 1.01": "scale layers.0.post_attention_layernorm 1.01",
}


@pytest.fixture
def unproven(monkeypatch: pytest.MonkeyPatch) -> None:
    """The family as one nobody has proven on this vLLM (as every family is on vLLM 0.33, 0.34 and GPUs)."""
    monkeypatch.setattr(families, "PROVEN", {})


class Engine:
    """An ``AsyncLLM`` with the faulty extension, on a loop of its own (as in an async RL trainer)."""

    def __init__(self, loop: EventLoopThread, engine: Any, fault: Path, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.loop, self.engine, self.fault, self.a, self.b = loop, engine, fault, a, b
        self.version = 0

    def install(self, ckpt: TinyCheckpoint, **kwargs: Any) -> hotweights.InstallReport:
        self.version += 1
        sd = ckpt.state_dict()
        return self.loop.run(hotweights.install_async(self.engine, sd, weight_version=self.version, **kwargs))

    def greedy(self) -> list[list[int]]:
        return self.loop.run(greedy(self.engine))

    def engine_version(self) -> str:
        return str(self.loop.run(self.engine.get_weight_version()))


@pytest.fixture(scope="module")
def async_engine(
    checkpoint: Callable[[Variant, int], TinyCheckpoint], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    a, b = checkpoint(MOE, 1), checkpoint(MOE, 2)
    fault = tmp_path_factory.mktemp("fault") / "fault"
    plant(fault, "")
    os.environ[FAULT_FILE] = str(fault)  # read by the engine's worker process
    loop = EventLoopThread()
    engine = loop.call(start_async_engine, a.path, worker_extension_cls=EXTENSION)
    loop.run(engine.collective_rpc("faulty_plant"))
    yield Engine(loop, engine, fault, a, b)
    engine.shutdown()
    loop.close()
    os.environ.pop(FAULT_FILE, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_an_unproven_family_in_an_async_llm_is_probed_by_default(async_engine: Engine, unproven: None) -> None:
    e = async_engine
    assert e.a.fresh != e.b.fresh  # the two weight sets serve different tokens
    assert e.greedy() == e.a.fresh
    report = e.install(e.b)
    assert "probed at v1" in (report.family_check or ""), report.family_check
    assert "family_probe" in report.phases
    # the probe ranked its logprobs eagerly in the worker (vLLM's first-logprobs compile is not paid inside the
    # install), and vLLM's own ranking is back after it
    (ranks,) = e.loop.run(e.engine.collective_rpc("faulty_ranks"))
    assert ranks["eager_calls"] > 0 and ranks["restored"], ranks
    assert e.greedy() == e.b.fresh
    again = e.install(e.a)  # probed once per engine
    assert "family_probe" not in again.phases
    assert e.greedy() == e.a.fresh


@pytest.mark.parametrize("what", list(FAULTS))
def test_a_fault_in_an_async_llms_reload_fails_closed(async_engine: Engine, unproven: None, what: str) -> None:
    e = async_engine
    good = e.install(e.a)
    assert e.greedy() == e.a.fresh
    before = e.engine_version()
    _forget_probe(e.engine)  # as on an engine's first install
    plant(e.fault, FAULTS[what])
    try:
        with pytest.raises(FamilyProbeError, match="differed from the reference"):
            e.install(e.b)
        e.version -= 1  # refused: the same version is accepted again
        assert e.engine_version() == before == str(good.weight_version)
        with pytest.raises(PartialUpdateError):
            e.greedy()
    finally:
        plant(e.fault, "")
    healed = e.install(e.b)
    assert "probed" in (healed.family_check or "")
    assert e.greedy() == e.b.fresh


def _forget_probe(engine: Any) -> None:
    """Make the next install probe again (an engine is probed on its first install only)."""
    from hotweights.core import attach

    handle = attach.get(engine, "handle")
    if handle is not None:
        handle.__dict__.pop("_hotweights_family_probed", None)


def test_a_failed_probe_under_keep_aborts_the_requests_that_decoded_during_it(
    async_engine: Engine, unproven: None
) -> None:
    """Under keep, requests in flight decode on the new weights while the probe runs: when the probe then fails,
    they are aborted (none completes on weights the probe refused) and the old version label is put back."""
    from vllm import SamplingParams

    e = async_engine
    e.install(e.a)
    before = e.engine_version()
    _forget_probe(e.engine)
    plant(e.fault, FAULTS["two experts swapped"])

    async def scenario() -> Any:
        started = asyncio.Event()
        sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, detokenize=False)

        async def long_request() -> Any:
            final = None
            async for out in e.engine.generate({"prompt_token_ids": [3, 5, 7, 11]}, sp, request_id="long-keep"):
                final = out
                if len(out.outputs[0].token_ids) >= 2:
                    started.set()
            return final

        task = asyncio.create_task(long_request())
        await asyncio.wait_for(started.wait(), 120)
        e.version += 1
        with pytest.raises(FamilyProbeError):
            await hotweights.install_async(e.engine, e.b.state_dict(), weight_version=e.version, pause="keep")
        e.version -= 1
        return await asyncio.wait_for(task, 120)

    try:
        final = e.loop.run(scenario())
    finally:
        plant(e.fault, "")
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 400, final.outputs[0]
    assert e.engine_version() == before
    healed = e.install(e.b)
    assert "probed" in (healed.family_check or "")
    assert e.greedy() == e.b.fresh
