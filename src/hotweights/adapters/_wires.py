"""How the trainer's calls of the install session reach the workers: one wire per way into an engine.

The session itself (:mod:`hotweights.engine.session`) is the same everywhere; a wire only carries its five calls
(``begin``, ``stage``, ``prepare``, ``commit``, ``abort``) and the worker operations a transport needs:

- :class:`ExtensionWire`: hotweights' worker extension, by ``collective_rpc`` (any multiprocess engine, a server);
- :class:`TransferAPIWire`: vLLM's own weight-transfer API (``start_weight_update`` ... ``finish_weight_update``)
  with the ``"hotweights"`` backend;
- :class:`InProcessWire`: an engine in this process, whose worker is called directly, tensors by reference.
"""

from __future__ import annotations

import json
from typing import Any

from hotweights.core import envelope
from hotweights.core.delta import DeltaBase
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.engine.session import PROTOCOL, SessionOptions, refusal, session_of
from hotweights.handles import EngineHandle
from hotweights.transports import Descriptor

__all__ = ["ExtensionWire", "InProcessWire", "TransferAPIWire", "Wire"]

Answers = list[Any]


class Wire:
    """The session's calls on every worker of one engine; one answer per worker."""

    #: Whether :meth:`install` can begin, stage and commit a one-bucket update in one call.
    one_call: bool = False

    def __init__(self, engine: EngineHandle, timeout: float | None) -> None:
        self.engine = engine
        self.timeout = timeout

    def call(self, method: str, *args: Any, kwargs: dict[str, Any] | None = None) -> Answers:
        """``method`` on every worker. What a worker raised comes back typed, decoded from its envelope (the one
        place the trainer decodes what crosses from an engine: :func:`hotweights.core.envelope.decode`), chained
        to what the engine handle raised; an error that carries no envelope is raised as it is."""
        try:
            return self.engine.call(method, *args, timeout=self.timeout, kwargs=kwargs)
        except Exception as exc:
            typed = envelope.decode(exc)
            if typed is None:
                raise
            raise typed from exc

    def begin(self, options: SessionOptions) -> Answers:
        raise NotImplementedError

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        raise NotImplementedError

    def prepare(self, update_id: str) -> Answers:
        raise NotImplementedError

    def commit(self, update_id: str) -> Answers:
        raise NotImplementedError

    def abort(self, update_id: str) -> None:
        raise NotImplementedError

    def install(self, options: SessionOptions, payload: Any) -> Answers:
        """Begin, stage ``payload`` and commit in one call (where :attr:`one_call`)."""
        raise NotImplementedError

    def engine_op(self, op: str, **args: Any) -> Answers:
        raise EngineNotSupportedError(f"{type(self).__name__} cannot run the worker operation {op!r}")


class ExtensionWire(Wire):
    """The worker extension's six methods (:mod:`hotweights.engine.worker_extension`)."""

    def __init__(self, engine: EngineHandle, timeout: float | None) -> None:
        super().__init__(engine, timeout)
        self.one_call = engine.num_workers == 1 and engine.same_hotweights
        if not engine.same_hotweights:  # a server may run another hotweights: it must speak this protocol
            status = engine.worker_status()
            spoken = status.get("protocol") if status else None
            if spoken != PROTOCOL:
                raise EngineNotSupportedError(
                    f"the workers of {engine.describe()} speak hotweights' install protocol {spoken or '1 or none'}, "
                    f"this trainer speaks {PROTOCOL}: run the same hotweights on the trainer and on the server"
                )

    def begin(self, options: SessionOptions) -> Answers:
        return self.call("hotweights_begin", options.model_dump_json())

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self.call("hotweights_stage", update_id, bucket_json, descriptor)

    def prepare(self, update_id: str) -> Answers:
        return self.call("hotweights_prepare", update_id)

    def commit(self, update_id: str) -> Answers:
        return self.call("hotweights_commit", update_id)

    def abort(self, update_id: str) -> None:
        self.engine.call("hotweights_abort", update_id, timeout=30.0)

    def install(self, options: SessionOptions, payload: Any) -> Answers:
        bucket_json, descriptor = payload
        return self.call("hotweights_begin", options.model_dump_json(), bucket_json, descriptor)

    def engine_op(self, op: str, **args: Any) -> Answers:
        return self.call("hotweights_engine", op, json.dumps(args))


class TransferAPIWire(Wire):
    """vLLM's four phases, with the session's steps as the ``"hotweights"`` backend's ``update_info``
    (:mod:`hotweights.engine.transfer_engine`). vLLM's calls return nothing: a commit's summary stays in the
    engine's log."""

    def _update(self, **info: Any) -> Answers:
        return self.call("update_weights", kwargs={"update_info": info})

    def begin(self, options: SessionOptions) -> Answers:
        self.call("start_weight_update")
        update_id = _update_id(options)
        self._update(update_id=update_id, options_json=options.model_dump_json())
        return [{"ok": True, "update_id": update_id}] * self.engine.num_workers

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self._update(update_id=update_id, bucket_json=bucket_json, descriptor=descriptor)

    def prepare(self, update_id: str) -> Answers:
        self._update(update_id=update_id, prepare=True)
        return [[] for _ in range(self.engine.num_workers)]

    def commit(self, update_id: str) -> Answers:
        self.call("finish_weight_update")
        return [{} for _ in range(self.engine.num_workers)]

    def abort(self, update_id: str) -> None:
        self.engine.call(
            "update_weights", timeout=30.0, kwargs={"update_info": {"update_id": update_id, "abort": True}}
        )
        self.engine.call("finish_weight_update", timeout=30.0)

    def engine_op(self, op: str, **args: Any) -> Answers:
        if op == "join_group":
            return self.call("init_weight_transfer_engine", kwargs={"init_info": args})
        if op == "leave_group":
            return self.call("shutdown_weight_transfer_engine")
        return super().engine_op(op, **args)


class InProcessWire(Wire):
    """An engine whose worker runs in this process: the session is called directly (by ``collective_rpc`` with a
    function, which in-process is a plain call), manifest and tensors by reference. Its errors arrive as raised,
    typed: nothing crosses a process boundary."""

    def __init__(self, engine: EngineHandle, llm: Any, timeout: float | None) -> None:
        super().__init__(engine, timeout)
        self.llm = llm

    def open(self, options: SessionOptions, payload: Any) -> None:
        """Begin, stage ``payload`` (manifest, tensors, lent delta base) and prepare: nothing is written."""
        self.llm.collective_rpc(_open_here, timeout=self.timeout, args=(options, *payload))

    def commit(self, update_id: str) -> Answers:
        return list(self.llm.collective_rpc(_commit_here, timeout=self.timeout, args=(update_id,)))

    def abort(self, update_id: str) -> None:
        self.llm.collective_rpc(_abort_here, args=(update_id,))


def _open_here(
    worker: Any, options: SessionOptions, manifest: WeightUpdateManifest | None, tensors: Any, base: DeltaBase | None
) -> None:
    """In the worker: begin, stage by reference, prepare. A delta applies to ``base``, the trainer's own copy lent
    to the worker (one process, one copy); one whose base the worker does not serve raises
    :class:`~hotweights.DeltaBaseMismatchError` here, as it is."""
    session = session_of(worker)
    if options.delta is not None:
        session.base.copy = base
    update_id = str(session.begin(options, manifest)["update_id"])
    if manifest is not None:  # None: a delta that changes nothing, no wire to stage
        session.stage_tensors(update_id, tensors)
    problems = session.prepare(update_id)
    if problems:
        raise refusal(problems)


def _commit_here(worker: Any, update_id: str) -> dict[str, Any]:
    return session_of(worker).commit(update_id)


def _abort_here(worker: Any, update_id: str) -> bool:
    return session_of(worker).abort(update_id)


def _update_id(options: SessionOptions) -> str:
    if options.delta is not None:
        return str(json.loads(options.delta)["update_id"])
    return str(json.loads(options.manifest)["update_id"])
