"""Tensor parallelism: one real TP=2 engine (two CPU workers), A -> B -> A through every install path."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import WeightUpdateManifest
from hotweights.adapters import VLLMMultiprocessAdapter, VLLMWeightsPathAdapter, WeightInstallAdapter
from hotweights.transports import make_transport
from hotweights.transports.shm_files import SHM_DIR

from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def _bind_two_workers() -> str:
    """One core per CPU worker (vLLM's CPU backend binds each TP worker's OpenMP threads to its own cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores")
    return f"{cores[0]}|{cores[1]}"


class TP:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.llm, self.a, self.b = llm, a, b
        self.version = 0

    def install(self, adapter: WeightInstallAdapter, ckpt: TinyCheckpoint) -> hotweights.InstallReport:
        self.version += 1
        adapter.active_weight_version = self.version - 1  # several adapters, one version line
        sd = ckpt.state_dict()
        return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version), sd)


@contextlib.contextmanager
def tp2_engine(path: Path) -> Iterator[Any]:
    """A TP=2 multiprocess engine with the worker extension, one core per worker; stopped and cleaned after."""
    previous = os.environ.get(BIND)
    os.environ[BIND] = _bind_two_workers()  # without it: "Not enough allowed NUMA nodes to bind threads"
    llm = start_engine(
        path, multiprocess=True, tensor_parallel_size=2, worker_extension_cls=hotweights.WORKER_EXTENSION
    )
    try:
        assert llm.llm_engine.vllm_config.parallel_config.world_size == 2
        yield llm
    finally:
        stop_engine(llm, wait=True)  # the next TP engine binds the same cores
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if previous is None:
            os.environ.pop(BIND, None)
        else:
            os.environ[BIND] = previous
        for leftover in Path(SHM_DIR).glob("vllm_dist_*cpushm*"):  # vLLM's own TP channel, left after shutdown
            leftover.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def tp(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[TP]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    with tp2_engine(a.path) as llm:
        yield TP(llm, a, b)


PATHS: dict[str, Callable[[Any], WeightInstallAdapter]] = {
    "zero-config": lambda llm: VLLMWeightsPathAdapter(llm),
    "multiprocess-shm": lambda llm: VLLMMultiprocessAdapter(llm, bucket_bytes=40_000),
    "direct": lambda llm: VLLMMultiprocessAdapter(llm, install_method="direct"),
    "aside": lambda llm: VLLMMultiprocessAdapter(llm, install_method="aside", bucket_bytes=40_000),
    "streaming-direct-kept": lambda llm: VLLMMultiprocessAdapter(
        llm,
        transport=make_transport("shm", keep_segments=True),
        install_method="direct",
        commit="streaming",
        bucket_bytes=100_000,
    ),
    "collective": lambda llm: VLLMMultiprocessAdapter(llm, transport="collective"),
}


@pytest.mark.parametrize("path", PATHS)
def test_a_to_b_to_a(tp: TP, path: str) -> None:
    adapter = PATHS[path](tp.llm)
    try:
        tp.install(adapter, tp.b)
        assert greedy_vllm(tp.llm) == tp.b.hf
        tp.install(adapter, tp.a)
        assert greedy_vllm(tp.llm) == tp.a.hf
        assert tp.llm.llm_engine.get_weight_version() == str(tp.version)
    finally:
        adapter.close()
    assert our_shm() == []


def test_one_call_install(tp: TP) -> None:
    tp.version += 1
    report = hotweights.install(tp.llm, tp.b.state_dict(), weight_version=tp.version)
    assert report.adapter == "multiprocess-shm"
    assert greedy_vllm(tp.llm) == tp.b.hf


def test_deltas_read_one_shared_copy_per_host(tp: TP) -> None:
    """Both workers apply deltas to the trainer's own copy, mapped from shared memory: no worker keeps a copy of its
    own (each kept one before: three copies of the model on this host with the trainer's, nine at TP=8)."""
    from hotweights.testing import greedy_hf
    from hotweights.transports.shm_base import SharedDeltaBase

    hf = copy.deepcopy(tp.a.model)
    adapter = VLLMMultiprocessAdapter(tp.llm)

    def install(sd: dict[str, torch.Tensor]) -> hotweights.InstallReport:
        tp.version += 1
        adapter.active_weight_version = tp.version - 1
        return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=tp.version), sd, delta=True)

    try:
        sd = tp.a.state_dict()
        assert install(sd).delta == "full"
        base = adapter._delta.base
        assert isinstance(base, SharedDeltaBase) and base.path.exists()
        g = torch.Generator().manual_seed(7)
        for _ in range(2):  # A -> A' -> A'': a few elements of every tensor change, the rest come from the base
            sd = {n: t + (torch.rand(t.shape, generator=g) < 0.01) * 0.05 for n, t in sd.items()}
            report = install(sd)
            assert report.delta == "applied" and report.bytes_sent < 0.1 * report.num_bytes, str(report)
            hf.load_state_dict(sd)
            assert greedy_vllm(tp.llm) == greedy_hf(hf)
            assert base.version == tp.version  # moved by the trainer once both workers committed
        status = tp.llm.collective_rpc("hotweights_engine", args=("status", "{}"))
        assert [s["delta_copy_bytes"] for s in status] == [0, 0]  # no private copy on either worker
        assert [s["delta_shared_base"] for s in status] == [str(base.path)] * 2
    finally:
        adapter.forget_delta_base()
        adapter.close()
    status = tp.llm.collective_rpc("hotweights_engine", args=("status", "{}"))
    assert [s["delta_shared_base"] for s in status] == ["", ""]  # unmapped by forget_delta_base
    tp.install(VLLMMultiprocessAdapter(tp.llm), tp.a)
    assert greedy_vllm(tp.llm) == tp.a.hf
