"""The one contract every install path implements: ``install(manifest, tensors) -> InstallReport``.

:meth:`WeightInstallAdapter.install` owns everything that must be the same for every path: serialising installs,
layout and version checks, validation of the tensors against the manifest and of the manifest against what the
engine expects (all before the first write), timing, the prefix-cache policy and version bookkeeping. Adapters
implement the underscore hooks.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, ClassVar, Literal

import torch

from hotweights.adapters.options import InstallerOptions, PathAbilities, VerifyOption
from hotweights.core.active import ActiveVersion
from hotweights.core.cast import Cast, CastItems, cast_targets, item_names
from hotweights.core.delta import DeltaBase, DeltaState, EncodedDelta, StagedDelta
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    FamilyProbeError,
    HotWeightsError,
    HotWeightsTimeoutError,
    InstallError,
    StaleWeightVersionError,
    WeightManifestValidationError,
    WeightVersionUnknownError,
)
from hotweights.core.families import FamilyCheck
from hotweights.core.gate import WriteGate
from hotweights.core.layout import SUPPORTED_FORMATS
from hotweights.core.manifest import ExpectedWeights, TensorsLike, WeightUpdateManifest, _as_items
from hotweights.core.probe import ProbeReference
from hotweights.core.report import InstallReport, PhaseTimer
from hotweights.core.two_phase import Member
from hotweights.telemetry import best_effort, log_report

__all__ = ["InstallCall", "PrefixCachePolicy", "WeightInstallAdapter"]

logger = logging.getLogger("hotweights")

PrefixCachePolicy = Literal["reset", "keep"]
"""``reset`` (default): drop cached prefixes after every install so no output is computed from KV entries of the
old weights. ``keep``: leave the cache (only for callers that reset it themselves)."""

Items = Sequence[tuple[str, torch.Tensor]]


class InstallCall(PhaseTimer):
    """One install in progress: its phases, and what belongs to it alone, never to the adapter that several installs
    share: the verify option, whether the engine may have been written, the gate it holds (``writing``), when it
    took it (the start of its stall) and which install path ran."""

    def __init__(
        self, verify: bool = False, *, strict: bool = False, member: Member | None = None, allow_nonfinite: bool = False
    ) -> None:
        super().__init__()
        self.verify = verify
        self.strict = strict
        self.allow_nonfinite = allow_nonfinite
        """Install tensors holding NaN or Inf (by default refused before anything is written)."""
        self.member = member
        """The fleet member this install runs as (None: a plain install): it stops at the fleet's commit point."""
        self.writing = ExitStack()
        self.may_have_written = False
        self.held_since: float | None = None
        self.path: tuple[str, str] | None = None


class WeightInstallAdapter(ABC):
    """Base class of every install path.

    Args:
        expected: what the engine accepts; every manifest is checked against it before anything is written.
            None skips that check (the engine then reports shape errors itself, possibly after partial writes).
        prefix_cache: see :data:`PrefixCachePolicy`.
        lock_timeout: seconds to wait for a concurrent install (and, with a gate, for running generation calls)
            to finish before raising :class:`HotWeightsTimeoutError` (None waits forever).
        gate: a :class:`~hotweights.core.gate.WriteGate` (e.g. the :class:`~hotweights.core.gate.ServingGate` that
            a ``vllm.LLM``'s generation calls enter); the install holds it alone while it writes. None: the caller
            guarantees installs and generation never overlap.
    """

    #: Short name used in reports.
    name: ClassVar[str] = "adapter"
    #: Weight formats this adapter installs.
    formats: ClassVar[frozenset[str]] = SUPPORTED_FORMATS
    #: Whether tensor-parallel shards are accepted.
    sharded: ClassVar[bool] = False
    #: Whether manifest digests are checked here, before sending (True) or by the engine after transit (False).
    verifies_digests_locally: ClassVar[bool] = True
    #: The options this path was built with (checked once, when it was built): an installer's own; the defaults
    #: (no read-back by default) for the other paths.
    options: InstallerOptions = InstallerOptions()

    def __init__(
        self,
        *,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        lock_timeout: float | None = 600.0,
        gate: WriteGate | None = None,
        version: ActiveVersion | None = None,
        delta_state: DeltaState | None = None,
    ) -> None:
        if prefix_cache not in ("reset", "keep"):
            raise ValueError(f"prefix_cache must be 'reset' or 'keep', not {prefix_cache!r}")
        self.expected = expected
        self.prefix_cache: PrefixCachePolicy = prefix_cache
        self.lock_timeout = lock_timeout
        self._version = version if version is not None else ActiveVersion()
        self.active_update_id: str | None = None
        self._lock = threading.Lock()
        self.gate = gate
        """Held alone from the first write to the prefix-cache reset, so no generation call sees a mix."""
        self._delta = delta_state if delta_state is not None else DeltaState()
        """The host copy deltas are computed against (see :mod:`hotweights.core.delta`): the engine's handle holds
        it for adapters bound to an engine, so every adapter on it shares one."""

    @property
    def label(self) -> str:
        """Name used in reports (adapters with a transport add its name)."""
        return self.name

    @property
    def abilities(self) -> PathAbilities:
        """What this path can do (read back, deltas), against which the options of each install are checked
        (:meth:`InstallerOptions.check_call`): by default, neither."""
        return PathAbilities(self.label)

    @property
    def verify(self) -> bool:
        """Default of ``install(verify=...)``."""
        return self.options.verify

    # ------------------------------------------------------------------ what a fleet asks of a replica's adapter
    @property
    def stages_apart(self) -> bool:
        """Whether an install stops, staged, before its first write (at :func:`hotweights.core.two_phase.commit_point`),
        so a fleet can commit every replica or none."""
        return False

    @property
    def bucket_size(self) -> int | None:
        """Bytes per bucket this adapter sends (None: it does not cut the update into buckets)."""
        return None

    @property
    def sends_bytes(self) -> bool:
        """Whether an install copies the update's bytes to the engine (False: handed over by reference)."""
        return True

    @property
    def shared_transport(self) -> Any:
        """The transport whose buckets several engines may stage from one copy (None: none)."""
        return None

    @property
    def active_weight_version(self) -> int | None:
        """Version now served; None while the engine serves the weights it started with. Held by the engine's
        handle for adapters bound to an engine (shared by every adapter on it, seeded from the engine's record)."""
        return self._version.value

    @active_weight_version.setter
    def active_weight_version(self, version: int | None) -> None:
        self._version.value = version

    # ------------------------------------------------------------------ public verb
    def install(
        self,
        manifest: WeightUpdateManifest,
        tensors: TensorsLike,
        *,
        force: bool = False,
        delta: bool = False,
        verify: VerifyOption = None,
        cast: Cast | None = None,
        family: FamilyCheck | None = None,
        member: Member | None = None,
        allow_nonfinite: bool = False,
    ) -> InstallReport:
        """Validate ``tensors`` against ``manifest`` and the engine, install them, and report.

        Args:
            manifest: what is being installed (see :meth:`WeightUpdateManifest.from_state_dict`).
            tensors: mapping or ``(name, tensor)`` pairs in checkpoint format, on any device.
            force: install even if ``manifest.weight_version`` is not newer than the active version.
            verify: after the commit, read the live parameters back and compare them with what ``tensors`` put
                there (None: the adapter's ``verify``). A mismatch raises :class:`InstallError` and generation
                fails closed. Raises ``ValueError`` (nothing written) where the adapter cannot read back. A read-back
                that could compare nothing is logged as a warning and named in ``report.readback_note``;
                ``"strict"`` makes any tensor that could not be read back an :class:`InstallError` (fail closed).
            delta: send only what changed since the version last installed into this engine through hotweights
                (see :mod:`hotweights.core.delta`; the copy diffed against lives with the engine's handle, shared by
                every adapter on it); the first such install sends everything and keeps that copy
                (``report.delta == "full"``). Raises :class:`DeltaBaseMismatchError` when the engine serves another
                version than that copy.
            cast: a floating-point dtype (e.g. ``torch.bfloat16``) or ``"engine"`` (the dtype the engine expects for
                each tensor): floating-point tensors of another dtype are cast as they are sent, bucket by bucket
                (never a second copy of the update); ``report.cast_tensors`` counts them. ``manifest`` describes
                ``tensors`` as given. None (default): a dtype that differs from the engine's is refused.
            member: run as this member of a fleet (:class:`~hotweights.fleet.Fleet` passes it): the install stops
                at the fleet's commit point, staged, until every replica staged (see :mod:`hotweights.core.two_phase`).
            family: how the model's family is guarded (:func:`hotweights._family.check_family`, which
                ``hotweights.install`` runs): its probe is scored after the write, before generation is let back
                in, and a difference fails closed (:class:`FamilyProbeError`).
            allow_nonfinite: install tensors holding NaN or Inf. By default each bucket is checked where its bytes
                already are (the engine's worker, as it stages it) and such an update is refused.

        Raises:
            WeightManifestValidationError: names, shapes or dtypes do not match (every mismatch listed);
                nothing was written.
            NonFiniteWeightsError: a tensor holds NaN or Inf (each one named, with counts); nothing was written.
            UnsupportedLayoutError: the manifest's layout is not one this adapter installs.
            StaleWeightVersionError: the version is not newer than the active one and ``force`` is False.
            HotWeightsTimeoutError: another install held the lock past ``lock_timeout``.
            InstallError: the engine failed while installing.
        """
        timeout = -1 if self.lock_timeout is None else self.lock_timeout
        if not self._lock.acquire(timeout=timeout):
            raise HotWeightsTimeoutError(
                f"waited {self.lock_timeout} s for another install on this engine to finish; retry later or "
                "raise lock_timeout"
            )
        try:
            wanted = self.options.check_call(verify, delta, self.abilities)
            call = InstallCall(wanted, strict=verify == "strict", member=member, allow_nonfinite=allow_nonfinite)
            items = tensors if isinstance(tensors, CastItems) else _as_items(tensors)  # lazy stays lazy
            return log_report(self._install_locked(call, manifest, items, force, delta, cast, family))
        finally:
            self._lock.release()

    def _install_locked(
        self,
        timer: InstallCall,
        manifest: WeightUpdateManifest,
        items: Items,
        force: bool,
        delta: bool = False,
        cast: Cast | None = None,
        family: FamilyCheck | None = None,
    ) -> InstallReport:
        with timer("validate"):
            if cast is not None:
                manifest, items = self._cast(manifest, items, cast)
            send, skipped = self._validate(manifest, items, force)
            probe = family.probe() if family is not None and family.probe is not None else None
        encoded = self._encode_delta(manifest, send, timer) if delta and self._delta.base is not None else None
        self._delta.tracking = self._delta.tracking or delta  # from the first delta install on, keep a copy
        with timer.writing:  # holds the gate from the first write until the cache is reset
            report = self._commit(manifest, send, skipped, timer, encoded, delta, family, probe)
        if timer.held_since is None:
            return report
        return report.model_copy(update={"stall_s": time.perf_counter() - timer.held_since})  # the gate is open

    def _cast(self, manifest: WeightUpdateManifest, items: Items, cast: Cast) -> tuple[WeightUpdateManifest, CastItems]:
        """Check ``items`` against the caller's ``manifest``, then both as the engine will receive them (cast
        lazily, see :mod:`hotweights.core.cast`)."""
        if isinstance(items, CastItems):  # already lazy (a sharded state dict): its manifest was made of it
            lazy = items.recast(cast_targets(manifest, cast, self.expected))
            return lazy.manifest(manifest), lazy
        problems = manifest.mismatches(items)
        if not problems and manifest.has_digests:
            problems += manifest.digest_mismatches(items)
        if problems:
            raise WeightManifestValidationError(problems)
        lazy = CastItems(items, cast_targets(manifest, cast, self.expected))
        return lazy.manifest(manifest), lazy

    def _encode_delta(
        self, manifest: WeightUpdateManifest, send: Items, timer: PhaseTimer
    ) -> tuple[EncodedDelta, StagedDelta]:
        """The delta from the host copy to ``send``, and the same delta staged on the copy (nothing written yet)."""
        base = self._delta.base
        assert base is not None
        now = self._engine_version_now()
        if now is not None and self._delta.engine_version is not None and now != self._delta.engine_version:
            self._delta.base = None  # someone else installed: the next install sends everything
            serving = f"v{now}" if now.isdecimal() else f"version {now!r}"
            raise DeltaBaseMismatchError(manifest.weight_version, base.version, serving)
        with timer("delta_encode"):
            encoded = base.encode(
                send, weight_version=manifest.weight_version, update_id=manifest.update_id, digests=manifest.has_digests
            )
            return encoded, base.staged(encoded)

    def _begin_writing(self, timer: InstallCall) -> None:
        """Called by an adapter right before its first step that can change live weights: waits for running
        generation calls (holding new ones off until the install is done) and arms recovery."""
        if self.gate is not None and not timer.may_have_written:
            with timer("wait_generation"):
                timer.writing.enter_context(self.gate.installing(self.lock_timeout))
            timer.held_since = time.perf_counter()
        timer.may_have_written = True

    @staticmethod
    def _untouched(timer: InstallCall) -> None:
        """The engine confirmed that nothing was written after :meth:`_begin_writing` (it refused the update
        first): a failure now needs no recovery."""
        timer.may_have_written = False

    def _commit(
        self,
        manifest: WeightUpdateManifest,
        send: Items,
        skipped: list[tuple[str, str]],
        timer: InstallCall,
        delta: tuple[EncodedDelta, StagedDelta] | None = None,
        delta_asked: bool = False,
        family: FamilyCheck | None = None,
        probe: ProbeReference | None = None,
    ) -> InstallReport:
        try:
            if delta is not None:
                summary = self._install_delta(manifest, *delta, timer) or {}
            else:
                summary = self._install(manifest, send, timer) or {}
            self._check_strict_readback(summary, timer)
        except BaseException as exc:
            if timer.may_have_written:  # the engine may hold anything: the next delta install sends everything
                self._delta.base = None
            if not isinstance(exc, Exception):  # KeyboardInterrupt & co.: recover if needed, keep the interrupt
                if timer.may_have_written:
                    with best_effort("recover after an interrupted write"):
                        self._recover()
                    self._refuse_serving(manifest)
                raise
            what = _described(exc)
            if not timer.may_have_written:
                if isinstance(exc, HotWeightsError) and not (isinstance(exc, InstallError) and exc.origin):
                    raise  # hotweights' own (also from an engine's process, decoded): as it is
                raise InstallError(
                    f"update {manifest.update_id} (v{manifest.weight_version}) failed before the model was touched: "
                    f"{what}. Still serving: {self._serving()}. Fix the cause and install again."
                ) from exc
            try:
                cleared = self._recover()
            except Exception as rec:
                cleared = f"recovery failed too ({type(rec).__name__}: {rec}); restart the engine"
            closed = " Generation calls raise PartialUpdateError until then." if self._refuse_serving(manifest) else ""
            raise InstallError(
                f"the engine failed while writing update {manifest.update_id} (v{manifest.weight_version}): "
                f"{what}. Some layers may hold new weights; {cleared}. Install a full update "
                f"again before serving.{closed}"
            ) from exc
        path = timer.path
        family_check = self._check_family(manifest, family, probe, timer)
        previous = self.active_weight_version
        nbytes = sum(manifest.tensors[n].expected_nbytes for n in item_names(send))
        if delta is not None and self._delta.base is not None:
            self._delta.base.commit(delta[1])
        elif self._delta.tracking:
            self._delta.base = self._capture_base(send, manifest.weight_version)
        # The new weights are in: from here on the engine serves them, whatever happens next.
        self.reopen_serving()  # a complete install heals a failed one
        self.active_weight_version = manifest.weight_version
        self.active_update_id = manifest.update_id
        reset = False
        try:
            if self.prefix_cache == "reset":
                with timer("reset_prefix_cache"):
                    reset = self._reset_prefix_cache()
            with timer("record_version"):
                engine_version = self._record_engine_version(str(manifest.weight_version))
            self._delta.engine_version = engine_version
        except Exception as exc:
            raise InstallError(
                f"v{manifest.weight_version} was installed, but the follow-up step failed: {type(exc).__name__}: "
                f"{exc}. Call llm.reset_prefix_cache() before serving, so no output reuses the old weights' KV "
                "blocks."
            ) from exc
        return InstallReport(
            update_id=manifest.update_id,
            weight_version=manifest.weight_version,
            previous_version=previous,
            adapter=self.label,
            num_tensors=len(send),
            num_bytes=nbytes,
            skipped=tuple(f"{n}: {why}" for n, why in skipped),
            prefix_cache_reset=reset,
            engine_weight_version=engine_version,
            digests_verified=int(summary.get("digests_verified", 0)),
            install_method=path[0] if path else None,
            install_reason=path[1] if path else None,
            readback_verified=int(summary.get("readback_verified", 0)) if timer.verify else None,
            readback_unreadable=int(summary.get("readback_unreadable", 0)) if timer.verify else None,
            readback_note=self._readback_note(summary) if timer.verify else None,
            phases=timer.phases,
            bytes_sent=delta[0].bytes_sent if delta is not None else nbytes,
            cast_tensors=send.cast_tensors if isinstance(send, CastItems) else 0,
            delta="applied" if delta is not None else "full" if delta_asked else "off",
            delta_changed=len(delta[0].manifest.entries) if delta is not None else 0,
            family_check=family_check,
        )

    def _check_family(
        self,
        manifest: WeightUpdateManifest,
        family: FamilyCheck | None,
        ref: ProbeReference | None,
        timer: PhaseTimer,
    ) -> str | None:
        """Score the engine on ``ref``, ``family``'s probe (the write is done, generation still held off); on a
        difference, fail closed and raise :class:`FamilyProbeError`. Returns the report's ``family_check`` line."""
        if family is None or ref is None:
            return None if family is None else family.verdict
        start = time.perf_counter()
        with timer("family_probe"):
            self._reset_prefix_cache()  # the probe must not reuse blocks computed with the old weights
            got = self._probe_logprobs(ref.token_ids)
        ok, worst = ref.judge(got) if got is not None else (False, float("inf"))
        logger.info(
            "hotweights: family probe of %s at v%s: the engine scored it in %.2f s, max |dlogprob| %g (tolerance %g): "
            "%s",
            family.architecture,
            manifest.weight_version,
            time.perf_counter() - start,
            worst,
            ref.tolerance,
            "passed" if ok else "it differs, failing closed",
        )
        if ok:
            verdict = f"{family.verdict} at v{manifest.weight_version}: max |dlogprob| {worst:g} <= {ref.tolerance:g}"
            if family.passed is not None:
                family.passed(verdict)
            return verdict
        self._delta.base = None
        with best_effort("recover after a failed family probe"):
            self._recover()
        reason = (
            f"generation refused: after update {manifest.update_id} (v{manifest.weight_version}) the engine's output "
            f"on the family probe differed from the reference computed from the sent tensors by {worst:g} (tolerance "
            f"{ref.tolerance:g}). A successful install lifts this (unproven='trust' installs without the probe, where "
            "a freshly started engine on the same weights differs as much); else restart the engine."
        )
        self._refuse_serving(manifest, reason)
        raise FamilyProbeError(
            f"{family.architecture}: after the write, the engine's output on the family probe differed from the "
            f"reference computed from the sent tensors (log-probabilities off by {worst:g}, tolerance "
            f"{ref.tolerance:g}); {family.verdict}. Generation now fails closed and the active version stays "
            f"{self._serving()}. If a freshly started engine on the same weights gives the same output, the reference "
            "is what differs (transformers computes this family otherwise than vLLM), not the install: install again "
            "with unproven='trust' (or HOTWEIGHTS_UNPROVEN=trust), which installs without the probe. If a fresh "
            "engine matches the reference, vLLM's reload of this family is wrong here: restart the engine from a "
            "checkpoint of the new weights, and report it (docs/architectures.md)."
        )

    def _probe_logprobs(self, token_ids: tuple[int, ...]) -> list[float | None] | None:
        """The engine's prompt log-probabilities of ``token_ids`` (see :meth:`EngineHandle.prompt_logprobs`);
        None where this adapter cannot ask."""
        return None

    def _refuse_serving(self, manifest: WeightUpdateManifest, reason: str | None = None) -> bool:
        """Fail closed after a partial write: generation through the gate raises until a full install succeeds."""
        if self.gate is None:
            return False
        self.gate.refuse(
            reason
            or f"generation refused: update {manifest.update_id} (v{manifest.weight_version}) failed while writing, "
            "so this engine may hold a mix of old and new weights. Install a full update first (the active version "
            "did not change, so the same weight_version is accepted), or call adapter.reopen_serving() to generate "
            "anyway."
        )
        return True

    def _validate(
        self, manifest: WeightUpdateManifest, items: Items, force: bool
    ) -> tuple[Items, list[tuple[str, str]]]:
        manifest.layout.validate_supported(self.formats, self.sharded)
        try:
            active = self._version.checked()
        except Exception as exc:  # never "no version": an older update would pass
            if not force:
                raise WeightVersionUnknownError(manifest.weight_version, exc) from exc
            active = None
        if active is not None and manifest.weight_version <= active and not force:
            raise StaleWeightVersionError(manifest.weight_version, active)
        checked = isinstance(items, CastItems)  # by _cast, against the caller's own manifest and bytes
        problems = [] if checked else manifest.mismatches(items)
        if self.expected is not None:
            problems += self.expected.mismatches(manifest)
        if not problems and not checked and self.verifies_digests_locally and manifest.has_digests:
            problems += manifest.digest_mismatches(items)
        if problems:
            raise WeightManifestValidationError(problems)
        ignored = self.expected.ignored if self.expected is not None else {}
        skipped = [(n, ignored[n]) for n in item_names(items) if n in ignored]
        if isinstance(items, CastItems):
            return items.without(ignored), skipped
        return [(n, t) for n, t in items if n not in ignored], skipped

    def _serving(self) -> str:
        v = self.active_weight_version
        return "the engine's initial weights" if v is None else f"v{v}"

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, int] | None:
        """Write validated tensors into the engine; time sub-phases with ``timer``.

        Call :meth:`_begin_writing` right before the first step that can change live weights: it takes the serving
        gate, and a failure after it triggers :meth:`_recover`. May return counters for the report
        (``digests_verified``).
        """

    @staticmethod
    def _check_strict_readback(summary: dict[str, Any], call: InstallCall) -> None:
        unreadable = int(summary.get("readback_unreadable", 0))
        if call.verify and call.strict and unreadable:
            why = summary.get("readback_note") or "their parameters hold no data to read"
            raise ValueError(
                f'verify="strict": {unreadable} tensor(s) could not be read back ({why}), so the install is not '
                "proven; use verify=True to accept an install that is verified only where it can be read"
            )

    @staticmethod
    def _readback_note(summary: dict[str, Any]) -> str | None:
        verified, unreadable = int(summary.get("readback_verified", 0)), int(summary.get("readback_unreadable", 0))
        note = str(summary["readback_note"]) if summary.get("readback_note") else None
        if verified == 0 and unreadable:
            note = f"nothing could be read back: {note or 'no parameter of the update holds readable data'}"
            logger.warning("verify=True read nothing back (%d tensors unreadable): %s", unreadable, note)
        return note

    @staticmethod
    def _ran(timer: InstallCall, method: str, reason: str) -> None:
        """Called by an adapter's :meth:`_install`: which install path ran (e.g. ``"direct"``) and why, for the
        report (``install_method``, ``install_reason``)."""
        timer.path = (method, reason)

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, int] | None:
        """Install a checked delta: ``delta`` is what to send, ``staged`` the same delta applied to this adapter's
        host copy (its ``items``: what to reinstall). Call :meth:`_begin_writing` as :meth:`_install` does."""
        raise NotImplementedError

    def _engine_version_now(self) -> str | None:
        """The version the engine reports now (None: unknown); a delta is refused when it is not the one recorded
        by this adapter's last install."""
        return None

    def _capture_base(self, items: Items, version: int) -> DeltaBase:
        """The host copy of what was just installed, for later deltas."""
        return DeltaBase.capture(items, version)

    def forget_delta_base(self) -> None:
        """Drop the host copy kept for delta installs (frees the model's size in host memory); the next
        ``delta=True`` install sends everything again."""
        self._delta.forget()

    def _recover(self) -> str:
        """After a failure that may have touched live weights: make stale or poisoned KV state unservable.

        Returns what was done, for the error message.
        """
        return "the KV cache was left as is"

    def _reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefixes; True when the engine confirmed."""
        return False

    def _record_engine_version(self, version: str) -> str | None:
        """Store the version in the engine where it keeps one; return what the engine reports."""
        return None

    def reopen_serving(self) -> None:
        """Let generation calls in again after an install that failed while writing (they raise
        :class:`PartialUpdateError` until a full install succeeds). The engine may serve a mix of old and new
        weights: use it only if that is acceptable, e.g. to inspect the engine."""
        if self.gate is not None:
            self.gate.reopen()

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless an adapter holds resources
        """Release what the adapter holds (no-op by default)."""

    def __enter__(self) -> WeightInstallAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _described(exc: BaseException) -> str:
    """``exc`` in an install error's message: its type and message (an error an engine's worker raised that is not
    hotweights' own already starts with its type's name: :attr:`InstallError.origin`)."""
    if isinstance(exc, InstallError) and exc.origin:
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
