"""The install session, engine side: one protocol for every engine kind, transport and option.

``begin`` (options) -> ``stage`` per bucket -> ``prepare`` -> ``commit``, or ``abort`` at any point before
``commit``. :class:`SessionOptions` chooses, independently:

- the **method**: ``auto`` (the direct setter where its plan proves it safe, else vLLM's layerwise reload),
  ``direct`` or ``reload``;
- the **commit**: ``atomic`` (everything is staged aside; nothing touches the model until ``commit``) or
  ``streaming`` (each bucket goes into the model as it arrives: memory follows the bucket);
- **delta**: the manifest describes either the update itself, or a delta's wire tensors (indices, values, whole
  tensors) to apply to the copy this worker kept of the version it serves (:mod:`hotweights.vllm.worker.kept_base`).

``prepare`` is where every worker says it is ready (all buckets arrived and checked, the delta rebuilt aside)
without writing: a trainer with several workers prepares all of them before any commits. ``commit`` without a
``prepare`` prepares first. The worker extension, vLLM's weight-transfer backend and an in-process engine all
drive this one class; they differ only in how its calls reach the worker.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import pydantic

from hotweights.core import attach, envelope
from hotweights.core.buckets import Bucket
from hotweights.core.delta_wire import DeltaManifest
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    Mismatch,
    MismatchKind,
    NonFiniteWeightsError,
    WeightManifestValidationError,
)
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import Descriptor
from hotweights.vllm.worker import kept_base as delta_state
from hotweights.vllm.worker.expiry import StagingExpiry
from hotweights.vllm.worker.staging import InstallSession, StagingArea
from hotweights.vllm.worker.writer import ModelWriter

if TYPE_CHECKING:
    from hotweights.core.manifest import TensorsLike

__all__ = ["PROTOCOL", "SessionOptions", "WorkerSession", "refusal", "session_of"]

log = logging.getLogger("hotweights")

#: Version of this protocol; ``hotweights_engine("status")`` reports it, so a trainer can refuse a server that
#: speaks another one. 3: refusals and failures cross as envelopes (:mod:`hotweights.core.envelope`), and a delta
#: whose base the worker does not serve raises :class:`~hotweights.DeltaBaseMismatchError` at ``begin``.
PROTOCOL = 3

Summary = dict[str, int | str | float]

#: The longest staging expiry a trainer may ask for (seconds): the engine bounds what a caller makes it hold.
MAX_EXPIRY_S = 3600.0


class SessionOptions(pydantic.BaseModel):
    """What ``begin`` opens. Everything is plain JSON: it crosses every RPC without pickle."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    manifest: str = pydantic.Field(default="", max_length=64 << 20)
    """The manifest (JSON) of what crosses: the update, or, with ``delta``, the delta's wire tensors (empty for a
    delta that changes nothing, or when an in-process caller hands the manifest over by reference)."""
    method: Literal["auto", "direct", "reload", "aside"] = "auto"
    commit: Literal["atomic", "streaming"] = "atomic"
    delta: str | None = pydantic.Field(default=None, max_length=64 << 20)
    """A :class:`~hotweights.core.delta_wire.DeltaManifest` (JSON): apply it to the kept copy instead."""
    shared_base: dict[str, Any] | None = None
    """The trainer's copy in shared memory (:meth:`~hotweights.transports.shm_base.SharedDeltaBase.descriptor`):
    a delta applies to it, and no worker keeps a copy of its own."""
    keep_base: bool = False
    """Keep a host copy of what this session installs, for later deltas (the trainer uses deltas on this engine)."""
    verify: bool = False
    """After the commit, read the live parameters back and compare them with what was staged."""
    allow_nonfinite: bool = False
    """Stage tensors that hold NaN or Inf (by default each bucket is checked as it is staged and such an update is
    refused: :class:`~hotweights.NonFiniteWeightsError`)."""
    kv_reclaimable: bool = False
    """The trainer keeps generation off the engine and resets its caches after (pause ``wait`` or ``abort``): a
    reload may borrow vLLM 0.34's extensible KV cache (:func:`hotweights.vllm.worker.runner.kv_cache_lent`). Sent
    only to an engine that has one."""
    expires_s: float | None = pydantic.Field(default=None, gt=0, le=MAX_EXPIRY_S)
    """Drop what was staged if no commit came within this many seconds (a fleet's trainer that died between stage
    and commit); None: kept until the next ``begin``. At most :data:`MAX_EXPIRY_S`."""

    @classmethod
    def parse(cls, text: str) -> SessionOptions:
        try:
            return cls.model_validate_json(text)
        except pydantic.ValidationError as exc:
            raise ValueError(f"malformed session options: {exc.error_count()} error(s): {exc.errors()[:3]}") from None


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run ``method`` under the session's lock (the staging expiry runs on a timer thread)."""

    @functools.wraps(method)
    def run(self: WorkerSession, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast(F, run)


class WorkerSession:
    """At most one open install on one worker. ``worker`` is what vLLM gives (a worker, or a facade with the same
    ``model_runner`` and ``reload_weights``); transports that keep state (a process group) keep it on ``owner``."""

    def __init__(self, worker: Any, owner: Any = None) -> None:
        self.worker = worker
        self.staging = StagingArea(owner if owner is not None else worker)
        self.options: SessionOptions | None = None
        self.update_id: str | None = None
        self.delta: DeltaManifest | None = None
        self.prepared: delta_state.Prepared | None = None
        self.base = delta_state.WorkerBase()
        self._lock = threading.RLock()
        self.expiry = StagingExpiry(self._lock, lambda: self.update_id, self.abort)
        self.writer = ModelWriter(worker)

    # ------------------------------------------------------------------ the protocol
    @_locked
    def begin(self, options: str | SessionOptions, manifest: WeightUpdateManifest | None = None) -> dict[str, Any]:
        """Open a session. Returns ``{"ok": True, "update_id", "method", "reason"}``. Refuses (raises) malformed
        options, a manifest that differs from the checkpoint served, and a delta whose base this worker does not
        hold (:class:`~hotweights.DeltaBaseMismatchError`), before anything is received; a session left open (by a
        crashed trainer) is dropped only once the new one is accepted. ``manifest`` replaces ``options.manifest``
        for an in-process caller (no JSON round trip)."""
        if isinstance(options, str):
            options = SessionOptions.parse(options)
        elif not isinstance(options, SessionOptions):
            raise ValueError(f"malformed session options: JSON text expected, not {type(options).__name__}")
        if (options.commit == "streaming" or options.method == "aside") and options.verify:
            raise ValueError(
                "verify needs an atomic commit through 'reload' or 'direct': a streaming or aside install keeps no "
                "copy of what it received"
            )
        if options.method == "aside" and (options.commit != "atomic" or options.delta is not None):
            raise ValueError("install_method='aside' is an atomic commit of a full update (no streaming, no delta)")
        given: str | WeightUpdateManifest = manifest if manifest is not None else options.manifest
        opened = self._begin_delta(options, given) if options.delta is not None else self._begin_full(options, given)
        if options.keep_base:
            self.base.tracking = True
        self.expiry.arm(str(opened["update_id"]), options.expires_s)
        return opened

    def _begin_full(self, options: SessionOptions, given: str | WeightUpdateManifest) -> dict[str, Any]:
        chosen: list[Any] = []

        def choose(manifest: WeightUpdateManifest) -> tuple[Any, str, str]:
            from hotweights.vllm.worker.setter import choose_method

            chosen[:] = choose_method(self.writer.model, manifest.tensors, options.method)
            return chosen[0], chosen[1], chosen[2]

        if options.commit == "atomic" and options.method != "aside":
            update_id = self.staging.begin(given)  # checks first, then drops a session left open
            self._opened(options, update_id)
            session = self.staging.current(update_id)
            try:
                session.direct_plan, session.method, session.method_reason = choose(session.manifest)
            except BaseException:
                self.abort(update_id)
                raise
        else:
            from hotweights.vllm.worker.streaming import open_stream

            if options.method != "auto":  # a forced method: the stream plans (or refuses) itself
                chosen[:] = [None, options.method, f"install_method={options.method!r} was asked for"]
            update_id = self.staging.begin(
                given,
                lambda m: open_stream(
                    self.worker, m, chosen[1] if chosen else choose(m)[1], kv_reclaimable=options.kv_reclaimable
                ),
            )
            self._opened(options, update_id)
            session = self.staging.current(update_id)
            session.method, session.method_reason = chosen[1], chosen[2]
            self.base.forget()  # a stream keeps no copy of what it received: the kept copy cannot follow it
        return {"ok": True, "update_id": update_id, "method": session.method, "reason": session.method_reason}

    def _opened(self, options: SessionOptions, update_id: str, delta: DeltaManifest | None = None) -> None:
        """The new session replaces whatever was open (its staging was dropped by ``StagingArea.begin``)."""
        self.options, self.update_id, self.delta, self.prepared = options, update_id, delta, None
        if self.staging.session is not None:
            self.staging.session.check_finite = not options.allow_nonfinite

    @_locked
    def stage(
        self,
        update_id: str,
        bucket_json: str | Bucket,
        descriptor: Descriptor | dict[str, Any],
        *,
        defer_check: bool = False,
    ) -> int:
        """Receive one bucket through its transport and check it against the manifest; returns the bytes staged
        (``defer_check``: :meth:`~hotweights.vllm.worker.staging.StagingArea.stage`)."""
        return self.staging.stage(update_id, bucket_json, descriptor, defer_check=defer_check)

    @_locked
    def flush_checks(self, update_id: str) -> None:
        """Start the NaN/Inf check of the buckets staged with ``defer_check`` (joined before the commit)."""
        self.staging.flush_checks(update_id)

    @_locked
    def stage_tensors(self, update_id: str, tensors: TensorsLike) -> int:
        """Stage every tensor of the update by reference (an in-process engine: nothing is copied)."""
        return self.staging.stage_by_reference(update_id, tensors)

    @_locked
    def prepare(self, update_id: str) -> list[dict[str, str]]:
        """Make the open session ready to commit without writing: every tensor arrived; a delta is checked
        completely and rebuilt aside. Returns the problems found in a delta (as
        :class:`~hotweights.Mismatch` fields; the session is then dropped); raises for anything else."""
        options = self._open(update_id)
        if self.prepared is not None:
            return []
        if options.delta is not None:
            assert self.delta is not None
            try:
                self.prepared = delta_state.prepare(self.base, self.staging, self.delta)
            except NonFiniteWeightsError:  # a staged bucket's check: raised as it is, typed
                self.abort()
                raise
            except WeightManifestValidationError as exc:
                self.abort()
                return [{k: str(v) for k, v in dataclasses.asdict(m).items()} for m in exc.mismatches]
        else:
            self.prepared = delta_state.Prepared(*self._take(update_id))
        return []

    @_locked
    def commit(self, update_id: str) -> Summary:
        """Install what was prepared (preparing first if needed) and close the session; the summary names the
        method that ran and why, what was checked after transit and, with ``verify``, what was read back."""
        options = self._open(update_id)
        problems = self.prepare(update_id)
        if problems:
            raise refusal(problems)
        prepared = self.prepared
        assert prepared is not None
        self.options = self.prepared = self.delta = self.update_id = None
        self.expiry.arm(update_id, None)
        from hotweights.vllm.worker.runner import kv_cache_lent

        with kv_cache_lent(self.worker, reclaimable=options.kv_reclaimable, lend=False):
            return self._commit(options, prepared)

    def _commit(self, options: SessionOptions, prepared: delta_state.Prepared) -> Summary:
        if options.delta is not None:
            return delta_state.commit(self.worker, self.base, prepared, options.method)
        session = prepared.session
        assert session is not None
        if session.stream is not None:
            refreshed, session = self.staging.finish_stream(session.manifest.update_id)
            self.base.served = session.manifest.weight_version
        else:
            self.base.forget()  # from the first write until the install is done, the copy is stale
            refreshed = self.writer.write(session, prepared.items)
            self.base.remember(session.manifest, prepared.items)
        summary: Summary = {
            "tensors": len(session.manifest.tensors),
            "bytes": session.nbytes,
            "digests_verified": session.digests_verified,
            "tied_layers_refreshed": refreshed,
            "install_method": session.method or "reload",
            "install_reason": session.method_reason,
        }
        if options.verify:
            summary.update(self.writer.read_back(session, prepared.items))
        return summary

    @_locked
    def abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given); before ``commit`` the model was never touched
        (a streaming session puts its incomplete layers back)."""
        if update_id is not None and self.update_id != update_id:
            return self.staging.abort(update_id)
        had = self.update_id is not None
        self.options = self.prepared = self.delta = self.update_id = None
        self.expiry.arm("", None)
        return self.staging.abort(update_id) or had

    @_locked
    def install(
        self,
        options: str | SessionOptions,
        stage: Callable[[str], object],
        manifest: WeightUpdateManifest | None = None,
    ) -> dict[str, Any]:
        """``begin``, ``stage(update_id)``, ``commit`` in one call (one worker: one RPC, or an in-process engine).
        A refusal before the write drops the session and comes back as ``{"refused": <envelope>}``
        (:func:`hotweights.core.envelope.encode`: the error's type, message, mismatches and fields)."""
        try:
            opened = self.begin(options, manifest)
            update_id = str(opened["update_id"])
            stage(update_id)
            problems = self.prepare(update_id)
            if problems:
                raise refusal(problems)
        except Exception as exc:
            self.abort()
            return {"refused": envelope.encode(exc)}
        return self.commit(update_id)

    # ------------------------------------------------------------------ helpers
    def _open(self, update_id: str) -> SessionOptions:
        if self.options is None or self.update_id != update_id:
            raise RuntimeError(f"no open install session {update_id!r} on this worker (open: {self.update_id!r})")
        return self.options

    def _take(self, update_id: str) -> tuple[InstallSession, Any]:
        session = self.staging.current(update_id)
        if session.stream is not None:
            self.staging.check_complete(update_id)
            session.stream.prepare()  # a stream into a twin of the model finishes it here, nothing live touched
            return session, ()
        items, session = self.staging.take(update_id)
        return session, items

    def _begin_delta(self, options: SessionOptions, wire: str | WeightUpdateManifest) -> dict[str, Any]:
        delta = DeltaManifest.from_json(options.delta or "")
        if options.shared_base is not None:
            self.base.share(options.shared_base)
        serving = self.base.serving(delta, shared=options.shared_base is not None)
        if serving is not None:
            raise DeltaBaseMismatchError(delta.weight_version, delta.base_version, serving)
        if not delta.entries:  # no wire to stage: drop what was open here
            self.abort()
        delta_state.begin(self.base, self.staging, delta, wire)
        self._opened(options, delta.update_id, delta)
        return {"ok": True, "update_id": delta.update_id, "method": options.method, "reason": "delta"}


def session_of(worker: Any, owner: Any = None) -> WorkerSession:
    """The session of ``worker``, created on first use and kept on it."""
    session: WorkerSession = attach.value(worker, "session", lambda: WorkerSession(worker, owner))
    return session


def refusal(problems: list[dict[str, str]]) -> WeightManifestValidationError:
    found = [Mismatch(cast(MismatchKind, p["kind"]), p["name"], p["expected"], p["actual"]) for p in problems]
    return WeightManifestValidationError(found, context="delta update (checked by the engine's worker)")
