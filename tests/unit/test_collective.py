"""The collective transport end to end on gloo, with a thread standing in for an engine worker (no vLLM): the real
worker extension's ``hotweights_engine`` operations, reached as the extension's wire reaches them (JSON arguments)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hotweights import HotWeightsError, HotWeightsTimeoutError, InstallError, WeightUpdateManifest
from hotweights.core import attach
from hotweights.core.buckets import plan_buckets, unpack
from hotweights.transports import EngineLink
from hotweights.transports import collective as coll
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension
from hotweights.vllm.worker.session import SessionOptions


class FakeWorker(HotWeightsWorkerExtension):
    rank = 0


class ThreadEngine(EngineLink):
    """An EngineLink whose one 'worker' runs the real worker extension in this process (its operations' arguments
    cross as the JSON object ``hotweights_engine`` reads); ``join=False``: the worker never joins a group."""

    num_workers = 1

    def __init__(self, join: bool = True) -> None:
        self.worker = FakeWorker()
        self.join = join
        self.calls: list[str] = []

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        self.calls.append(op)
        if op == "join_group" and not self.join:
            return [None]
        return [self.worker.hotweights_engine(op, json.dumps(args))]


def test_broadcast_round_trip_and_reconnect() -> None:
    sd = {"a": torch.randn(7, 5), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(3).to(torch.bfloat16)}
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=1)
    engine = ThreadEngine()
    assert isinstance(engine, EngineLink)
    for _ in range(2):  # the second connect replaces the stale group (a trainer that came back)
        transport = coll.Transport(timeout=10)
        transport.connect(engine)
        received: dict[str, torch.Tensor] = {}
        for bucket in plan_buckets(manifest, bucket_bytes=64):
            transport.send(
                bucket,
                sd,
                lambda d, b=bucket, r=received: r.update(
                    unpack(coll.Receiver.open(coll.Receiver.parse(d), engine.worker)[0], b, manifest)
                ),
            )
        assert received.keys() == sd.keys()
        assert all(torch.equal(received[k], sd[k]) for k in sd)
        transport.close()
    assert engine.calls.count("join_group") == 2
    assert engine.calls[-1] == "leave_group"  # close() drops the workers' end
    assert attach.get(engine.worker, "group") is None


def test_rendezvous_times_out_naming_what_it_waited_for() -> None:
    transport = coll.Transport(timeout=1.0)
    start = time.monotonic()
    with pytest.raises(HotWeightsTimeoutError, match=r"rendezvous with 1 engine worker\(s\) at 127\.0\.0\.1:\d+"):
        transport.connect(ThreadEngine(join=False))
    assert time.monotonic() - start < 10


def test_worker_without_group_refuses() -> None:
    with pytest.raises(RuntimeError, match="no hotweights communicator"):
        coll.Receiver.open(coll.Receiver.parse({"transport": "collective", "nbytes": 4}), FakeWorker())


def test_send_before_connect_refused() -> None:
    manifest = WeightUpdateManifest.from_state_dict({"a": torch.zeros(2)}, weight_version=1)
    with pytest.raises(Exception, match="not connected"):
        coll.Transport().send(plan_buckets(manifest)[0], {"a": torch.zeros(2)}, lambda d: None)


def _listening_addresses() -> set[str]:
    """Local addresses of this process's listening TCP sockets (from /proc: no tools needed)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                found.add(cols[1].split(":")[0])
    return found


def test_everything_listens_on_loopback_only() -> None:
    transport = coll.Transport(timeout=10)
    assert transport.host == "127.0.0.1"
    engine = ThreadEngine()
    transport.connect(engine)
    try:
        addresses = _listening_addresses()
        assert addresses, "the rendezvous store should be listening"
        assert addresses <= {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}, (
            f"a socket listens beyond loopback: {addresses}"
        )
    finally:
        transport.close()


# ---------------------------------------------------------------------------------------- failures (issue #18)
def _one_bucket(shape: tuple[int, ...] = (4, 4)) -> tuple[dict[str, torch.Tensor], WeightUpdateManifest, Any]:
    sd = {"a": torch.randn(*shape)}
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=1)
    return sd, manifest, plan_buckets(manifest)[0]


def _stager(engine: ThreadEngine, manifest: WeightUpdateManifest, bucket: Any) -> Any:
    """A stage call into the worker's real install session, opened for ``manifest`` (it refuses a bucket that does
    not fit)."""
    options = SessionOptions(manifest=manifest.to_json(), method="reload")
    opened = engine.worker.hotweights_begin(options.model_dump_json())
    assert opened["ok"], opened
    return lambda d: engine.worker.hotweights_stage(opened["update_id"], bucket.model_dump_json(), d)


def _broadcasts_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hotweights-broadcast")]


def test_refused_stage_fails_send_at_once_with_the_workers_message() -> None:
    sd, _, bucket = _one_bucket()
    _, engine_manifest, _ = _one_bucket((2, 2))  # the engine expects other shapes: refused before receiving
    engine = ThreadEngine()
    transport = coll.Transport(timeout=30)
    transport.connect(engine)
    start = time.monotonic()
    with pytest.raises(InstallError, match=r"refused before receiving.*dropped \(out of step\)") as info:
        transport.send(bucket, sd, _stager(engine, engine_manifest, bucket))
    assert time.monotonic() - start < 5
    assert isinstance(info.value.__cause__, ValueError)
    assert "the manifest says 16" in str(info.value)
    assert not _broadcasts_left()  # the workers dropped their end: the trainer's broadcast ended too
    transport.close()


def test_typed_stage_error_is_raised_as_it_is() -> None:
    sd, _, bucket = _one_bucket()
    engine = ThreadEngine()
    transport = coll.Transport(timeout=30)
    transport.connect(engine)

    def stage(descriptor: Any) -> None:
        raise HotWeightsTimeoutError("waited 5 s for worker call 'hotweights_stage'")

    start = time.monotonic()
    with pytest.raises(HotWeightsTimeoutError, match="hotweights_stage"):
        transport.send(bucket, sd, stage)
    assert time.monotonic() - start < 5
    coll.close_group(engine.worker)  # the workers may still be busy: the trainer left them alone; end it here
    transport.close()


def test_stage_answered_without_receiving_fails_fast() -> None:
    sd, _, bucket = _one_bucket()
    transport = coll.Transport(timeout=30)
    transport.connect(ThreadEngine())
    start = time.monotonic()
    with pytest.raises(InstallError, match="without receiving its broadcast"):
        transport.send(bucket, sd, lambda d: None)  # e.g. a one-call hotweights_begin's {"refused": ...} answer
    assert time.monotonic() - start < 5
    transport.close()


def test_send_after_a_failure_reconnects_instead_of_broadcasting_out_of_step() -> None:
    sd, manifest, bucket = _one_bucket()
    _, engine_manifest, _ = _one_bucket((2, 2))
    engine = ThreadEngine()
    transport = coll.Transport(timeout=5)
    transport.connect(engine)
    with pytest.raises(HotWeightsError):
        transport.send(bucket, sd, _stager(engine, engine_manifest, bucket))
    received: dict[str, torch.Tensor] = {}
    transport.send(
        bucket,
        sd,
        lambda d: received.update(
            unpack(coll.Receiver.open(coll.Receiver.parse(d), engine.worker)[0], bucket, manifest)
        ),
    )
    assert torch.equal(received["a"], sd["a"])
    assert engine.calls.count("join_group") == 2  # a fresh rendezvous, not the stale group
    transport.send(bucket, sd, _stager(engine, manifest, bucket))  # and it stays in step
    assert engine.calls.count("join_group") == 2
    transport.close()


class RefusingEngine(ThreadEngine):
    """Its worker's rank does not fit the group: the worker refuses to join."""

    def __init__(self) -> None:
        super().__init__()
        self.worker.rank = 5


def test_connect_surfaces_the_workers_join_error() -> None:
    transport = coll.Transport(timeout=3)
    start = time.monotonic()
    with pytest.raises(InstallError, match=r"could not join.*group rank 6 does not fit world_size 2") as info:
        transport.connect(RefusingEngine())
    assert time.monotonic() - start < 2
    assert isinstance(info.value.__cause__, ValueError)
    for thread in threading.enumerate():  # the trainer's side waits for the missing rank until its timeout
        if thread.name.startswith("hotweights-rendezvous"):
            thread.join(10)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"host": ""}, "host must be"),
        ({"port": 0}, "port must be an integer in \\[1, 65535\\]"),
        ({"port": 70000}, "port must be"),
        ({"port": "29500"}, "port must be"),
        ({"world_size": 1}, "world_size must be an integer in \\[2, 4097\\]"),
        ({"world_size": 5000}, "world_size must be"),
        ({"world_size": True}, "world_size must be"),
        ({"backend": "mpi"}, "use 'gloo' \\(CPU\\) or 'nccl' \\(GPU\\)"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": -1.0}, "timeout must be a positive number"),
        ({"timeout": float("nan")}, "timeout must be a positive number"),
        ({"timeout": "60"}, "timeout must be a positive number"),
    ],
)
def test_worker_refuses_bad_arguments(change: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"host": "127.0.0.1", "port": 1, "world_size": 2, "backend": "gloo", "timeout": 1.0}
    with pytest.raises(ValueError, match=match):
        coll.init_worker_group(FakeWorker(), **{**args, **change})
    worker = FakeWorker()  # and through the extension, as the trainer reaches it
    with pytest.raises(ValueError, match=match):
        worker.hotweights_engine("join_group", json.dumps({**args, **change}))
    assert attach.get(worker, "group") is None


def _join_through_the_extension(worker: Any, host: str, port: int, world: int, backend: str, timeout: float) -> int:
    args = {"host": host, "port": port, "world_size": world, "backend": backend, "timeout": timeout}
    rank = worker.hotweights_engine("join_group", json.dumps(args))
    assert rank == 1 + worker.rank
    return int(rank)


@pytest.mark.parametrize("join", [coll.init_worker_group, _join_through_the_extension], ids=["function", "extension"])
def test_worker_caps_the_timeout(monkeypatch: pytest.MonkeyPatch, join: Any) -> None:
    seen: list[float] = []
    monkeypatch.setattr(coll, "create_group", lambda *args: seen.append(args[-1]) or object())
    monkeypatch.delenv("HOTWEIGHTS_MAX_RPC_TIMEOUT", raising=False)
    join(FakeWorker(), "127.0.0.1", 1, 2, "gloo", 1e9)
    join(FakeWorker(), "127.0.0.1", 1, 2, "gloo", float("inf"))
    join(FakeWorker(), "127.0.0.1", 1, 2, "gloo", 30)
    monkeypatch.setenv("HOTWEIGHTS_MAX_RPC_TIMEOUT", "5")
    join(FakeWorker(), "127.0.0.1", 1, 2, "gloo", 60)
    assert seen == [coll.MAX_TIMEOUT_S, coll.MAX_TIMEOUT_S, 30.0, 5.0]
    monkeypatch.setenv("HOTWEIGHTS_MAX_RPC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOTWEIGHTS_MAX_RPC_TIMEOUT must be a positive number"):
        join(FakeWorker(), "127.0.0.1", 1, 2, "gloo", 60)


def test_worker_leaves_the_group_through_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coll, "create_group", lambda *args: object())
    worker = FakeWorker()
    assert worker.hotweights_engine("leave_group") is False  # no group yet
    _join_through_the_extension(worker, "127.0.0.1", 1, 2, "gloo", 5.0)
    assert attach.get(worker, "group") is not None
    assert worker.hotweights_engine("leave_group", "{}") is True
    assert attach.get(worker, "group") is None


@pytest.mark.parametrize("nbytes", [-1, "4", True, 2.0, None])
def test_open_bucket_refuses_a_bad_byte_count(nbytes: Any) -> None:
    worker = FakeWorker()
    attach.put(worker, "group", (object(), "gloo"))
    with pytest.raises(ValueError, match="non-negative integer 'nbytes'"):
        coll.Receiver.open(coll.Receiver.parse({"transport": "collective", "nbytes": nbytes}), worker)
