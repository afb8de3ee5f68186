"""``hotweights.install_async`` into a real ``AsyncLLM``: without the extension (weights path) and with it, requests
in flight under each pause mode, fail closed and always resumed after a failed write.

The engine lives on an event loop in a background thread (as in an async RL trainer); the test thread submits
coroutines to it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import (
    EngineNotSupportedError,
    InstallError,
    PartialUpdateError,
    UnprovenFamilyError,
    WeightManifestValidationError,
)
from hotweights.adapters import weights_path
from hotweights.core.families import is_proven
from hotweights.testing import EventLoopThread, start_async_engine
from hotweights.vllm import compat

from .conftest import PROMPTS, TinyCheckpoint, Variant, our_shm

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
LONG = PROMPTS[-1]
_ids = itertools.count()


async def _generate(engine: Any, prompt: Sequence[int], max_tokens: int = 8) -> Any:
    """The final ``RequestOutput`` of one greedy request."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    final = None
    async for out in engine.generate({"prompt_token_ids": list(prompt)}, sp, request_id=f"t{next(_ids)}"):
        final = out
    return final


async def greedy(engine: Any, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    outs = await asyncio.gather(*(_generate(engine, p, max_tokens) for p in prompts))
    return [list(o.outputs[0].token_ids) for o in outs]


def proven(architecture: str) -> bool:
    """Whether the conformance matrix proved ``architecture`` on this vLLM line and device (not on vLLM 0.31, the
    suite's second CPU build, nor on any GPU): else the first install into each engine is probed."""
    return is_proven(architecture, vllm=compat.vllm_version(), device=compat.device_kind())


class Async:
    def __init__(self, loop: EventLoopThread, engine: Any, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.loop, self.engine, self.a, self.b = loop, engine, a, b
        self.version = 0
        self.options: dict[str, Any] = {}
        self.proven = proven(type(a.model).__name__)

    def greedy(self, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 8) -> list[list[int]]:
        return self.loop.run(greedy(self.engine, prompts, max_tokens))

    def install(self, ckpt: TinyCheckpoint, **kwargs: Any) -> hotweights.InstallReport:
        self.version += 1
        sd = ckpt.state_dict()
        options = {**self.options, **kwargs}
        return self.loop.run(hotweights.install_async(self.engine, sd, weight_version=self.version, **options))

    def engine_version(self) -> str:
        return str(self.loop.run(self.engine.get_weight_version()))


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    loop = EventLoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def plain(loop: EventLoopThread, checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Async]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    engine = loop.call(start_async_engine, a.path)  # built on the loop it will run on
    yield Async(loop, engine, a, b)
    engine.shutdown()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_a_to_b_to_a_without_the_extension(plain: Async) -> None:
    assert plain.greedy() == plain.a.hf
    if not plain.proven:  # unproven on this vLLM: refused before writing when the caller says so
        before = plain.engine_version()
        with pytest.raises(UnprovenFamilyError, match="unproven='refuse'"):
            sd = plain.b.state_dict()
            plain.loop.run(hotweights.install_async(plain.engine, sd, weight_version=1, unproven="refuse"))
        assert plain.engine_version() == before and plain.greedy() == plain.a.hf
    report = plain.install(plain.b)
    assert report.adapter == "weights-path"
    assert report.stall_s is not None and report.phases["install"] <= report.stall_s  # paused for the reload at least
    assert (report.family_check or "").startswith("proven" if plain.proven else "unproven"), report.family_check
    assert plain.proven or "probed at v1" in (report.family_check or ""), report.family_check
    assert plain.engine_version() == str(report.weight_version)
    assert plain.greedy() == plain.b.hf
    plain.install(plain.a)
    assert plain.greedy() == plain.a.hf
    assert our_shm() == []


def test_sync_install_says_to_await_install_async(plain: Async) -> None:
    with pytest.raises(EngineNotSupportedError, match=r"await hotweights\.install_async\(engine"):
        hotweights.install(plain.engine, plain.b.state_dict(), weight_version=plain.version + 1)


def test_event_loop_keeps_running_during_an_install(plain: Async) -> None:
    async def scenario() -> tuple[int, hotweights.InstallReport]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        plain.version += 1
        report = await hotweights.install_async(
            plain.engine, plain.b.state_dict(), weight_version=plain.version, **plain.options
        )
        task.cancel()
        return ticks, report

    ticks, report = plain.loop.run(scenario())
    assert ticks >= 5, f"the loop ticked {ticks} times during a {report.seconds:.3f} s install"
    assert plain.greedy() == plain.b.hf


def _in_flight(plain: Async, ckpt: TinyCheckpoint, pause: str, max_tokens: int = 80) -> tuple[Any, Any]:
    """Start a long request, install ``ckpt`` with ``pause`` once it produced its first token; return both."""

    async def scenario() -> tuple[Any, Any]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        started = asyncio.Event()
        final: list[Any] = []

        async def request() -> None:
            async for out in plain.engine.generate({"prompt_token_ids": LONG}, sp, request_id=f"t{next(_ids)}"):
                started.set()
                final.append(out)

        task = asyncio.create_task(request())
        await started.wait()
        plain.version += 1
        sd = ckpt.state_dict()
        report = await hotweights.install_async(
            plain.engine,
            sd,
            weight_version=plain.version,
            pause=pause,  # type: ignore[arg-type]
            **plain.options,
        )
        await asyncio.wait_for(task, 120)
        return final[-1], report

    return plain.loop.run(scenario())


def test_wait_mode_request_in_flight_is_entirely_old(plain: Async) -> None:
    plain.install(plain.a)
    old = plain.greedy([LONG], max_tokens=80)[0]
    out, report = _in_flight(plain, plain.b, "wait")
    assert list(out.outputs[0].token_ids) == old  # finished on A before the write: no mix
    assert report.phases["wait_generation"] > 0
    assert plain.greedy() == plain.b.hf


def test_a_request_that_arrives_during_a_wait_install_queues_for_the_new_weights(plain: Async) -> None:
    """Under pause="wait", a request sent while the install holds the engine is held by hotweights and handed to
    vLLM after the resume (from vLLM 0.33 a paused engine rejects it), then served entirely by the new weights."""
    from hotweights.handles import as_engine

    gate = as_engine(plain.engine).gate
    plain.install(plain.a)
    held = gate.held

    async def scenario() -> list[int]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, detokenize=False)
        started = asyncio.Event()

        async def long_request() -> None:
            async for _ in plain.engine.generate({"prompt_token_ids": LONG}, sp, request_id=f"t{next(_ids)}"):
                started.set()

        first = asyncio.create_task(long_request())
        await started.wait()
        plain.version += 1
        install = asyncio.create_task(
            hotweights.install_async(plain.engine, plain.b.state_dict(), weight_version=plain.version, **plain.options)
        )

        async def held() -> None:  # the install holds new requests (the long one drains meanwhile)
            while gate._hold is None:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(held(), 60)
        late = await _generate(plain.engine, PROMPTS[0])  # waits for the resume, then runs on B
        await install
        await first
        return list(late.outputs[0].token_ids)

    assert plain.loop.run(scenario()) == plain.b.hf[0]
    assert gate.held == held + 1


def test_abort_mode_ends_the_request(plain: Async) -> None:
    out, _ = _in_flight(plain, plain.a, "abort")
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) < 80
    assert plain.greedy() == plain.a.hf


def test_keep_mode_request_finishes_after_the_install(plain: Async) -> None:
    out, report = _in_flight(plain, plain.b, "keep")
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 80
    assert plain.engine_version() == str(report.weight_version)
    assert plain.greedy() == plain.b.hf


def test_bad_update_writes_nothing(plain: Async) -> None:
    before, version = plain.greedy(), plain.engine_version()
    sd = plain.a.state_dict()
    del sd["model.norm.weight"]
    with pytest.raises(WeightManifestValidationError, match=r"model\.norm\.weight"):
        plain.loop.run(hotweights.install_async(plain.engine, sd, weight_version=plain.version + 1, **plain.options))
    assert plain.engine_version() == version
    assert plain.greedy() == before


def test_failed_write_resumes_fails_closed_then_heals(plain: Async, monkeypatch: pytest.MonkeyPatch) -> None:
    def garbage(path: Path, items: object) -> None:
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")

    monkeypatch.setattr(weights_path, "_write_safetensors", garbage)
    with pytest.raises(InstallError, match="failed while writing"):
        plain.install(plain.a)
    plain.version -= 1  # not installed: the same version is accepted next
    assert plain.loop.run(plain.engine.is_paused()) is False  # resumed, also on failure
    with pytest.raises(PartialUpdateError):
        plain.greedy()
    assert our_shm() == []
    monkeypatch.undo()
    plain.install(plain.a)
    assert plain.greedy() == plain.a.hf


def test_with_the_worker_extension(loop: EventLoopThread, checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    engine = loop.call(start_async_engine, a.path, worker_extension_cls=hotweights.WORKER_EXTENSION)
    try:
        ext = Async(loop, engine, a, b)
        report = ext.install(b)
        assert report.adapter == "multiprocess-shm"
        assert ext.greedy() == b.hf
        assert ext.engine_version() == "1"
        ext.install(a)
        assert ext.greedy() == a.hf
        assert our_shm() == []
        # Paused by someone else: vLLM says "sleeping", the workers say their weights are awake, so the install goes
        # on under that pause and leaves it (before: EngineSleepingError)
        loop.run(engine.pause_generation(mode="wait"))
        assert loop.run(engine.is_sleeping()) is True
        report = ext.install(b)
        assert loop.run(engine.is_paused()) is True  # left as it was found
        loop.run(engine.resume_generation())
        assert ext.greedy() == b.hf and ext.engine_version() == str(report.weight_version)
    finally:
        engine.shutdown()


@pytest.mark.matrix
@pytest.mark.parametrize("extension", [False, True], ids=["zero-config", "extension"])
def test_moe_async_llm_a_to_b_to_a(
    loop: EventLoopThread, checkpoint: Callable[[Variant, int], TinyCheckpoint], extension: bool
) -> None:
    """Qwen3-MoE on an AsyncLLM: the trainer's fused experts, through vLLM's own reload (mended by hotweights'
    plugin in the engine's processes) and through the extension (``make test-matrix``)."""
    moe = Variant("qwen3_moe", torch.float32, tie=False)
    a, b = checkpoint(moe, 1), checkpoint(moe, 2)
    kwargs = {"worker_extension_cls": hotweights.WORKER_EXTENSION} if extension else {}
    engine = loop.call(start_async_engine, a.path, **kwargs)
    try:
        eng = Async(loop, engine, a, b)
        assert a.fresh != b.fresh and eng.greedy() == a.fresh
        report = eng.install(b)
        assert report.adapter == ("multiprocess-shm" if extension else "weights-path")
        assert eng.greedy() == b.fresh
        eng.install(a)
        assert eng.greedy() == a.fresh
    finally:
        engine.shutdown()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert our_shm() == []
