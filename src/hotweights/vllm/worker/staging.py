"""Staging of an install on the engine side: buckets are received and checked aside, the model is untouched.

The staging area of :class:`~hotweights.vllm.worker.session.WorkerSession`, so of every engine kind that runs the
install session (the worker extension, the vLLM weight-transfer backend, an in-process worker): ``begin`` (manifest,
checked against the checkpoint the worker serves) -> ``stage`` per bucket (an in-process install stages every tensor
at once, by reference: ``stage_by_reference``) -> ``take`` (every tensor, in manifest order, only if all arrived) or
``abort``. ``stage`` is where a worker receives a transport's descriptor: it is parsed here, once, into its
transport's type (:func:`~hotweights.transports.parse_descriptor`), and a malformed one is refused
(:class:`~hotweights.transports.MalformedDescriptorError`) before anything is received. A session opened with a
:class:`~hotweights.vllm.worker.streaming.Stream` hands each checked bucket to it instead of keeping it
(``finish_stream`` then closes the stream).
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pydantic
import torch

from hotweights.core.buckets import Bucket, bucket_problems, unpack, unpack_parts
from hotweights.core.cast import uncast
from hotweights.core.finite import check_finite
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import Descriptor, MalformedDescriptorError, parse_descriptor, receiver_for
from hotweights.vllm.expected import check_manifest

if TYPE_CHECKING:
    from hotweights.vllm.worker.setter import DirectPlan
    from hotweights.vllm.worker.streaming import Stream

__all__ = ["InstallSession", "StagingArea"]

log = logging.getLogger("hotweights")

#: One thread per worker process that checks staged buckets for NaN and Inf while the next bucket arrives.
_CHECKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotweights-finite")


@dataclass
class InstallSession:
    """What has been staged for one update."""

    manifest: WeightUpdateManifest
    stream: Stream | None = None
    """Set for a streaming session: checked buckets go to it, nothing is kept in ``staged``."""
    direct_plan: DirectPlan | None = None
    """The direct setter's plan, when the session was opened for a direct install (made once, at ``begin``)."""
    method: str | None = None
    """How ``commit`` installs (``"direct"`` or ``"reload"``), decided at ``begin``; None: the layerwise reload."""
    method_reason: str = ""
    """Why ``method`` was chosen, for the report."""
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    by_reference: Any = None
    """The caller's own tensors (an in-process install hands them over by reference: nothing was copied)."""
    received: set[str] = field(default_factory=set)
    partial: dict[str, tuple[torch.Tensor, list[tuple[int, int]]]] = field(default_factory=dict)
    """Tensors arriving in parts (rows): the tensor being assembled, the rows in it so far."""
    keepalive: list[Any] = field(default_factory=list)
    nbytes: int = 0
    digests_verified: int = 0
    check_finite: bool = True
    """Refuse a tensor holding NaN or Inf as it is staged (the session's ``allow_nonfinite`` turns it off)."""
    checks: list[Future[None]] = field(default_factory=list)
    """The NaN/Inf checks of staged buckets still running beside the transfer (joined before anything is taken)."""
    unchecked: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """Tensors staged with ``defer_check``, not yet checked: checked together by :meth:`StagingArea.flush_checks`,
    at the latest when the session is taken."""
    unchecked_buckets: list[int] = field(default_factory=list)
    """The indices of the buckets ``unchecked`` came in (a refusal names them)."""

    def missing(self) -> list[str]:
        return [n for n in self.manifest.tensors if n not in self.received]


class StagingArea:
    """At most one open session; ``owner`` is handed to transports that keep state on it (e.g. a group)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.session: InstallSession | None = None

    def begin(
        self,
        manifest_json: str | WeightUpdateManifest,
        stream: Callable[[WeightUpdateManifest], Stream] | None = None,
        *,
        check: bool = True,
        finite: bool = True,
    ) -> str:
        """Open a session (streaming into ``stream(manifest)`` when given); one left open (e.g. by a crashed
        trainer) is dropped first. A manifest that differs from the checkpoint the owner serves is refused here
        (:func:`~hotweights.vllm.expected.check_manifest`); ``check=False`` for a delta's wire tensors (indices
        and values, checked against the worker's copy by the delta session). ``finite``: refuse a tensor holding NaN
        or Inf as it is staged (:class:`~hotweights.NonFiniteWeightsError`)."""
        if isinstance(manifest_json, WeightUpdateManifest):
            manifest = manifest_json
        else:
            manifest = WeightUpdateManifest.from_json(manifest_json)
        if check:  # against the checkpoint this worker serves, before anything is received
            check_manifest(self.owner, manifest)
        if self.session is not None:
            log.warning("hotweights: dropping unfinished update %s", self.session.manifest.update_id)
            self.abort()
        self.session = InstallSession(
            manifest, stream=stream(manifest) if stream is not None else None, check_finite=finite
        )
        return manifest.update_id

    def current(self, update_id: str) -> InstallSession:
        session = self.session
        if session is None or session.manifest.update_id != update_id:
            active = session.manifest.update_id if session else None
            raise RuntimeError(f"no open install session {update_id!r} on this worker (open: {active!r})")
        return session

    def stage(
        self,
        update_id: str,
        bucket_json: str | Bucket,
        descriptor: Descriptor | dict[str, Any],
        *,
        defer_check: bool = False,
    ) -> int:
        """Receive one bucket through its transport and keep its tensors aside; returns the bytes staged.
        ``bucket_json`` may be a :class:`~hotweights.core.buckets.Bucket` already (an in-process stager).
        ``defer_check``: its NaN/Inf check waits for :meth:`flush_checks`, to check many small buckets together
        (one hand-over to the checking thread instead of one per bucket); never skipped.
        ``descriptor``: its wire form (or, in the trainer's process, the typed descriptor itself)."""
        session = self.current(update_id)
        try:
            bucket = bucket_json if isinstance(bucket_json, Bucket) else Bucket.model_validate_json(bucket_json)
        except pydantic.ValidationError as exc:
            raise ValueError(
                f"malformed bucket description: {exc.error_count()} error(s): {exc.errors()[:3]}"
            ) from None
        nbytes = _declared_bytes(descriptor)
        # Bound everything by the manifest before the transport allocates or reads a byte.
        problems = bucket_problems(bucket, session.manifest, nbytes)
        problems += [f"{e.name!r} was already staged" for e in bucket.entries if e.name in session.received]
        problems += [
            f"{e.name!r} rows {e.rows} were already staged"
            for e in bucket.entries
            if e.rows is not None and e.name in session.partial and _overlaps(e.rows, session.partial[e.name][1])
        ]
        if problems:
            raise ValueError(f"bucket {bucket.index} refused before receiving: " + "; ".join(problems))
        typed = parse_descriptor(descriptor)
        try:
            buffer, keepalive = receiver_for(typed.transport).open(typed, self.owner, bucket, session.manifest)
        except (KeyError, TypeError, AttributeError, OverflowError, AssertionError, RuntimeError) as exc:
            raise ValueError(f"malformed {typed.transport!r} descriptor: {type(exc).__name__}: {exc}") from None
        tensors = dict(unpack(buffer, bucket, session.manifest, checked=True))
        tensors.update(_assemble(session, unpack_parts(buffer, bucket, session.manifest)))
        bad = session.manifest.digest_mismatches(tensors)
        if bad:
            raise ValueError(
                f"bucket {bucket.index}: digest mismatch (bytes changed in transit) for {[m.name for m in bad][:5]}"
            )
        if session.check_finite:  # on the bucket's own bytes, while they are at hand; the first bad bucket refuses
            context = _checked_by_worker(session, f"bucket {bucket.index}")
            if session.stream is not None:  # it goes into the live model now
                check_finite(tensors.items(), context)
            elif defer_check:  # checked with others at the next flush
                session.unchecked.extend(tensors.items())
                session.unchecked_buckets.append(bucket.index)
            else:  # checked beside the next bucket's transfer, joined before anything is taken
                session.checks.append(_CHECKS.submit(check_finite, list(tensors.items()), context))
        session.digests_verified += sum(session.manifest.tensors[n].digest is not None for n in tensors)
        session.received.update(tensors)
        session.nbytes += bucket.nbytes
        if session.stream is not None:
            session.stream.feed(tensors)  # views keep the bucket alive only while a layer still needs them
        else:
            session.staged.update(tensors)
            session.keepalive.append(keepalive)
        return bucket.nbytes

    def flush_checks(self, update_id: str) -> None:
        """Start the NaN/Inf check of every tensor staged with ``defer_check`` since the last flush, in one go
        beside whatever comes next; joined, as every check, before anything is taken."""
        _flush_checks(self.current(update_id))

    def stage_by_reference(self, update_id: str, tensors: Any) -> int:
        """Stage every tensor of the update at once, by reference (an in-process engine). ``tensors`` are the
        caller's (name, tensor) pairs, already checked against the manifest in this very process; only their names
        are checked here. Returns the bytes staged (none copied)."""
        from hotweights.core.cast import item_names

        session = self.current(update_id)
        aside = session.stream is not None and session.stream.builds_aside
        if (session.stream is not None and not aside) or session.received:
            raise RuntimeError(f"update {update_id}: tensors by reference go into an atomic session, all at once")
        names = item_names(tensors)
        if names != list(session.manifest.tensors):
            raise ValueError(f"update {update_id}: the tensors staged by reference are not the manifest's")
        if session.check_finite:  # a cast keeps NaN and Inf: the caller's tensors tell
            check_finite(uncast(tensors), _checked_by_worker(session, "every tensor"))
        if aside:  # built into the model's twin now, while the engine serves
            from hotweights.core.cast import lazy_mapping

            assert session.stream is not None
            session.stream.feed(lazy_mapping(tensors))  # type: ignore[arg-type]
        else:
            session.by_reference = tensors
        session.received.update(names)
        session.nbytes = session.manifest.total_bytes
        return session.nbytes

    def check_complete(self, update_id: str) -> None:
        """Raise unless every tensor of ``update_id`` arrived."""
        _refuse_incomplete(self.current(update_id))

    def take(self, update_id: str) -> tuple[Any, InstallSession]:
        """Every staged tensor in manifest order, closing the session; raises if any never arrived."""
        session = self.current(update_id)
        if session.stream is not None:
            raise RuntimeError(f"update {update_id} is streaming: its tensors are already in the model; commit it")
        self.session = None  # taken or refused, the session ends here
        _refuse_incomplete(session)
        if session.by_reference is not None:
            return session.by_reference, session
        return [(n, session.staged[n]) for n in session.manifest.tensors], session

    def finish_stream(self, update_id: str) -> tuple[int, InstallSession]:
        """Complete a streaming session once every tensor arrived (``stream.finish()``'s count, the session)."""
        session = self.current(update_id)
        if session.stream is None:
            raise RuntimeError(f"update {update_id} is staged, not streaming; take it")
        _refuse_incomplete(session)  # the session stays open: the caller aborts it
        count = session.stream.finish()
        self.session = None
        return count, session

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given); a stream puts incomplete layers back."""
        session = self.session
        if session is None or (update_id is not None and session.manifest.update_id != update_id):
            return False
        self.session = None
        if session.stream is not None:
            session.stream.abort()
        return True


def _declared_bytes(descriptor: object) -> int:
    """The bucket size a descriptor declares, read before anything else of it: the bucket is checked against its
    manifest at that size before the descriptor is parsed for its transport."""
    nbytes = descriptor.nbytes if isinstance(descriptor, Descriptor) else None
    if isinstance(descriptor, dict):
        nbytes = descriptor.get("nbytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        got = reprlib.repr(descriptor)  # bounded: a caller's descriptor may be huge or deeply nested
        raise MalformedDescriptorError(f"malformed descriptor: expected a dict with an integer 'nbytes', got {got}")
    return nbytes


def _overlaps(rows: tuple[int, int], staged: list[tuple[int, int]]) -> bool:
    return any(rows[0] < stop and start < rows[1] for start, stop in staged)


def _assemble(session: InstallSession, parts: Any) -> dict[str, torch.Tensor]:
    """Copy each part into its tensor (allocated at its first part, as the manifest describes it); the tensors
    whose every row has now arrived, ready to be checked and staged like a whole one."""
    done: dict[str, torch.Tensor] = {}
    for name, rows, view in parts:
        if name not in session.partial:
            spec = session.manifest.tensors[name]
            session.partial[name] = (torch.empty(spec.shape, dtype=spec.torch_dtype, device=view.device), [])
        tensor, staged = session.partial[name]
        tensor[rows[0] : rows[1]].copy_(view)
        staged.append(rows)
        if sum(stop - start for start, stop in staged) == tensor.shape[0]:  # no overlaps: checked before
            done[name] = tensor
            del session.partial[name]
    return done


def _checked_by_worker(session: InstallSession, what: str) -> str:
    m = session.manifest
    return f"update {m.update_id} (v{m.weight_version}; {what} checked by the engine's worker as it was staged)"


def _flush_checks(session: InstallSession) -> None:
    if session.unchecked:
        first, last = session.unchecked_buckets[0], session.unchecked_buckets[-1]
        context = _checked_by_worker(session, f"bucket {first}" if first == last else f"buckets {first}-{last}")
        session.checks.append(_CHECKS.submit(check_finite, session.unchecked, context))
        session.unchecked, session.unchecked_buckets = [], []


def _refuse_incomplete(session: InstallSession) -> None:
    _flush_checks(session)  # a deferred check is late at worst, never skipped
    checks, session.checks = session.checks, []
    for check in checks:
        check.result()  # raises the first bucket's NonFiniteWeightsError
    missing = session.missing()
    if missing:
        update_id = session.manifest.update_id
        raise ValueError(f"update {update_id} is incomplete: {len(missing)} tensors never arrived: {missing[:5]}")
