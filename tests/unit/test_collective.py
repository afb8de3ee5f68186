"""The collective transport end to end on gloo, with a thread standing in for an engine worker (no vLLM)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hotweights import HotWeightsTimeoutError, WeightUpdateManifest
from hotweights.core.buckets import plan_buckets, unpack
from hotweights.transports import EngineLink
from hotweights.transports import collective as coll


class FakeWorker:
    rank = 0


class ThreadEngine:
    """An EngineLink whose one 'worker' runs the real engine-side functions in this process."""

    num_workers = 1

    def __init__(self, join: bool = True) -> None:
        self.worker = FakeWorker()
        self.join = join
        self.calls: list[str] = []

    def call(self, method: str, *args: Any) -> list[Any]:
        self.calls.append(method)
        if method == "hotweights_init_communicator" and self.join:
            coll.init_worker_group(self.worker, *args)
        elif method == "hotweights_close_communicator":
            coll.close_group(self.worker)
        return [None]


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
                lambda d, b=bucket, r=received: r.update(unpack(coll.open_bucket(d, engine.worker)[0], b, manifest)),
            )
        assert received.keys() == sd.keys()
        assert all(torch.equal(received[k], sd[k]) for k in sd)
        transport.close()
    assert engine.calls.count("hotweights_init_communicator") == 2
    assert getattr(engine.worker, "_hotweights_group", None) is None


def test_rendezvous_times_out_naming_what_it_waited_for() -> None:
    transport = coll.Transport(timeout=1.0)
    start = time.monotonic()
    with pytest.raises(HotWeightsTimeoutError, match=r"rendezvous with 1 engine worker\(s\) at 127\.0\.0\.1:\d+"):
        transport.connect(ThreadEngine(join=False))
    assert time.monotonic() - start < 10


def test_worker_without_group_refuses() -> None:
    with pytest.raises(RuntimeError, match="no hotweights communicator"):
        coll.open_bucket({"transport": "collective", "nbytes": 4}, FakeWorker())


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
