"""weight_version_of on real outputs: an in-process ``LLM`` before and after installs, and an ``AsyncLLM`` request
in flight during a ``pause="keep"`` install (its tokens come from two versions)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights import weight_version_of, weight_versions_of
from hotweights.testing import EventLoopThread, start_async_engine

from .conftest import PROMPTS, TinyCheckpoint, Variant, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
_ids = itertools.count()


def _generate(llm: Any, max_tokens: int = 8) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False))


def test_llm_outputs_name_the_version_that_produced_them(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path)
    try:
        before = _generate(llm)
        assert [weight_version_of(o) for o in before] == [None] * len(PROMPTS)  # the weights it started with
        assert weight_versions_of(before[0]).spans[0].end == 8
        hotweights.install(llm, b.state_dict(), weight_version=3)
        outs = _generate(llm)
        assert [list(o.outputs[0].token_ids) for o in outs] == b.hf
        assert [weight_version_of(o) for o in outs] == [3] * len(PROMPTS)
        hotweights.install(llm, iter(a.state_dict().items()), weight_version=4)  # pairs that can be read once
        assert {weight_version_of(o) for o in _generate(llm)} == {4}
        assert [list(o.outputs[0].token_ids) for o in _generate(llm)] == a.hf
    finally:
        stop_engine(llm)


def test_the_engine_holds_the_version_across_adapters_and_trainer_restarts(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """Issue 17: versions were per adapter, so a second adapter (or a restarted trainer) accepted any version."""
    from hotweights import StaleWeightVersionError
    from hotweights.adapters import VLLMDirectSetterAdapter, VLLMInProcessAdapter

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path)
    try:
        hotweights.install(llm, b.state_dict(), weight_version=5)
        for adapter in (VLLMInProcessAdapter(llm, install_method="reload"), VLLMDirectSetterAdapter(llm)):
            assert adapter.active_weight_version == 5  # one version line per engine
            with pytest.raises(StaleWeightVersionError):
                hotweights.install(llm, a.state_dict(), weight_version=4, adapter=adapter)
        hotweights.detach(llm)  # a restarted trainer: nothing of hotweights' state survives but the engine's record
        with pytest.raises(StaleWeightVersionError):
            hotweights.install(llm, a.state_dict(), weight_version=5)
        assert [list(o.outputs[0].token_ids) for o in _generate(llm)] == b.fresh  # nothing was written
        report = hotweights.install(llm, a.state_dict(), weight_version=6)
        assert report.previous_version == 5
        hotweights.install(llm, b.state_dict(), weight_version=2, force=True)  # force stays
    finally:
        stop_engine(llm)


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    loop = EventLoopThread()
    yield loop
    loop.close()


def test_async_request_in_flight_during_a_keep_install_reports_both_versions(
    loop: EventLoopThread, checkpoint: Callable[[Variant, int], TinyCheckpoint]
) -> None:
    from vllm import SamplingParams

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    engine = loop.call(start_async_engine, a.path, worker_extension_cls=hotweights.WORKER_EXTENSION)
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, detokenize=False)

    async def request(started: asyncio.Event | None = None) -> Any:
        final = None
        async for out in engine.generate({"prompt_token_ids": PROMPTS[-1]}, sp, request_id=f"v{next(_ids)}"):
            if started is not None:
                started.set()
            final = out
        return final

    async def scenario() -> tuple[Any, Any, Any]:
        await hotweights.install_async(engine, b.state_dict(), weight_version=1)
        alone = await request()
        started = asyncio.Event()
        task = asyncio.create_task(request(started))
        await started.wait()
        await hotweights.install_async(engine, a.state_dict(), weight_version=2, pause="keep")
        mixed = await asyncio.wait_for(task, 120)
        return alone, mixed, await request()

    try:
        alone, mixed, after = loop.run(scenario())
    finally:
        engine.shutdown()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert weight_version_of(alone) == 1
    assert weight_version_of(after) == 2
    spans = weight_versions_of(mixed)
    assert spans.mixed and (spans.first, spans.last) == (1, 2) and spans.versions == (1, 2)
    first, second = spans.spans
    assert 0 == first.start < first.end == second.start < second.end == len(mixed.outputs[0].token_ids) == 80
    with pytest.raises(ValueError, match=r"v1 \[0:\d+\], v2 \[\d+:80\]"):
        weight_version_of(mixed)
