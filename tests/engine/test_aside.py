"""install_method="aside": the update is built into a twin of the model while the engine serves the old weights,
and swapped in at the commit. Real engines: an in-process tied Qwen2 (tensors by reference, a tied LM head re-tied in
the twin) and a multiprocess Qwen3-MoE with the worker extension (buckets over shm, fused experts re-packed)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights.adapters import VLLMInProcessAdapter, VLLMMultiprocessAdapter
from hotweights.adapters.sending import ASIDE_BUCKET_BYTES
from hotweights.core import two_phase
from hotweights.core.buckets import default_bucket_bytes

from .conftest import Checkpoints, TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

TIED = Variant("qwen2", torch.float32, tie=True)
MOE = Variant("qwen3_moe", torch.float32, tie=False)


class Served:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint, make: Callable[..., Any]) -> None:
        self.llm, self.a, self.b, self.make = llm, a, b, make
        self.version = 0

    def install(self, ckpt: TinyCheckpoint, **options: Any) -> hotweights.InstallReport:
        self.version += 1
        adapter = self.make(self.llm, install_method="aside", **options)
        return hotweights.install(self.llm, ckpt.state_dict(), weight_version=self.version, adapter=adapter)


@pytest.fixture(scope="module")
def inprocess(checkpoint: Checkpoints) -> Iterator[Served]:
    a, llm = checkpoint.served(TIED, 1, lambda p: start_engine(p, multiprocess=False))
    yield Served(llm, a, checkpoint.expected(TIED, 2), VLLMInProcessAdapter)
    stop_engine(llm)


@pytest.fixture(scope="module")
def multiprocess(checkpoint: Checkpoints) -> Iterator[Served]:
    a, llm = checkpoint.served(
        MOE, 1, lambda p: start_engine(p, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    )
    yield Served(llm, a, checkpoint.expected(MOE, 2), VLLMMultiprocessAdapter)
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _serves_old_until_the_commit(served: Served, monkeypatch: pytest.MonkeyPatch, old: TinyCheckpoint) -> list[Any]:
    """At the commit point (every bucket built aside, every worker prepared, nothing swapped) the engine must
    still serve ``old`` exactly: the twin shares nothing the update writes with the live model."""
    seen: list[Any] = []
    original = two_phase.commit_point

    def look(member: Any) -> None:
        seen.append(greedy_vllm(served.llm))
        original(member)

    monkeypatch.setattr(two_phase, "commit_point", look)
    return seen


@pytest.mark.parametrize("engine", ["inprocess", "multiprocess"])
def test_aside_serves_the_old_weights_until_the_swap_then_exactly_the_new(
    engine: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: Served = request.getfixturevalue(engine)
    assert served.a.fresh != served.b.fresh
    for old, new in ((served.a, served.b), (served.b, served.a), (served.a, served.b)):
        with monkeypatch.context() as patch:
            seen = _serves_old_until_the_commit(served, patch, old)
            report = served.install(new)
        assert seen == [old.fresh]
        assert report.install_method == "aside"
        assert greedy_vllm(served.llm) == new.fresh
    assert our_shm() == []


def test_aside_after_a_reload_of_the_live_model(inprocess: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's reload of the live model leaves its buffering loaders on what it recorded to reload each layer: the
    twin must load through its own, never into the live layers."""
    inprocess.version += 1
    reload = VLLMInProcessAdapter(inprocess.llm, install_method="reload")
    hotweights.install(inprocess.llm, inprocess.a.state_dict(), weight_version=inprocess.version, adapter=reload)
    assert greedy_vllm(inprocess.llm) == inprocess.a.fresh
    with monkeypatch.context() as patch:
        seen = _serves_old_until_the_commit(inprocess, patch, inprocess.a)
        inprocess.install(inprocess.b)
    assert seen == [inprocess.a.fresh]
    assert greedy_vllm(inprocess.llm) == inprocess.b.fresh


def test_an_aside_install_stopped_at_the_commit_point_leaves_the_engine_as_it_was(
    inprocess: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = greedy_vllm(inprocess.llm)
    version = inprocess.llm.llm_engine.get_weight_version()
    target = inprocess.b if before == inprocess.a.fresh else inprocess.a

    def stop(member: Any) -> None:
        raise KeyboardInterrupt  # the trainer is interrupted with everything built aside

    monkeypatch.setattr(two_phase, "commit_point", stop)
    with pytest.raises(KeyboardInterrupt):
        inprocess.install(target)
    monkeypatch.undo()
    assert greedy_vllm(inprocess.llm) == before
    assert inprocess.llm.llm_engine.get_weight_version() == version
    inprocess.install(target)  # the next install builds a new twin
    assert greedy_vllm(inprocess.llm) == target.fresh


def test_no_twin_outlives_its_install(inprocess: Served) -> None:
    """The twin's records in vLLM's reload table hold loaders bound to the twin, so the table's weak keys alone
    never let it go: each install would keep a processed copy of the model (measured: a worker OOM-killed at
    16.6 GB after a dozen installs of 612 MB)."""
    from vllm.model_executor.model_loader.reload import layerwise

    inprocess.install(inprocess.a)
    gc.collect()
    before = len(layerwise.LAYERWISE_INFO)
    for ckpt in (inprocess.b, inprocess.a):
        inprocess.install(ckpt)
    gc.collect()
    assert len(layerwise.LAYERWISE_INFO) == before


def test_aside_refuses_what_it_cannot_do(inprocess: Served, multiprocess: Served) -> None:
    with pytest.raises(ValueError, match="atomic commit"):
        VLLMMultiprocessAdapter(multiprocess.llm, install_method="aside", commit="streaming")
    with pytest.raises(ValueError, match="verify=True reads back"):
        VLLMInProcessAdapter(inprocess.llm, install_method="aside", verify=True)
    version = inprocess.llm.llm_engine.get_weight_version()
    adapter = VLLMInProcessAdapter(inprocess.llm, install_method="aside")
    with pytest.raises(hotweights.EngineNotSupportedError, match="aside"):
        hotweights.install(inprocess.llm, inprocess.a.state_dict(), weight_version=10_000, adapter=adapter, delta=True)
    assert inprocess.llm.llm_engine.get_weight_version() == version


def test_aside_keeps_its_buckets_small(multiprocess: Served) -> None:
    """Each aside bucket is built inside its stage call, which holds the engine's step loop: by default its buckets
    stay at ASIDE_BUCKET_BYTES while an atomic install's take the transport's larger preferred size."""
    aside = VLLMMultiprocessAdapter(multiprocess.llm, install_method="aside")
    atomic = VLLMMultiprocessAdapter(multiprocess.llm)
    assert atomic.transport.preferred_bucket_bytes > ASIDE_BUCKET_BYTES
    assert aside.bucket_size == default_bucket_bytes(ASIDE_BUCKET_BYTES) < atomic.bucket_size  # type: ignore[operator]
    given = VLLMMultiprocessAdapter(multiprocess.llm, install_method="aside", bucket_bytes=1 << 30)
    assert given.bucket_size == 1 << 30
