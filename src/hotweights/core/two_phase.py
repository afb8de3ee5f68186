"""Two-phase installs across several engines: where an adapter stops between *staged* and *written*, and the
buckets several engines share.

A :class:`~hotweights.fleet.Fleet` runs one ordinary install per replica, each in its own thread, as a :class:`Member`
(passed with the install: ``adapter.install(..., member=m)``). Every adapter that can take part calls
:func:`commit_point` with it right before its first write (everything staged and prepared, nothing written): there the
install waits until the fleet decides, for every replica at once, to commit or to abort. Adapters whose transport can
serve several engines with one copy hand each bucket to :func:`share` instead of sending it themselves: the bucket is
packed once per group and delivered to every replica of the group. Outside a fleet, :func:`commit_point` returns at once
and :func:`share` sends.

Nothing here knows vLLM: a member only needs threads, a transport and a ``deliver`` callback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from hotweights.core.errors import FleetAbortedError, HotWeightsError, HotWeightsTimeoutError
from hotweights.core.pipeline import MAX_DEPTH

if TYPE_CHECKING:
    import torch

    from hotweights.core.buckets import Bucket

#: What a transport hands the engine for one bucket (:class:`hotweights.transports.Descriptor`): opaque here.
Descriptor = Any


class WeightTransport(Protocol):
    """What a member needs of a transport (:class:`hotweights.transports.WeightTransport` has it): send a bucket,
    calling ``stage`` once with its descriptor."""

    @property
    def name(self) -> str: ...

    def send(
        self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Callable[[Descriptor], None]
    ) -> None: ...


__all__ = ["Coordinator", "FleetAbortedError", "Member", "commit_point", "share"]

Decision = Literal["commit", "abort"]


@dataclass
class _Group:
    """Replicas whose buckets one transport carries with one copy (e.g. ``shm`` on one host)."""

    transport: WeightTransport
    members: frozenset[int]
    slots: dict[int, dict[int, tuple[str, Callable[[Descriptor], None]]]] = field(default_factory=dict)
    done: dict[int, dict[int, BaseException | None]] = field(default_factory=dict)
    bytes_written: int = 0


class Coordinator:
    """The shared state of one fleet install: who staged, who failed, the decision, and the shared buckets.

    Args:
        size: replicas taking part.
        staging_timeout: seconds a replica may wait at the commit point for the decision (the fleet's staging
            expiry: a trainer gone between stage and commit never leaves a replica waiting longer).
    """

    def __init__(self, size: int, staging_timeout: float) -> None:
        self.size = size
        self.staging_timeout = staging_timeout
        self._cond = threading.Condition()
        self.staged: set[int] = set()
        self.finished: set[int] = set()
        self.failures: dict[int, BaseException] = {}
        self.unstopped: set[int] = set()
        """Replicas whose install returned without reaching the commit point (an adapter that does not take part)."""
        self.decision: Decision | None = None
        self.reason = ""
        self._groups: dict[int, _Group] = {}
        # A stage per replica for every bucket in flight (a pipelined send holds up to MAX_DEPTH), so a bucket's
        # stage never waits in the queue behind a later bucket's, which waits for it (threads start on demand).
        self._pool = ThreadPoolExecutor(max_workers=max(1, size) * MAX_DEPTH, thread_name_prefix="hotweights-fleet")

    # ------------------------------------------------------------------ groups (set up before the install)
    def add_group(self, transport: WeightTransport, members: list[int]) -> None:
        """``members`` share ``transport``: each bucket is packed once and staged by all of them."""
        group = _Group(transport, frozenset(members))
        for m in members:
            self._groups[m] = group

    def group_of(self, index: int) -> _Group | None:
        return self._groups.get(index)

    @property
    def bytes_written(self) -> int:
        """Bytes the shared transports wrote (each bucket once per group)."""
        return sum(g.bytes_written for g in {id(g): g for g in self._groups.values()}.values())

    # ------------------------------------------------------------------ the members' side
    def reached_commit_point(self, index: int) -> None:
        """Replica ``index`` staged everything: wait for the decision; raise :class:`FleetAbortedError` on abort."""
        with self._cond:
            self.staged.add(index)
            self._cond.notify_all()
            deadline = time.monotonic() + self.staging_timeout
            while self.decision is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._decide("abort", f"no decision within the staging expiry ({self.staging_timeout:g} s)")
                    break
                self._cond.wait(left)
            if self.decision != "commit":
                raise FleetAbortedError(f"replica {index} was staged and nothing was written: {self.reason}")

    def failed(self, index: int, exc: BaseException) -> None:
        """Replica ``index``'s install raised (before the decision: every replica aborts)."""
        with self._cond:
            self.failures[index] = exc
            if self.decision is None:
                self._decide("abort", f"replica {index} failed while staging ({type(exc).__name__}: {exc})")
            self._cond.notify_all()

    def done(self, index: int) -> None:
        with self._cond:
            self.finished.add(index)
            if index not in self.staged and index not in self.failures:  # installed without stopping: never wait
                self.unstopped.add(index)  # for it (the fleet reports it; no adapter of hotweights does this)
                self.staged.add(index)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the fleet's side
    def wait_staged(self, timeout: float | None) -> None:
        """Until every replica staged (returns) or one failed or ``timeout`` passed (the fleet aborts and raises)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self.staged) < self.size and self.decision is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    late = sorted(set(range(self.size)) - self.staged)
                    self._decide("abort", f"replica(s) {late} did not finish staging within {timeout:g} s")
                    raise HotWeightsTimeoutError(
                        f"the fleet install timed out while staging: {self.reason}; every replica was aborted and "
                        "keeps serving its previous version. Check those engines, or raise timeout="
                    )
                self._cond.wait(left)

    def decide(self, decision: Decision, reason: str = "") -> bool:
        """Commit or abort every staged replica; False when the fleet had already decided otherwise."""
        with self._cond:
            if self.decision is None:
                self._decide(decision, reason)
            return self.decision == decision

    def wait_finished(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self.finished) < self.size:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _decide(self, decision: Decision, reason: str) -> None:
        self.decision, self.reason = decision, reason
        self._cond.notify_all()

    # ------------------------------------------------------------------ shared buckets
    def share(
        self,
        index: int,
        bucket: Bucket,
        tensors: Mapping[str, torch.Tensor],
        deliver: Callable[[Descriptor], None],
    ) -> None:
        """Stage ``bucket`` on replica ``index`` through its group's transport: the last replica of the group to
        arrive packs it once and delivers it to all of them in parallel; each returns once its own stage did."""
        group = self._groups[index]
        key = bucket.index
        text = bucket.model_dump_json()
        with self._cond:
            slot = group.slots.setdefault(key, {})
            slot[index] = (text, deliver)
            if len(slot) == len(group.members):
                del group.slots[key]
                self._cond.release()  # pack and deliver without holding the fleet's lock
                try:
                    outcome = self._deliver_all(group, bucket, tensors, slot)
                finally:
                    self._cond.acquire()
                group.done[key] = outcome
                self._cond.notify_all()
            deadline = time.monotonic() + self.staging_timeout
            while key not in group.done or index not in group.done[key]:
                if self.decision == "abort":
                    group.slots.pop(key, None)
                    raise FleetAbortedError(f"bucket {key} was not staged on replica {index}: {self.reason}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HotWeightsTimeoutError(f"replica {index} waited {self.staging_timeout:g} s for bucket {key}")
                self._cond.wait(left)
            error = group.done[key].pop(index)
            if not group.done[key]:
                del group.done[key]
        if error is not None:
            raise error

    def _deliver_all(
        self,
        group: _Group,
        bucket: Bucket,
        tensors: Mapping[str, torch.Tensor],
        slot: dict[int, tuple[str, Callable[[Descriptor], None]]],
    ) -> dict[int, BaseException | None]:
        texts = {text for text, _ in slot.values()}
        if len(texts) != 1:
            error = HotWeightsError(
                f"the replicas sharing the {group.transport.name} transport planned bucket {bucket.index} "
                "differently: they do not serve the same model; build the fleet from replicas of one model"
            )
            return dict.fromkeys(slot, error)
        outcome: dict[int, BaseException | None] = dict.fromkeys(slot)

        def fan_out(descriptor: Descriptor) -> None:
            futures = {i: self._pool.submit(deliver, descriptor) for i, (_, deliver) in slot.items()}
            for i, future in futures.items():
                outcome[i] = future.exception()
            failed = [e for e in outcome.values() if e is not None]
            if failed:  # the transport cleans up what it made for this bucket
                raise failed[0]

        try:
            group.transport.send(bucket, tensors, fan_out)
            group.bytes_written += bucket.nbytes
        except BaseException as exc:
            if not any(e is exc for e in outcome.values()):  # the transport failed, not one replica's stage
                for i in outcome:
                    outcome[i] = exc
        return outcome


@dataclass(frozen=True)
class Member:
    """One replica's install inside a fleet (see :func:`current`)."""

    coordinator: Coordinator
    index: int
    bucket_bytes: int
    """Every replica plans the same buckets (those that share a transport stage the same bytes)."""
    expires_s: float
    """Seconds the replica's workers keep what they staged without a commit (then they drop it)."""

    @property
    def shares_buckets(self) -> bool:
        return self.coordinator.group_of(self.index) is not None


def commit_point(member: Member | None) -> None:
    """Called by an adapter right before its first write: as a fleet's ``member``, wait until every replica staged
    and the fleet decided (raises :class:`FleetAbortedError` on abort); outside a fleet (None), return at once."""
    if member is not None:
        member.coordinator.reached_commit_point(member.index)


def share(
    member: Member | None,
    transport: WeightTransport,
    bucket: Bucket,
    tensors: Mapping[str, torch.Tensor],
    deliver: Callable[[Descriptor], None],
) -> None:
    """Send ``bucket`` through ``transport`` to one engine, or, as a ``member`` of a fleet whose replicas share a
    transport, once for the whole group (see :meth:`Coordinator.share`)."""
    if member is None or not member.shares_buckets:
        transport.send(bucket, tensors, deliver)
        return
    member.coordinator.share(member.index, bucket, tensors, deliver)
