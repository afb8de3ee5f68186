"""Collective transport: buckets broadcast from the trainer (rank 0) to the engine's workers (ranks 1..N) over a
``torch.distributed`` process group of their own — gloo on CPU, NCCL on GPU, through the same code.

The group is separate from vLLM's own (built from a ``TCPStore`` + backend directly, not
``init_process_group``), bound to loopback by default, and every wait has a timeout. Re-connecting (e.g. a trainer
that crashed and came back) replaces the workers' stale group first. A send that fails midway leaves the group out
of step (a broadcast nobody received): the transport drops it and the next send re-rendezvous with the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed

from hotweights.core import attach
from hotweights.core.buckets import Bucket, pack_into
from hotweights.core.errors import HotWeightsError, HotWeightsTimeoutError, InstallError
from hotweights.transports.transport import BucketReceiver, Descriptor, EngineLink, Opened, Stage, WeightTransport

__all__ = [
    "MAX_TIMEOUT_S",
    "MAX_WORKERS",
    "CollectiveDescriptor",
    "Receiver",
    "Transport",
    "checked_join",
    "close_group",
    "create_group",
]

log = logging.getLogger("hotweights")

_BACKENDS = ("gloo", "nccl")
#: Upper bound (seconds) of the timeout a worker accepts from the trainer; ``HOTWEIGHTS_MAX_RPC_TIMEOUT`` overrides.
MAX_TIMEOUT_S = 600.0
#: Most engine workers one group takes (its world size is 1 + workers).
MAX_WORKERS = 4096
# How long a broadcast may lag behind a stage call that already returned (the last bytes' acknowledgement), and how
# long a failed broadcast waits for the stage call's own (more telling) error.
_GRACE_S = 2.0
# torch's stubs do not export the store and backend classes used here (TCPStore, PrefixStore, ProcessGroupGloo).
dist: Any = torch.distributed


def create_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout: float, store: Any = None
) -> Any:
    """A process group of ``world_size`` ranks rendezvousing at ``host:port`` (rank 0 hosts the store)."""
    td = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=td, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"hotweights/{port}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = td
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
    raise HotWeightsError(f"unknown collective backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveDescriptor(Descriptor):
    """A bucket broadcast over the group the workers joined: only its size crosses the RPC."""

    transport: str = "collective"


class _Call:
    """``fn`` in a daemon thread whose outcome is kept (never lost); ``self`` goes on ``ended`` when it returns."""

    def __init__(self, what: str, fn: Callable[[], Any], ended: queue.SimpleQueue[_Call]) -> None:
        self.what = what
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def target() -> None:
            try:
                self.value = fn()
            except BaseException as exc:
                self.error = exc
            finally:
                self.done.set()
                ended.put(self)

        self.thread = threading.Thread(target=target, name=f"hotweights-{what}", daemon=True)
        self.thread.start()


def _next_to_end(ended: queue.SimpleQueue[_Call], timeout: float) -> _Call | None:
    """The next call to return (from ``ended``), or None if none does within ``timeout`` s."""
    try:
        return ended.get(timeout=timeout)
    except queue.Empty:
        return None


def _raise_typed(error: BaseException, what: str, then: str) -> NoReturn:
    """Raise ``error`` itself when it is already typed (callers branch on its type; ``what`` and ``then`` are added
    as a note where Python has them), else an :class:`InstallError` saying both around ``error`` (chained)."""
    if isinstance(error, HotWeightsError):
        if sys.version_info >= (3, 11):
            error.add_note(f"hotweights: {what}; {then}")
        raise error
    raise InstallError(f"{what}: {type(error).__name__}: {error}; {then}") from error


class Transport(WeightTransport):
    """Broadcast buckets over a dedicated process group.

    Args:
        host: address the trainer's rendezvous store binds to (loopback by default; set the trainer host's
            address when the engine runs elsewhere).
        port: store port (0: pick a free one).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout: seconds for the rendezvous and for each broadcast (workers cap it at :data:`MAX_TIMEOUT_S`).
        device: where buckets are packed (``"cpu"`` for gloo, a CUDA device for NCCL).
    """

    name = "collective"
    hosts_group = True
    #: What :meth:`send` stages for each bucket.
    descriptor: ClassVar[type[CollectiveDescriptor]] = CollectiveDescriptor

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        timeout: float = 60.0,
        device: str | torch.device = "cpu",
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"unknown collective backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.host, self.port, self.backend, self.timeout = host, port, backend, timeout
        self.device = torch.device(device)
        self._engine: EngineLink | None = None
        self._store: Any = None
        self._group: Any = None
        self._reconnect: EngineLink | None = None
        """The engine of a group dropped after a failure (or a failed connect): the next send re-connects to it."""

    def connect(self, engine: EngineLink) -> None:
        """Rendezvous with every engine worker; the trainer is rank 0.

        Raises:
            InstallError: a worker failed to join (its error is named and chained); the next send tries again.
            HotWeightsTimeoutError: the rendezvous ran past the timeout (the message names what was missing).
        """
        self.close()
        self._reconnect = engine  # until this connect succeeds
        world = 1 + engine.num_workers
        port, host_group, keep = self._rendezvous(world)
        where = f"{self.host}:{port}"
        ended: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        joining = _Call(
            f"the engine workers' join call (join_group at {where})",
            lambda: engine.engine_op("join_group", **self._join_args(port, world)),
            ended,
        )
        hosting = _Call(f"rendezvous with {engine.num_workers} engine worker(s) at {where}", host_group, ended)
        pending = [hosting, joining]
        while pending:
            call = _next_to_end(ended, self.timeout)
            if call is None:
                raise HotWeightsTimeoutError(
                    f"waited {self.timeout} s for {' and '.join(c.what for c in pending)}; check that the engine "
                    f"can reach {where} (set host= to the trainer's address), or raise the transport's timeout"
                )
            pending.remove(call)
            if call.error is not None:  # the other side waits for ranks that will not come, until its timeout
                who = "the engine's workers" if call is joining else "the trainer"
                _raise_typed(
                    call.error,
                    f"{who} could not join the collective group at {where}",
                    "fix the cause and install again (the next send re-connects)",
                )
        self._store, self._group, self._engine, self._reconnect = keep, hosting.value, engine, None

    def _rendezvous(self, world: int) -> tuple[int, Callable[[], Any], Any]:
        """The trainer's end of a group of ``world`` ranks: its port, the call that forms the group as rank 0
        (run beside the workers' join), and what the transport keeps open with the group (the store)."""
        td = datetime.timedelta(seconds=self.timeout)
        # TCPStore alone listens on every interface whatever its host: hand it a socket bound to ``host`` (it takes
        # ownership of the descriptor and closes it with the store).
        listener = socket.create_server((self.host, self.port), backlog=64)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            self.host, port, world, is_master=True, timeout=td, wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )  # fmt: skip
        return port, lambda: create_group(self.host, port, 0, world, self.backend, self.timeout, store=store), store

    def _join_args(self, port: int, world: int) -> dict[str, Any]:
        """What the workers' ``join_group`` gets."""
        return {"host": self.host, "port": port, "world_size": world, "backend": self.backend, "timeout": self.timeout}

    def _broadcast(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> Callable[[], object]:
        """The trainer's half of one bucket's transfer, run beside the workers' stage call."""
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        pack_into(buffer, bucket, tensors)
        group = self._group
        return lambda: group.broadcast(buffer, 0).wait()

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        """Broadcast ``bucket`` while ``stage`` has the workers receive it.

        Fails as soon as ``stage`` does (before or during the broadcast), then drops the group, out of step: the
        next send re-connects first.

        Raises:
            InstallError: the stage call or the broadcast failed (a typed error from ``stage`` is raised as it is).
            HotWeightsTimeoutError: neither finished within the timeout.
        """
        if self._group is None and self._reconnect is not None:
            log.warning("hotweights: re-connecting the collective group (dropped after a failure)")
            self.connect(self._reconnect)
        group = self._group
        if group is None:
            raise HotWeightsError("collective transport is not connected; the adapter calls connect(engine) first")
        broadcast = self._broadcast(bucket, tensors)
        ended: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        staging = _Call(
            f"the workers' stage call for bucket {bucket.index}",
            lambda: stage(self.descriptor(nbytes=bucket.nbytes)),
            ended,
        )
        cast = _Call(f"broadcast of bucket {bucket.index}", broadcast, ended)
        first = _next_to_end(ended, self.timeout)
        if first is staging and staging.error is None:
            # Every worker has its bytes: the broadcast ends at once, unless they answered without receiving.
            if cast.done.wait(min(self.timeout, _GRACE_S)) and cast.error is None:
                return
        elif first is cast and cast.error is None:
            if _next_to_end(ended, self.timeout) is staging and staging.error is None:
                return
        elif first is cast:  # e.g. a worker died or dropped its group: its stage call says why
            staging.done.wait(min(self.timeout, _GRACE_S))
        # What failed is decided before the group is dropped (which ends a pending broadcast with an error).
        stage_error, stage_done = staging.error, staging.done.is_set()
        cast_error = cast.error if cast.done.is_set() else None
        state = self._drop_out_of_step(staging, cast)
        if stage_error is not None:
            _raise_typed(stage_error, f"the engine's workers failed to stage bucket {bucket.index}", state)
        if cast_error is not None:
            what = f"the broadcast of bucket {bucket.index} failed"
            _raise_typed(cast_error, what, f"{state}; check that the engine's workers are alive")
        if stage_done:
            raise InstallError(
                f"the engine's workers answered the stage call for bucket {bucket.index} without receiving its "
                f"broadcast (they refused it in their answer?); {state}"
            )
        running = " and ".join(c.what for c in (staging, cast) if not c.done.is_set())
        raise HotWeightsTimeoutError(
            f"waited {self.timeout} s for {running}; {state}. Raise the transport's timeout if the workers are slow"
        )

    def _drop_out_of_step(self, staging: _Call, cast: _Call) -> str:
        """Drop a group left out of step by a failed send (the next send re-connects); what became of it."""
        group, engine = self._group, self._engine
        self._group = self._store = self._engine = None
        self._reconnect = engine
        if self.backend == "nccl":  # an unmatched NCCL broadcast would hold the trainer's stream: abort it
            with contextlib.suppress(Exception):
                group.abort()
        idle = staging.done.is_set() and not isinstance(staging.error, HotWeightsTimeoutError)
        if not cast.done.is_set() and idle and engine is not None:
            # The workers are done with their stage call: dropping their end ends the trainer's pending broadcast.
            try:
                engine.engine_op("leave_group")
            except Exception:  # e.g. vLLM refuses to release it during a weight update: the next send replaces it
                pass
            else:
                cast.done.wait(_GRACE_S)
        state = "the collective group was dropped (out of step) and the next send re-connects"
        if not cast.done.is_set():
            state += (
                f" (the trainer's pending broadcast ends when the workers' group is replaced, or in {self.timeout} s)"
            )
        return state + ". Fix the cause and install again"

    def close(self) -> None:
        """Drop the group on both sides."""
        self._reconnect = None
        if self._engine is not None:
            try:
                self._engine.engine_op("leave_group")
            finally:
                self._engine = None
        self._group = None
        self._store = None


# ---------------------------------------------------------------------------------------------- engine side
def max_timeout() -> float:
    """The longest timeout a worker accepts: ``HOTWEIGHTS_MAX_RPC_TIMEOUT`` (seconds) if set, else
    :data:`MAX_TIMEOUT_S`."""
    raw = os.environ.get("HOTWEIGHTS_MAX_RPC_TIMEOUT", "").strip()
    if not raw:
        return MAX_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"HOTWEIGHTS_MAX_RPC_TIMEOUT must be a positive number of seconds, got {raw!r}; fix or unset it"
        )
    return value


def _int_in(value: Any, name: str, low: int, high: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}; {hint}")
    return value


def init_worker_group(worker: Any, host: str, port: int, world_size: int, backend: str, timeout: float) -> None:
    """Worker side of :meth:`Transport.connect`: replaces any stale group, joins as rank 1 + worker rank.

    The arguments come from the trainer (maybe a remote client): they are checked, and ``timeout`` is capped at
    :func:`max_timeout`.
    """
    rank, timeout = checked_join(worker, host, port, world_size, backend, timeout)
    close_group(worker)
    group = create_group(host, port, rank, world_size, backend, timeout)
    attach.put(worker, "group", (group, backend))


def checked_join(worker: Any, host: str, port: int, world_size: int, backend: str, timeout: float) -> tuple[int, float]:
    """A worker's group rank and its timeout (capped at :func:`max_timeout`), from a trainer's join arguments;
    ``ValueError`` naming the first that is wrong."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be the trainer's address, got {host!r}; connect with the collective transport")
    _int_in(port, "port", 1, 65535, "pass the port of the trainer's rendezvous store")
    _int_in(world_size, "world_size", 2, 1 + MAX_WORKERS, f"the group is the trainer plus 1..{MAX_WORKERS} workers")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown collective backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}; pass e.g. 60")
    rank = 1 + int(getattr(worker, "rank", 0))
    if rank >= world_size:
        raise ValueError(
            f"this worker's group rank {rank} does not fit world_size {world_size}; the trainer must count every "
            "engine worker (world_size = 1 + workers)"
        )
    cap = max_timeout()
    try:
        timeout = float(timeout)
    except OverflowError:
        raise ValueError(f"timeout {timeout!r} is not a number of seconds; pass at most {cap} s") from None
    if timeout > cap:
        log.warning("hotweights: collective timeout %s s capped at %s s (HOTWEIGHTS_MAX_RPC_TIMEOUT)", timeout, cap)
    return rank, min(timeout, cap)


def close_group(worker: Any) -> bool:
    """Drop the worker's group, if any."""
    had = attach.get(worker, "group") is not None
    attach.put(worker, "group", None)
    return had


class Receiver(BucketReceiver):
    """Receive one bucket from the trainer's broadcast into a fresh buffer.

    ``descriptor.nbytes`` is checked against the bucket and the manifest by the staging area before this is called
    (:func:`~hotweights.core.buckets.bucket_problems`).
    """

    descriptor = CollectiveDescriptor

    @classmethod
    def open(
        cls, descriptor: CollectiveDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None
    ) -> Opened:
        entry = attach.get(worker, "group")
        if entry is None:
            raise RuntimeError(
                "no hotweights communicator on this worker; the trainer must connect the transport first"
            )
        group, backend = entry
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        buffer = torch.empty(descriptor.nbytes, dtype=torch.uint8, device=device)
        group.broadcast(buffer, 0).wait()
        return buffer, None
