"""How the trainer's calls of the install session reach the workers: one wire per way into an engine.

The session itself (:mod:`hotweights.vllm.worker.session`) is the same everywhere; a wire carries its five calls
(``begin``, ``stage``, ``prepare``, ``commit``, ``abort``), the one-call install where it has one, and the worker
operations a transport needs (:class:`Wire`):

- :class:`ExtensionWire`: hotweights' worker extension, by ``collective_rpc`` (any multiprocess engine, a server);
- :class:`TransferAPIWire`: vLLM's own weight-transfer API (``start_weight_update`` ... ``finish_weight_update``)
  with the ``"hotweights"`` backend;
- :class:`InProcessWire`: an engine in this process, whose worker is called directly: the manifest by reference,
  the tensors through the ``reference`` transport.

A descriptor crosses a process as its wire form (:func:`~hotweights.transports.wire_of`): plain JSON/msgpack
values, never pickle.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from hotweights.core import envelope
from hotweights.core.delta import DeltaBase
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.handles import EngineHandle
from hotweights.transports import Descriptor, wire_of
from hotweights.transports.reference import ReferenceDescriptor
from hotweights.vllm.worker.session import PROTOCOL, SessionOptions, session_of

__all__ = ["ExtensionWire", "InProcessWire", "TransferAPIWire", "Wire"]

Answers = list[Any]


class Wire(Protocol):
    """The session's calls on every worker of one engine."""

    #: Seconds each call may take before :class:`~hotweights.HotWeightsTimeoutError` (None: no limit).
    timeout: float | None
    #: Whether :meth:`install` can begin, stage and commit a one-bucket update in one call.
    one_call: bool
    #: Whether the workers read the live parameters back after a commit (``verify``).
    reads_back: bool
    #: Whether the workers can release kept shm segments (``engine_op("release_segments")``).
    releases_segments: bool
    #: Whether :meth:`commit` answers each worker's summary (False: the calls return nothing).
    summarises: bool

    def begin(
        self, options: SessionOptions, manifest: WeightUpdateManifest | None = None, lent: DeltaBase | None = None
    ) -> None:
        """Open the session on every worker: ``manifest`` is what crosses (None: a delta that changes nothing, or
        ``options.manifest`` already holds it); ``lent``, the trainer's delta base, where the workers borrow it.
        A refusal raises, typed."""
        ...

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        """One bucket, staged by every worker."""
        ...

    def prepare(self, update_id: str) -> list[list[dict[str, str]]]:
        """Every worker ready to commit, nothing written; each worker's problems (a delta's mismatches)."""
        ...

    def commit(self, update_id: str) -> list[dict[str, Any]]:
        """Install what was prepared; each worker's summary (none where the wire's calls return nothing)."""
        ...

    def abort(self, update_id: str) -> None:
        """Drop the session on every worker (bounded: it runs on failure paths)."""
        ...

    def install(self, options: SessionOptions, manifest: WeightUpdateManifest, payload: Any) -> Answers:
        """Begin, stage ``payload`` (bucket JSON, descriptor) and commit in one call, where :attr:`one_call`."""
        ...

    def engine_op(self, op: str, **args: Any) -> Answers:
        """A worker operation a transport needs (``join_group``, ``release_segments``, ...) on every worker."""
        ...


class _RPCWire:
    """What the wires that reach workers by ``collective_rpc`` share: typed errors, the manifest as JSON."""

    one_call: bool = False
    reads_back: bool = True
    releases_segments: bool = True
    summarises: bool = True

    def __init__(self, engine: EngineHandle, timeout: float | None) -> None:
        self.engine = engine
        self.timeout = timeout

    def call(self, method: str, *args: Any, kwargs: dict[str, Any] | None = None) -> Answers:
        """``method`` on every worker. What a worker raised comes back typed, decoded from its envelope (the one
        place the trainer decodes what crosses from an engine: :func:`hotweights.core.envelope.decode`), chained
        to what the engine handle raised; an error that carries no envelope is raised as it is."""
        try:
            return self.engine.workers.call(method, *args, timeout=self.timeout, kwargs=kwargs)
        except Exception as exc:
            typed = envelope.decode(exc)
            if typed is None:
                raise
            raise typed from exc

    @staticmethod
    def _with(options: SessionOptions, manifest: WeightUpdateManifest | None, lent: DeltaBase | None) -> str:
        """``options`` as JSON, carrying ``manifest`` (nothing crosses by reference here)."""
        if lent is not None:
            raise EngineNotSupportedError("a delta base is lent only to a worker in this process")
        if manifest is not None and not options.manifest:
            options = options.model_copy(update={"manifest": manifest.to_json()})
        return options.model_dump_json()

    def install(self, options: SessionOptions, manifest: WeightUpdateManifest, payload: Any) -> Answers:
        raise EngineNotSupportedError(f"{type(self).__name__} has no one-call install")

    def engine_op(self, op: str, **args: Any) -> Answers:
        raise EngineNotSupportedError(f"{type(self).__name__} cannot run the worker operation {op!r}")


class ExtensionWire(_RPCWire):
    """The worker extension's six methods (:mod:`hotweights.vllm.worker.extension`)."""

    def __init__(self, engine: EngineHandle, timeout: float | None) -> None:
        super().__init__(engine, timeout)
        self.one_call = engine.facts.num_workers == 1 and engine.workers.same_hotweights
        if not engine.workers.same_hotweights:  # a server may run another hotweights: it must speak this protocol
            status = engine.workers.status()
            spoken = status.get("protocol") if status else None
            if spoken != PROTOCOL:
                raise EngineNotSupportedError(
                    f"the workers of {engine.describe()} speak hotweights' install protocol {spoken or '1 or none'}, "
                    f"this trainer speaks {PROTOCOL}: run the same hotweights on the trainer and on the server"
                )

    def begin(
        self, options: SessionOptions, manifest: WeightUpdateManifest | None = None, lent: DeltaBase | None = None
    ) -> None:
        self.call("hotweights_begin", self._with(options, manifest, lent))

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self.call("hotweights_stage", update_id, bucket_json, wire_of(descriptor))

    def prepare(self, update_id: str) -> list[list[dict[str, str]]]:
        return self.call("hotweights_prepare", update_id)

    def commit(self, update_id: str) -> list[dict[str, Any]]:
        return self.call("hotweights_commit", update_id)

    def abort(self, update_id: str) -> None:
        self.engine.workers.call("hotweights_abort", update_id, timeout=30.0)

    def install(self, options: SessionOptions, manifest: WeightUpdateManifest, payload: Any) -> Answers:
        bucket_json, descriptor = payload
        wire = wire_of(descriptor)
        return self.call("hotweights_begin", self._with(options, manifest, None), bucket_json, wire)

    def engine_op(self, op: str, **args: Any) -> Answers:
        return self.call("hotweights_engine", op, json.dumps(args))


class TransferAPIWire(_RPCWire):
    """vLLM's four phases, with the session's steps as the ``"hotweights"`` backend's ``update_info``
    (:mod:`hotweights.vllm.worker.transfer_backend`). vLLM's calls return nothing: a commit's summary stays in the
    engine's log, and nothing read back reaches the trainer."""

    reads_back = False
    releases_segments = False  # kept segments are released through the worker extension, which this wire lacks
    summarises = False

    def _update(self, **info: Any) -> Answers:
        return self.call("update_weights", kwargs={"update_info": info})

    def begin(
        self, options: SessionOptions, manifest: WeightUpdateManifest | None = None, lent: DeltaBase | None = None
    ) -> None:
        options_json = self._with(options, manifest, lent)
        self.call("start_weight_update")
        self._update(update_id=_update_id(options, manifest), options_json=options_json)

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self._update(update_id=update_id, bucket_json=bucket_json, descriptor=wire_of(descriptor))

    def prepare(self, update_id: str) -> list[list[dict[str, str]]]:
        self._update(update_id=update_id, prepare=True)  # a worker's problems raise, typed
        return []

    def commit(self, update_id: str) -> list[dict[str, Any]]:
        self.call("finish_weight_update")
        return []  # vLLM's call returns nothing

    def abort(self, update_id: str) -> None:
        self.engine.workers.call(
            "update_weights", timeout=30.0, kwargs={"update_info": {"update_id": update_id, "abort": True}}
        )
        self.engine.workers.call("finish_weight_update", timeout=30.0)

    def engine_op(self, op: str, **args: Any) -> Answers:
        if op == "join_group":
            return self.call("init_weight_transfer_engine", kwargs={"init_info": args})
        if op == "leave_group":
            return self.call("shutdown_weight_transfer_engine")
        return super().engine_op(op, **args)


class InProcessWire:
    """An engine whose worker runs in this process: the session is called directly (by ``collective_rpc`` with a
    function, which in-process is a plain call), the manifest by reference and the tensors through the
    ``reference`` transport. Its errors arrive as raised, typed: nothing crosses a process boundary."""

    one_call = False
    reads_back = True
    releases_segments = False
    summarises = True

    def __init__(self, llm: Any, timeout: float | None) -> None:
        self.llm = llm
        self.timeout = timeout

    def _run(self, fn: Any, *args: Any) -> Answers:
        return list(self.llm.collective_rpc(fn, timeout=self.timeout, args=args))

    def begin(
        self, options: SessionOptions, manifest: WeightUpdateManifest | None = None, lent: DeltaBase | None = None
    ) -> None:
        self._run(_begin_here, options, manifest, lent)

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        if not isinstance(descriptor, ReferenceDescriptor):
            raise EngineNotSupportedError(
                f"an in-process engine stages tensors by reference, not through {descriptor.transport!r}"
            )
        self._run(_stage_here, update_id, descriptor.items)

    def prepare(self, update_id: str) -> list[list[dict[str, str]]]:
        return self._run(_prepare_here, update_id)

    def commit(self, update_id: str) -> list[dict[str, Any]]:
        return self._run(_commit_here, update_id)

    def abort(self, update_id: str) -> None:
        self.llm.collective_rpc(_abort_here, args=(update_id,))

    def install(self, options: SessionOptions, manifest: WeightUpdateManifest, payload: Any) -> Answers:
        raise EngineNotSupportedError("InProcessWire has no one-call install")

    def engine_op(self, op: str, **args: Any) -> Answers:
        raise EngineNotSupportedError(f"an in-process engine needs no worker operation ({op!r})")


def _begin_here(
    worker: Any, options: SessionOptions, manifest: WeightUpdateManifest | None, lent: DeltaBase | None
) -> None:
    """In the worker: open the session. A delta applies to ``lent``, the trainer's own copy (one process, one
    copy); one whose base the worker does not serve raises :class:`~hotweights.DeltaBaseMismatchError` here."""
    session = session_of(worker)
    if options.delta is not None:
        session.base.copy = lent
    session.begin(options, manifest)


def _stage_here(worker: Any, update_id: str, items: Any) -> None:
    session_of(worker).stage_tensors(update_id, items)


def _prepare_here(worker: Any, update_id: str) -> list[dict[str, str]]:
    return session_of(worker).prepare(update_id)


def _commit_here(worker: Any, update_id: str) -> dict[str, Any]:
    return session_of(worker).commit(update_id)


def _abort_here(worker: Any, update_id: str) -> bool:
    return session_of(worker).abort(update_id)


def _update_id(options: SessionOptions, manifest: WeightUpdateManifest | None) -> str:
    if options.delta is not None:
        return str(json.loads(options.delta)["update_id"])
    return manifest.update_id if manifest is not None else str(json.loads(options.manifest)["update_id"])
