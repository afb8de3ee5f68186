"""The fleet's coordination (:mod:`hotweights.core.two_phase`), with threads and an in-memory transport: pure logic
(real engines: ``tests/engine/test_fleet.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from hotweights.core import two_phase
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.errors import FleetAbortedError, HotWeightsError, HotWeightsTimeoutError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports.transport import Stage, WeightTransport


class Counting(WeightTransport):
    name = "counting"
    shareable = True

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        self.sent.append(bucket.index)
        stage({"transport": self.name, "index": bucket.index})


def plan(n: int = 3) -> tuple[list[Bucket], dict[str, torch.Tensor]]:
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(n)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    return plan_buckets(manifest, 1024), tensors


def run_members(coordinator: two_phase.Coordinator, bodies: list[Any]) -> list[Any]:
    outcomes: list[Any] = [None] * len(bodies)

    def run(i: int) -> None:
        member = two_phase.Member(coordinator, i, 1024, 5.0)
        try:
            outcomes[i] = bodies[i](member)
        except BaseException as exc:
            outcomes[i] = exc
            coordinator.failed(i, exc)
        finally:
            coordinator.done(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return [outcomes, threads]


def test_a_shared_bucket_is_packed_once_and_staged_by_every_member() -> None:
    buckets, tensors = plan()
    transport = Counting()
    coordinator = two_phase.Coordinator(3, staging_timeout=5.0)
    coordinator.add_group(transport, [0, 1, 2])
    staged: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def body(i: int) -> Any:
        def go(member: two_phase.Member) -> str:
            for b in buckets:
                two_phase.share(member, transport, b, tensors, lambda d, i=i: staged[i].append(d["index"]))
            two_phase.commit_point(member)
            return "committed"

        return go

    outcomes, _ = run_members(coordinator, [body(i) for i in range(3)])
    coordinator.wait_staged(5.0)
    assert coordinator.decide("commit")
    assert coordinator.wait_finished(5.0)
    assert outcomes == ["committed"] * 3
    assert transport.sent == [b.index for b in buckets]  # once per bucket, not once per member
    assert all(staged[i] == transport.sent for i in range(3))
    assert coordinator.bytes_written == sum(b.nbytes for b in buckets)
    coordinator.close()


def test_one_members_failure_aborts_the_others_at_the_commit_point_and_while_waiting_for_a_bucket() -> None:
    buckets, tensors = plan()
    transport = Counting()
    coordinator = two_phase.Coordinator(3, staging_timeout=5.0)
    coordinator.add_group(transport, [1, 2])

    def staged_first(member: two_phase.Member) -> str:
        two_phase.commit_point(member)
        return "wrote"

    def fails(member: two_phase.Member) -> str:
        raise ValueError("bad tensor")

    def waits_for_a_bucket(member: two_phase.Member) -> str:
        two_phase.share(member, transport, buckets[0], tensors, lambda d: None)
        return "wrote"

    outcomes, _ = run_members(coordinator, [staged_first, fails, waits_for_a_bucket])
    coordinator.wait_staged(5.0)
    assert coordinator.wait_finished(5.0)
    assert coordinator.decision == "abort" and "replica 1 failed" in coordinator.reason
    assert isinstance(outcomes[0], FleetAbortedError) and isinstance(outcomes[2], FleetAbortedError)
    assert isinstance(outcomes[1], ValueError)
    assert not coordinator.decide("commit")  # too late: the fleet decided
    assert transport.sent == []
    coordinator.close()


def test_a_members_failing_stage_is_its_own_and_the_others_carry_on() -> None:
    buckets, tensors = plan(1)
    transport = Counting()
    coordinator = two_phase.Coordinator(2, staging_timeout=5.0)
    coordinator.add_group(transport, [0, 1])

    def deliver_fails(d: Any) -> None:
        raise ConnectionError("engine gone")

    bodies = [
        lambda m: two_phase.share(m, transport, buckets[0], tensors, lambda d: None) or "staged",
        lambda m: two_phase.share(m, transport, buckets[0], tensors, deliver_fails),
    ]
    outcomes, threads = run_members(coordinator, bodies)
    for t in threads:
        t.join(5.0)
    assert outcomes[0] == "staged"  # its own stage went through; the fleet aborts it at its commit point
    assert isinstance(outcomes[1], ConnectionError)
    coordinator.close()


def test_members_that_plan_different_buckets_are_refused() -> None:
    buckets, tensors = plan(2)
    transport = Counting()
    coordinator = two_phase.Coordinator(2, staging_timeout=5.0)
    coordinator.add_group(transport, [0, 1])
    other = buckets[0].model_copy(update={"nbytes": buckets[0].nbytes + 1})
    bodies = [
        lambda m: two_phase.share(m, transport, buckets[0], tensors, lambda d: None),
        lambda m: two_phase.share(m, transport, other, tensors, lambda d: None),
    ]
    outcomes, threads = run_members(coordinator, bodies)
    for t in threads:
        t.join(5.0)
    assert all(isinstance(o, HotWeightsError) and "same model" in str(o) for o in outcomes)
    assert transport.sent == []
    coordinator.close()


def test_no_decision_within_the_staging_expiry_aborts() -> None:
    coordinator = two_phase.Coordinator(1, staging_timeout=0.3)
    outcomes, threads = run_members(coordinator, [two_phase.commit_point])
    start = time.monotonic()
    threads[0].join(5.0)
    assert 0.25 < time.monotonic() - start < 3.0
    assert isinstance(outcomes[0], FleetAbortedError) and "staging expiry" in str(outcomes[0])


def test_a_member_that_never_stages_times_the_fleet_out() -> None:
    coordinator = two_phase.Coordinator(2, staging_timeout=5.0)
    gate = threading.Event()
    outcomes, threads = run_members(coordinator, [two_phase.commit_point, lambda m: gate.wait(5.0)])
    with pytest.raises(HotWeightsTimeoutError, match=r"replica\(s\) \[1\] did not finish staging"):
        coordinator.wait_staged(0.3)
    gate.set()
    for t in threads:
        t.join(5.0)
    assert isinstance(outcomes[0], FleetAbortedError)


def test_outside_a_fleet_commit_point_returns_and_share_sends() -> None:
    buckets, tensors = plan(1)
    transport = Counting()
    got: list[Any] = []
    two_phase.commit_point(None)
    two_phase.share(None, transport, buckets[0], tensors, got.append)
    assert transport.sent == [0] and got == [{"transport": "counting", "index": 0}]


def test_a_member_that_returns_without_stopping_is_not_waited_for_and_is_named() -> None:
    coordinator = two_phase.Coordinator(2, staging_timeout=5.0)
    outcomes, threads = run_members(coordinator, [two_phase.commit_point, lambda m: "installed at once"])
    coordinator.wait_staged(2.0)  # does not hang on the member that never reached the commit point
    assert coordinator.unstopped == {1}
    assert coordinator.decide("commit")
    for t in threads:
        t.join(5.0)
    assert outcomes == [None, "installed at once"]
