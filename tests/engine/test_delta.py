"""Delta installs (``install(..., delta=True)``) into real tiny engines: in-process, then multiprocess.

A' is A with noise on a random 1 % of the positions of every tensor (what one RL optimizer step looks like in bf16):
greedy outputs after a delta A -> A' must equal HF transformers on A' (fp32), with under 10 % of a full install's
bytes sent.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch

import hotweights
from hotweights import DeltaBaseMismatchError, InstallError, WeightUpdateManifest
from hotweights.adapters import VLLMInProcessAdapter, VLLMMultiprocessAdapter
from hotweights.core.buckets import Bucket
from hotweights.handles.llm import LLMHandle
from hotweights.testing import greedy_hf
from hotweights.transports import EngineLink, Stage, WeightTransport, make_transport
from hotweights.vllm import introspect
from hotweights.vllm.worker.ops import reload_checkpoint_tensors

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


def nudged(sd: Mapping[str, torch.Tensor], seed: int, fraction: float = 0.01, scale: float = 0.3) -> dict[str, Any]:
    """``sd`` with Gaussian noise added at a random ``fraction`` of each tensor's positions."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = t + mask * torch.randn(t.shape, generator=g) * scale
    return out


class Trainer:
    """Checkpoint A, a chain of nudged versions A1, A2, ... and HF's greedy outputs on each."""

    def __init__(self, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.a, self.b = a, b
        self._hf = copy.deepcopy(a.model)
        self.steps: list[dict[str, torch.Tensor]] = [a.state_dict()]

    def step(self) -> dict[str, torch.Tensor]:
        self.steps.append(nudged(self.steps[-1], seed=len(self.steps)))
        return self.steps[-1]

    def hf(self, sd: Mapping[str, torch.Tensor]) -> list[list[int]]:
        self._hf.load_state_dict(sd)
        return greedy_hf(self._hf)


@pytest.fixture(scope="module")
def trainer(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Trainer:
    return Trainer(checkpoint(VARIANT, 1), checkpoint(VARIANT, 2))  # B measured before our engines start


# ============================================================================================ in-process
@pytest.fixture(scope="module")
def inprocess(trainer: Trainer) -> Iterator[Any]:
    llm = start_engine(trainer.a.path, multiprocess=False)
    yield llm
    stop_engine(llm)


def test_inprocess_first_delta_is_full_then_a_to_a_prime(inprocess: Any, trainer: Trainer) -> None:
    first = hotweights.install(inprocess, trainer.a.state_dict(), weight_version=1, delta=True)
    assert (first.delta, first.bytes_sent) == ("full", first.num_bytes)
    assert first.adapter == "inprocess-auto"
    for v in (2, 3):
        previous, sd = trainer.steps[-1], trainer.step()
        report = hotweights.install(inprocess, sd, weight_version=v, delta=True)
        assert report.delta == "applied"
        assert report.delta_changed == sum(not torch.equal(previous[n], sd[n]) for n in sd) > len(sd) // 2
        assert report.bytes_sent < 0.1 * report.num_bytes, str(report)
        expected = trainer.hf(sd)
        assert expected != trainer.a.fresh, "the nudge must change outputs, or this proves nothing"
        assert greedy_vllm(inprocess) == expected
        assert inprocess.llm_engine.get_weight_version() == str(v)


def test_a_full_install_through_another_adapter_keeps_the_delta_base(inprocess: Any, trainer: Trainer) -> None:
    """The delta base lives with the engine's handle: once deltas are in use on the engine, a full install made by
    any adapter on it keeps the base current, so the next delta applies against what the engine serves. (It was
    per adapter: this delta was refused and sent everything.)"""
    b = trainer.b
    other = VLLMInProcessAdapter(inprocess, install_method="reload")
    other.install(WeightUpdateManifest.from_state_dict(b.state_dict(), weight_version=50), b.state_dict())
    assert greedy_vllm(inprocess) == b.fresh
    sd = nudged(b.state_dict(), seed=50)
    report = hotweights.install(inprocess, sd, weight_version=51, delta=True)
    assert report.delta == "applied" and report.bytes_sent < 0.1 * report.num_bytes, str(report)
    assert greedy_vllm(inprocess) == trainer.hf(sd)
    trainer.steps.append(sd)


def test_inprocess_delta_with_the_wrong_base_refused(inprocess: Any, trainer: Trainer) -> None:
    """Weights installed behind hotweights' back (vLLM's own reload and version record): the engine no longer serves
    the base, so the delta is refused and nothing is written."""
    b = trainer.b
    inprocess.collective_rpc(reload_checkpoint_tensors, args=(list(b.state_dict().items()),))
    introspect.set_engine_weight_version(inprocess, "70")
    inprocess.reset_prefix_cache()
    assert greedy_vllm(inprocess) == b.fresh
    with pytest.raises(DeltaBaseMismatchError, match="serves v70"):
        hotweights.install(inprocess, trainer.step(), weight_version=71, delta=True)
    assert greedy_vllm(inprocess) == b.fresh  # nothing written
    assert inprocess.llm_engine.get_weight_version() == "70"
    # a full install, then deltas again
    sd = trainer.steps[-1]
    report = hotweights.install(inprocess, sd, weight_version=72, delta=False)
    assert report.delta == "off" and report.bytes_sent == report.num_bytes
    sd = trainer.step()
    report = hotweights.install(inprocess, sd, weight_version=73, delta=True)
    assert report.delta == "applied"
    assert greedy_vllm(inprocess) == trainer.hf(sd)


def test_inprocess_delta_through_install_async(inprocess: Any, trainer: Trainer) -> None:
    sd = trainer.step()
    report = asyncio.run(hotweights.install_async(inprocess, sd, weight_version=80, delta=True))
    assert report.delta == "applied" and report.bytes_sent < 0.1 * report.num_bytes
    assert greedy_vllm(inprocess) == trainer.hf(sd)


def test_inprocess_delta_that_changes_nothing(inprocess: Any, trainer: Trainer) -> None:
    """The same weights again: nothing crosses and nothing is written, and the version moves on."""
    sd = trainer.steps[-1]
    hotweights.install(inprocess, sd, weight_version=81, delta=True, force=True)  # the base: sd (full, or a delta)
    report = hotweights.install(inprocess, sd, weight_version=82, delta=True)
    assert (report.delta, report.delta_changed, report.bytes_sent) == ("applied", 0, 0), str(report)
    assert inprocess.llm_engine.get_weight_version() == "82"
    assert greedy_vllm(inprocess) == trainer.hf(sd)


# ============================================================================================ multiprocess
@pytest.fixture(scope="module")
def multiprocess(trainer: Trainer) -> Iterator[Any]:
    llm = start_engine(trainer.a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    yield llm
    stop_engine(llm)
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


class DyingTransport(WeightTransport):
    """The shm transport, dying after ``after`` buckets (a trainer killed mid-delta)."""

    name = "shm"  # type: ignore[assignment]

    def __init__(self, after: int) -> None:
        self.inner = make_transport("shm")
        self.after = after
        self.sends = 0

    def connect(self, engine: EngineLink) -> None:
        self.inner.connect(engine)

    def close(self) -> None:
        self.inner.close()

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self.sends >= self.after:
            raise ConnectionError(f"sender died after {self.sends} buckets")
        self.sends += 1
        self.inner.send(bucket, tensors, stage)


def test_multiprocess_a_to_a_prime_and_faults(multiprocess: Any, trainer: Trainer) -> None:
    llm = multiprocess
    adapter = VLLMMultiprocessAdapter(llm, transport="shm", bucket_bytes=8192)

    def install(sd: Mapping[str, torch.Tensor], v: int, delta: bool = True, via: Any = adapter) -> Any:
        return via.install(WeightUpdateManifest.from_state_dict(sd, weight_version=v), sd, delta=delta)

    trainer.steps = [trainer.a.state_dict()]
    assert install(trainer.a.state_dict(), 1).delta == "full"
    sd = trainer.step()
    report = install(sd, 2)
    assert report.delta == "applied" and report.adapter == "multiprocess-shm"
    assert report.bytes_sent < 0.1 * report.num_bytes, str(report)
    assert greedy_vllm(llm) == trainer.hf(sd)
    assert llm.llm_engine.get_weight_version() == "2"

    # a sender killed mid-delta: the previous version keeps serving, and the next delta still applies
    dying, kept = DyingTransport(after=2), adapter.transport
    adapter.transport = dying
    dying.connect(adapter)
    try:
        with pytest.raises(InstallError) as info:
            install(trainer.step(), 3)
    finally:
        adapter.transport = kept
    assert isinstance(info.value.__cause__, ConnectionError) and dying.sends == 2
    assert greedy_vllm(llm) == trainer.hf(sd) and llm.llm_engine.get_weight_version() == "2"
    sd = trainer.steps[-1]
    report = install(sd, 3)
    assert report.delta == "applied"
    assert greedy_vllm(llm) == trainer.hf(sd)

    # a delta against a base the workers do not hold: another trainer (its own handle on the engine, as from another
    # process) installed B meanwhile
    b = trainer.b
    other = VLLMMultiprocessAdapter(LLMHandle(llm), transport="shm")
    install(b.state_dict(), 10, delta=False, via=other)
    with pytest.raises(DeltaBaseMismatchError, match="serves v10"):
        install(trainer.step(), 11)
    assert greedy_vllm(llm) == b.fresh and llm.llm_engine.get_weight_version() == "10"
    # a full install from this trainer, then deltas again
    adapter.active_weight_version = 10
    assert install(trainer.steps[-1], 11, delta=False).delta == "off"
    sd = trainer.step()
    report = install(sd, 12)
    assert report.delta == "applied" and report.bytes_sent < 0.1 * report.num_bytes
    assert greedy_vllm(llm) == trainer.hf(sd)


def test_multiprocess_delta_that_changes_nothing(multiprocess: Any, trainer: Trainer) -> None:
    """One worker, nothing to send: no bucket, so the session runs without the one-call path."""
    adapter = VLLMMultiprocessAdapter(multiprocess, transport="shm")
    sd = trainer.steps[-1]
    version = (adapter.active_weight_version or 0) + 1
    first = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version), sd, delta=True)
    assert first.delta in ("full", "applied"), str(first)
    report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd, delta=True)
    assert (report.delta, report.delta_changed, report.bytes_sent) == ("applied", 0, 0), str(report)
    assert multiprocess.llm_engine.get_weight_version() == str(version + 1)
    assert greedy_vllm(multiprocess) == trainer.hf(sd)
