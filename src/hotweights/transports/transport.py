"""The transport contract: move one bucket's bytes to the engine's workers, without pickle.

Trainer side, a transport implements one method, :meth:`WeightTransport.send`. It packs a bucket, hands the
engine a JSON-able *descriptor* through ``stage`` (an RPC that returns once every worker has staged the bucket),
and cleans up. Engine side, the same module provides ``open_bucket(descriptor, worker) -> (buffer, keepalive)``,
found through :func:`hotweights.transports.engine_side` by the descriptor's ``"transport"`` key. A transport that
keeps state with the workers (a process group, kept segments) gets the adapter as its :class:`EngineLink` at
``connect`` and asks for the worker extension's ``hotweights_engine`` operations through ``engine_op``.
An ``open_bucket`` marked :func:`receives_bucket` also gets the bucket and the manifest (checked by the staging area
before it is called), for a receiver that must know the tensors' names, shapes and offsets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch

from hotweights.core.buckets import Bucket

__all__ = ["Descriptor", "EngineLink", "Stage", "WeightTransport", "receives_bucket"]

#: What the engine needs to find a bucket's bytes: plain JSON/msgpack types only (str, int, bytes, lists, dicts).
Descriptor = dict[str, Any]
#: Delivers a descriptor to every worker and returns when they have staged the bucket.
Stage = Callable[[Descriptor], None]

F = TypeVar("F", bound=Callable[..., Any])


def receives_bucket(open_bucket: F) -> F:
    """Mark an engine-side ``open_bucket`` that takes ``(descriptor, worker, bucket, manifest)``."""
    open_bucket.receives_bucket = True  # type: ignore[attr-defined]
    return open_bucket


@runtime_checkable
class EngineLink(Protocol):
    """What a transport may ask of the engine besides staging: an operation on every worker, and their count. A
    link may also offer ``releases_buckets_after_stage`` (the workers keep no view of a bucket once staged, so one
    buffer can carry every bucket) and ``on_shutdown(callback)`` (run when the engine stops); a transport reads
    both with ``getattr``, so a minimal link needs neither."""

    @property
    def num_workers(self) -> int: ...

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        """Run the worker operation ``op`` (``"join_group"``, ``"leave_group"``, ``"release_segments"``: see
        :data:`hotweights.vllm.worker.extension.ENGINE_OPS`) on every worker; one result per worker."""
        ...


class WeightTransport(ABC):
    """Moves buckets from the trainer to the engine. Use as a context manager or call :meth:`close`."""

    #: Registry name; also the ``"transport"`` key of its descriptors.
    name: ClassVar[str]
    #: Bucket size this transport moves fastest (adapters use it unless given one; capped by free memory). A
    #: transport may set its own per instance (shm: by the size of its filesystem).
    preferred_bucket_bytes: int = 64 << 20
    #: Whether one packed bucket can be staged by several engines (a fleet writes it once for all of them): True
    #: for transports that keep nothing per engine between installs.
    shareable: bool = False
    #: Whether the tensors themselves are handed over, not their bytes (an engine in this process: nothing is
    #: packed or copied, the whole update is one bucket, and a delta's base is lent rather than kept twice).
    by_reference: ClassVar[bool] = False

    #: Buckets packed while earlier ones are staged (:mod:`hotweights.core.pipeline`), where :attr:`overlaps`.
    buckets_in_flight: ClassVar[int] = 2
    #: Whether each bucket's memory stays mapped in the workers between installs (released through the worker
    #: extension's ``release_segments``, so only paths that reach it may use such a transport).
    keeps_segments: bool = False

    def rank_writable(self) -> Callable[[Bucket], AbstractContextManager[Any]] | None:
        """Where the ranks of a sharded install on this host can write their own rows of a bucket: ``written(bucket)``,
        a context manager over a file every rank opens by its path, staged with its ``descriptor`` inside the block
        (:mod:`hotweights.core.rank_writes`). None (default): this transport packs every bucket itself."""
        return None

    @property
    def overlaps(self) -> bool:
        """Whether several :meth:`send` calls may run at once, on different threads, each packing its own bucket
        (their ``stage`` calls still come one at a time, in order). False by default: a transport says so once its
        sends keep nothing shared between buckets."""
        return False

    @property
    def share_key(self) -> str:
        """Engines whose transports have the same key can share one copy of each bucket (e.g. one host)."""
        return self.name

    @abstractmethod
    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        """Pack ``bucket``'s tensors, call ``stage(descriptor)`` once, release what only this send needed.

        Must leave nothing behind if ``stage`` raises.
        """

    def connect(self, engine: EngineLink) -> None:  # noqa: B027 - optional hook
        """Set up what needs the engine's side too (e.g. a process group); called once by the adapter."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the transport holds across sends (no-op by default)."""

    def __enter__(self) -> WeightTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
