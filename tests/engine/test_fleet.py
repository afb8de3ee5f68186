"""``hotweights.Fleet`` over real engines: two multiprocess ``LLM`` replicas with the worker extension and one
``AsyncLLM`` (on an event loop in a background thread), shared by the module. A->B->A equal to fresh engines on
each, one copy of each bucket for the three, a bad update refused everywhere, a commit that fails on one replica
fences it alone, a replica killed while staging aborts the others, and staging that expires."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights import (
    Fleet,
    FleetAbortedError,
    FleetPartialCommitError,
    NonFiniteWeightsError,
    PartialUpdateError,
    WeightManifestValidationError,
)
from hotweights.adapters.installer import Installer
from hotweights.testing import EventLoopThread, start_async_engine

from ..conftest import poisoned, refused_as
from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine
from .test_async_llm import greedy

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


class Replicas:
    def __init__(self, loop: EventLoopThread, llms: list[Any], async_engine: Any, a: TinyCheckpoint, b: TinyCheckpoint):
        self.loop, self.llms, self.async_engine, self.a, self.b = loop, llms, async_engine, a, b
        self.fleet = Fleet([*llms, async_engine])
        self.version = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def install(self, ckpt: TinyCheckpoint, **options: Any) -> hotweights.fleet.FleetReport:
        v = self.next_version()
        return self.loop.run(self.fleet.install_async(ckpt.state_dict(), weight_version=v, **options))

    def outputs(self) -> list[list[list[int]]]:
        """Greedy outputs of every replica, in the fleet's order."""
        return [greedy_vllm(llm) for llm in self.llms] + [self.loop.run(greedy(self.async_engine))]

    def engine_versions(self) -> list[str]:
        return [str(llm.llm_engine.get_weight_version()) for llm in self.llms] + [
            str(self.loop.run(self.async_engine.get_weight_version()))
        ]

    def status(self, i: int) -> dict[str, Any]:
        status = self.fleet.engines[i].workers.status()
        assert status is not None
        return status


@pytest.fixture(scope="module")
def replicas(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Replicas]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    assert a.fresh != b.fresh  # the two policies are told apart by their outputs
    llms = [start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION) for _ in range(2)]
    loop = EventLoopThread()
    engine = loop.call(start_async_engine, a.path, worker_extension_cls=hotweights.WORKER_EXTENSION)
    yield Replicas(loop, llms, engine, a, b)
    engine.shutdown()
    loop.close()
    for llm in llms:
        with contextlib.suppress(Exception):  # the last test killed the second one's engine
            stop_engine(llm, wait=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert our_shm() == []


def test_a_to_b_to_a_on_every_replica_with_one_copy(replicas: Replicas) -> None:
    a, b = replicas.a, replicas.b
    assert replicas.outputs() == [a.fresh] * 3
    report = replicas.install(b)
    assert report.ok and len(report.replicas) == 3
    assert replicas.outputs() == [b.fresh] * 3  # each equal to a freshly started engine on B
    assert replicas.engine_versions() == [str(report.weight_version)] * 3
    # the three replicas share this host's shared memory: each bucket was written once, not three times
    assert report.bytes_written == report.update_bytes > 0
    assert {r.adapter for r in report.replicas if r} == {"multiprocess-shm"}
    assert all(r is not None and r.weight_version == report.weight_version for r in report.replicas)
    back = replicas.install(a)
    assert replicas.outputs() == [a.fresh] * 3
    assert replicas.engine_versions() == [str(back.weight_version)] * 3
    assert "3/3 replicas" in str(back)


def test_generation_reports_the_fleet_version(replicas: Replicas) -> None:
    from vllm import SamplingParams

    report = replicas.install(replicas.b)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for llm in replicas.llms:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)[0]
        assert hotweights.weight_version_of(out) == report.weight_version


def test_a_bad_update_is_refused_on_every_replica_before_any_write(replicas: Replicas) -> None:
    before, versions = replicas.outputs(), replicas.engine_versions()
    sd = replicas.a.state_dict()
    name = next(n for n in sd if n.endswith("q_proj.weight"))
    sd[name] = torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1])
    with pytest.raises(WeightManifestValidationError, match="q_proj"):
        replicas.loop.run(replicas.fleet.install_async(sd, weight_version=replicas.next_version()))
    assert replicas.outputs() == before
    assert replicas.engine_versions() == versions
    assert [replicas.status(i)["session"] for i in range(3)] == ["", "", ""]


def test_nan_and_inf_are_refused_on_every_replica_before_any_write(replicas: Replicas) -> None:
    before, versions = replicas.outputs(), replicas.engine_versions()
    sd, named = poisoned(replicas.b.state_dict() if before[0] != replicas.b.fresh else replicas.a.state_dict())
    with pytest.raises(NonFiniteWeightsError) as info:
        replicas.loop.run(replicas.fleet.install_async(sd, weight_version=replicas.next_version()))
    found = refused_as(info.value)
    del info
    assert found and found.items() <= named.items()
    assert replicas.outputs() == before  # every replica still serves its version, none fenced
    assert replicas.engine_versions() == versions
    assert [replicas.status(i)["session"] for i in range(3)] == ["", "", ""]
    assert our_shm() == []


def test_a_commit_that_fails_fences_that_replica_alone(replicas: Replicas, monkeypatch: pytest.MonkeyPatch) -> None:
    replicas.install(replicas.a)
    adapter = hotweights.adapter_for(replicas.llms[1])
    assert isinstance(adapter, Installer)

    def broken(update_id: str) -> list[Any]:
        raise RuntimeError("the engine's commit RPC failed")

    monkeypatch.setattr(adapter.wire, "commit", broken)
    v = replicas.next_version()
    with pytest.raises(FleetPartialCommitError, match="fenced") as caught:
        replicas.loop.run(replicas.fleet.install_async(replicas.b.state_dict(), weight_version=v))
    report = caught.value.report
    assert [f.index for f in report.fenced] == [1]
    assert report.replicas[0] is not None and report.replicas[2] is not None
    with pytest.raises(PartialUpdateError):  # the fenced replica refuses generation
        greedy_vllm(replicas.llms[1])
    assert greedy_vllm(replicas.llms[0]) == replicas.b.fresh
    assert replicas.loop.run(greedy(replicas.async_engine)) == replicas.b.fresh
    versions = replicas.engine_versions()
    assert versions[0] == versions[2] == str(v) and versions[1] != str(v)  # the fenced one: its last complete install
    monkeypatch.undo()
    healed = replicas.install(replicas.b)  # a later install heals it
    assert healed.ok
    assert replicas.outputs() == [replicas.b.fresh] * 3


def test_stage_then_abort_keeps_every_replica_on_its_version(replicas: Replicas) -> None:
    before, versions = replicas.outputs(), replicas.engine_versions()
    staged = replicas.loop.run(_stage_async(replicas.fleet, replicas.a.state_dict(), replicas.next_version()))
    assert all(replicas.status(i)["session"] for i in range(3))  # staged on every replica: a session is open
    assert replicas.outputs() == before  # and generation still runs on the old weights meanwhile
    staged.abort()
    assert [replicas.status(i)["session"] for i in range(3)] == ["", "", ""]
    assert replicas.outputs() == before and replicas.engine_versions() == versions


def test_staging_expires_when_no_commit_comes(replicas: Replicas) -> None:
    before, versions = replicas.outputs(), replicas.engine_versions()
    fleet = Fleet(replicas.fleet.engines, staging_expiry=3.0)
    staged = replicas.loop.run(_stage_async(fleet, replicas.a.state_dict(), replicas.next_version()))
    update = replicas.status(0)["session"]
    assert update
    time.sleep(4.5)  # the trainer "went away": every worker drops what it staged
    for i in range(3):
        status = replicas.status(i)
        assert status["session"] == "" and update in status["expired"]
    with pytest.raises(FleetAbortedError, match="staging expiry"):
        staged.commit()
    assert replicas.outputs() == before and replicas.engine_versions() == versions
    assert our_shm() == [] or all(p.startswith("hotweights-") for p in our_shm())


async def _stage_async(fleet: Fleet, sd: dict[str, torch.Tensor], version: int) -> hotweights.fleet.StagedUpdate:
    import asyncio

    fleet._bind(asyncio.get_running_loop(), {})
    return await asyncio.to_thread(fleet._stage, sd, version, {})


def test_a_replica_killed_while_staging_aborts_the_others(replicas: Replicas, monkeypatch: pytest.MonkeyPatch) -> None:
    """Last in the module: it kills the second replica's engine."""
    survivor, doomed = replicas.llms
    before, version = greedy_vllm(survivor), survivor.llm_engine.get_weight_version()
    target = replicas.a if before == replicas.b.fresh else replicas.b
    assert target.fresh != before  # a write that went through would show
    fleet = Fleet([survivor, doomed])
    adapter = hotweights.adapter_for(doomed)
    assert isinstance(adapter, Installer)
    stage = adapter.wire.stage
    core = doomed.llm_engine.engine_core.resources.engine_manager.processes[0]

    def die_then_stage(*args: Any) -> None:
        os.kill(core.pid, signal.SIGKILL)  # the replica's engine dies in the middle of the transfer
        time.sleep(1.0)  # vLLM's monitor sees it (never reaped here: the monitor waits on the process itself)
        stage(*args)

    monkeypatch.setattr(adapter.wire, "stage", die_then_stage)
    with pytest.raises(hotweights.HotWeightsError) as caught:
        fleet.install(target.state_dict(), weight_version=replicas.next_version())
    assert not isinstance(caught.value, FleetAbortedError)  # the dead replica's own error, not the abort
    assert any("replica 1" in note for note in getattr(caught.value, "__notes__", []))
    assert greedy_vllm(survivor) == before
    assert survivor.llm_engine.get_weight_version() == version
    assert replicas.status(0)["session"] == ""
