"""The transport contract: move one bucket's bytes to the engine's workers, without pickle.

A transport has two sides and one type between them:

- **trainer side**, :class:`WeightTransport`: one method, :meth:`~WeightTransport.send`, packs a bucket, hands the
  engine its :class:`Descriptor` through ``stage`` (an RPC that returns once every worker has staged the bucket),
  and cleans up;
- **the descriptor**, one frozen dataclass per transport (a subclass of :class:`Descriptor`): what the engine needs
  to find the bucket's bytes. It crosses every RPC as a plain JSON/msgpack value (:meth:`~Descriptor.to_wire`) and
  is parsed once where a worker receives it (:meth:`~Descriptor.from_wire`): a malformed one is a
  :class:`MalformedDescriptorError` naming the field, before anything is read;
- **engine side**, :class:`BucketReceiver` (a transport module's ``Receiver``): :meth:`~BucketReceiver.open` gives
  the bucket's bytes in the worker, found through :func:`hotweights.transports.receiver_for` by the descriptor's
  transport name.

A transport that keeps state with the workers (a process group, kept segments) gets the installer as its
:class:`EngineLink` at ``connect`` and asks for the worker extension's ``hotweights_engine`` operations through
``engine_op``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from hotweights.core.buckets import Bucket
from hotweights.core.errors import InstallError

if TYPE_CHECKING:
    from hotweights.core.manifest import WeightUpdateManifest

__all__ = [
    "BucketReceiver",
    "Descriptor",
    "EngineLink",
    "MalformedDescriptorError",
    "Opened",
    "Stage",
    "WeightTransport",
    "wire_of",
]

D = TypeVar("D", bound="Descriptor")


class MalformedDescriptorError(InstallError, ValueError):
    """A bucket's descriptor that does not parse as its transport's (no transport name, a missing or mistyped
    field): refused where the worker receives it, before anything is read or staged. The message names the
    transport, the field and what to send instead. An :class:`~hotweights.InstallError` where it reaches the trainer,
    and a ``ValueError``, as every refusal of a malformed call."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Descriptor:
    """What the engine needs to find one bucket's bytes. Every transport declares its own subclass, with its
    ``transport`` name and its fields; the values are plain JSON/msgpack types (str, int, bytes, lists) except where
    a descriptor never leaves the trainer's process (``reference``) or Ray carries it (``ray``).

    Example:
        >>> from hotweights.transports.bytes import BytesDescriptor
        >>> wire = BytesDescriptor(data=b"abcd", nbytes=4).to_wire()
        >>> wire
        {'transport': 'bytes', 'nbytes': 4, 'data': b'abcd'}
        >>> BytesDescriptor.from_wire(wire).nbytes
        4
    """

    transport: str
    """The transport's registry name: each subclass sets it as the field's default (the wire form's
    ``"transport"`` key). A field, so that a descriptor handed to vLLM's own RPC as it is (msgspec encodes a
    dataclass by its fields) still names its transport."""
    nbytes: int
    """The bucket's size in bytes (checked against the bucket and its manifest before anything is received)."""

    def __post_init__(self) -> None:
        name = _default(type(self), "transport")
        self.require("transport", self.transport == name, f"the name {name!r} as its", f"a {type(self).__name__}")
        self.require("nbytes", _is_count(self.nbytes), "a non-negative integer", "send the bucket's size in bytes")

    def to_wire(self) -> dict[str, Any]:
        """The plain value that crosses an RPC: the fields, an optional one only when set."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not (f.default is None and getattr(self, f.name) is None)
        }

    @classmethod
    def from_wire(cls: type[D], wire: object) -> D:
        """Parse the wire form (keys other than the fields are ignored).

        Raises:
            MalformedDescriptorError: not a dict of this transport, a field missing or of the wrong type.
        """
        if not isinstance(wire, Mapping):
            raise MalformedDescriptorError(
                f"malformed descriptor: expected a dict with an integer 'nbytes', got {reprlib.repr(wire)}"
            )
        name = _default(cls, "transport")
        if wire.get("transport") != name:
            raise MalformedDescriptorError(
                f"a {cls.__name__} is for transport {name!r}, not {reprlib.repr(wire.get('transport'))}"
            )
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.name not in wire and f.default is dataclasses.MISSING]
        if missing:
            raise MalformedDescriptorError(
                f"malformed {name!r} descriptor: no {missing} (a {cls.__name__} has "
                f"{[f.name for f in fields]}); send the descriptor its transport's send made"
            )
        return cls(**{f.name: wire[f.name] for f in fields if f.name in wire})

    def require(self, field: str, ok: bool, what: str, fix: str) -> None:
        """Raise :class:`MalformedDescriptorError` unless ``ok``: ``field`` must be ``what``; ``fix`` says what to
        send instead."""
        if not ok:
            got = reprlib.repr(getattr(self, field, None))
            raise MalformedDescriptorError(
                f"malformed {self.transport!r} descriptor: needs {what} {field!r}, got {got}; {fix}"
            )


def _default(cls: type[Descriptor], name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def wire_of(descriptor: Descriptor | Mapping[str, Any]) -> dict[str, Any]:
    """What crosses an RPC for ``descriptor``: its wire form; a wire form (e.g. relayed from another process as JSON)
    passes as it is, to be parsed where a worker receives it."""
    return descriptor.to_wire() if isinstance(descriptor, Descriptor) else dict(descriptor)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: A bucket's bytes in a worker (a ``uint8`` tensor of the descriptor's ``nbytes``) and what must stay alive while
#: they are used (a mapping, the received buffer).
Opened = tuple[torch.Tensor, Any]
#: Delivers a descriptor to every worker and returns when they have staged the bucket.
Stage = Callable[[Descriptor], None]


class BucketReceiver(ABC):
    """The engine side of a transport: the bytes of a bucket in a worker.

    Subclasses set :attr:`descriptor` and implement :meth:`open`; the staging area parses the wire form with
    :attr:`descriptor` and checks the bucket against the manifest before it calls :meth:`open`.
    """

    #: The descriptor type this receiver opens.
    descriptor: ClassVar[type[Descriptor]]

    @classmethod
    def parse(cls, wire: object) -> Descriptor:
        """The typed descriptor of a wire form (see :meth:`Descriptor.from_wire`); one already typed passes as it
        is."""
        return wire if isinstance(wire, cls.descriptor) else cls.descriptor.from_wire(wire)

    @classmethod
    @abstractmethod
    def open(
        cls,
        descriptor: Any,
        worker: Any = None,
        bucket: Bucket | None = None,
        manifest: WeightUpdateManifest | None = None,
    ) -> Opened:
        """The bucket's bytes in this worker, checked against ``descriptor.nbytes``, and what keeps them alive.

        Args:
            descriptor: an instance of :attr:`descriptor`.
            worker: the worker that stages the bucket (a receiver keeps state on it: a process group, kept
                segments).
            bucket, manifest: the bucket and its manifest, already checked by the staging area (which always passes
                them): for a receiver that must know the tensors' names, shapes and offsets.
        """


class EngineLink(ABC):
    """What a transport may ask of the engine besides staging: an operation on every worker, their count, whether
    they keep a view of a bucket once staged, and a hook for the engine's shutdown. A minimal link implements the
    first two; the others have defaults."""

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """How many workers stage each bucket."""

    @abstractmethod
    def engine_op(self, op: str, **args: Any) -> list[Any]:
        """Run the worker operation ``op`` (``"join_group"``, ``"leave_group"``, ``"release_segments"``: see
        :data:`hotweights.vllm.worker.extension.ENGINE_OPS`) on every worker; one result per worker."""

    @property
    def releases_buckets_after_stage(self) -> bool:
        """Whether the workers keep no view of a bucket once its stage returned, so one buffer can carry every
        bucket (False by default)."""
        return False

    def on_shutdown(self, callback: Callable[[], object]) -> None:  # noqa: B027 - a no-op where there is no hook
        """Run ``callback`` when the engine stops (never, by default)."""


class WeightTransport(ABC):
    """Moves buckets from the trainer to the engine. Use as a context manager or call :meth:`close`."""

    #: Registry name; also the ``transport`` name of its descriptors.
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
    #: Whether the engine's workers join a process group this transport hosts (at :meth:`connect`): it is then built
    #: with the address the workers reach the trainer at (``host``), a ``backend``, a ``timeout`` and the ``device``
    #: it packs on, as :class:`hotweights.transports.collective.Transport` is.
    hosts_group: ClassVar[bool] = False

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
