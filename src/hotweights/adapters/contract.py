"""The one contract every install path implements: ``install(manifest, tensors) -> InstallReport``.

:meth:`WeightInstallAdapter.install` owns everything that must be the same for every path: one install at a time
into an engine (the engine handle's install lock, the one lock of an install), layout and version checks,
validation of the tensors against the manifest and of the manifest against what the engine expects (all before the
first write, :mod:`~hotweights.adapters.checks`), the write and what follows it (:mod:`~hotweights.adapters.commit`:
timing, the family probe, the prefix-cache policy and version bookkeeping) and failing closed after a partial
write (:mod:`~hotweights.adapters.failure`). A path implements :meth:`~WeightInstallAdapter._install`; the other
hooks ask the engine's handle where the adapter is bound to one (:class:`~hotweights.adapters.Installer` always is).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar, Literal

from hotweights.adapters import checks
from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.commit import commit
from hotweights.adapters.options import VerifyOption
from hotweights.adapters.traits import PathTraits
from hotweights.core.active import ActiveVersion
from hotweights.core.cast import Cast, CastItems
from hotweights.core.delta import DeltaBase, DeltaState, EncodedDelta, StagedDelta
from hotweights.core.errors import HotWeightsTimeoutError
from hotweights.core.families import FamilyCheck
from hotweights.core.gate import WriteGate
from hotweights.core.layout import SUPPORTED_FORMATS
from hotweights.core.manifest import ExpectedWeights, TensorsLike, WeightUpdateManifest, _as_items
from hotweights.core.report import InstallReport
from hotweights.core.two_phase import Member
from hotweights.handles import EngineHandle
from hotweights.telemetry import log_report

__all__ = ["PrefixCachePolicy", "WeightInstallAdapter"]

PrefixCachePolicy = Literal["reset", "keep"]
"""``reset`` (default): drop cached prefixes after every install so no output is computed from KV entries of the
old weights. ``keep``: leave the cache (only for callers that reset it themselves)."""


class WeightInstallAdapter(PathTraits, ABC):
    """Base class of every install path.

    Args:
        engine: the engine's handle the adapter installs into (None: the adapter reaches its engine itself, e.g. a
            test double); its hooks then ask it to reset the prefix cache, record the version, recover and score
            the family probe, and its install lock serialises installs.
        expected: what the engine accepts; every manifest is checked against it before anything is written.
            None skips that check (the engine then reports shape errors itself, possibly after partial writes).
        prefix_cache: see :data:`PrefixCachePolicy`.
        lock_timeout: seconds to wait for a concurrent install (and, with a gate, for running generation calls)
            to finish before raising :class:`HotWeightsTimeoutError` (None waits forever).
        gate: a :class:`~hotweights.core.gate.WriteGate` (e.g. the :class:`~hotweights.core.gate.ServingGate` that
            a ``vllm.LLM``'s generation calls enter); the install holds it alone while it writes. None: the caller
            guarantees installs and generation never overlap.
    """

    #: Weight formats this adapter installs.
    formats: ClassVar[frozenset[str]] = SUPPORTED_FORMATS
    #: Whether tensor-parallel shards are accepted.
    sharded: ClassVar[bool] = False
    #: Whether manifest digests are checked here, before sending (True) or by the engine after transit (False).
    verifies_digests_locally: ClassVar[bool] = True

    def __init__(
        self,
        *,
        engine: EngineHandle | None = None,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        lock_timeout: float | None = 600.0,
        gate: WriteGate | None = None,
        version: ActiveVersion | None = None,
        delta_state: DeltaState | None = None,
    ) -> None:
        if prefix_cache not in ("reset", "keep"):
            raise ValueError(f"prefix_cache must be 'reset' or 'keep', not {prefix_cache!r}")
        self.engine = engine
        self.expected = expected
        self.prefix_cache: PrefixCachePolicy = prefix_cache
        self.lock_timeout = lock_timeout
        self._version = version if version is not None else ActiveVersion()
        self.active_update_id: str | None = None
        self._lock = threading.Lock()
        """One install at a time into an adapter without an engine (bound to one: the engine handle's lock)."""
        self.gate = gate
        """Held alone from the first write to the prefix-cache reset, so no generation call sees a mix."""
        self._delta = delta_state if delta_state is not None else DeltaState()
        """The host copy deltas are computed against (see :mod:`hotweights.core.delta`): the engine's handle holds
        it for adapters bound to an engine, so every adapter on it shares one."""

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
        if self.engine is not None:  # the engine's install lock (already held where hotweights.install took it)
            one_at_a_time = self.engine.installing(None, self.lock_timeout)
        else:
            one_at_a_time = _held(self._lock, self.lock_timeout)
        with one_at_a_time:
            wanted = self.options.check_call(verify, delta, self.abilities)
            call = InstallCall(wanted, strict=verify == "strict", member=member, allow_nonfinite=allow_nonfinite)
            items = tensors if isinstance(tensors, CastItems) else _as_items(tensors)  # lazy stays lazy
            with call("validate"):
                if cast is not None:
                    manifest, items = checks.cast(self, manifest, items, cast)
                send, skipped = checks.validate(self, manifest, items, force)
                probe = family.probe() if family is not None and family.probe is not None else None
            encoded = (
                checks.encode_delta(self, manifest, send, call) if delta and self._delta.base is not None else None
            )
            self._delta.tracking = self._delta.tracking or delta  # from the first delta install on, keep a copy
            with call.writing:  # holds the gate from the first write until the cache is reset
                report = commit(self, manifest, send, skipped, call, encoded, delta, family, probe)
            if call.held_since is not None:  # the gate is open again: the install's stall is over
                report = report.model_copy(update={"stall_s": time.perf_counter() - call.held_since})
            return log_report(report)

    def _begin_writing(self, timer: InstallCall) -> None:
        """Called by an adapter right before its first step that can change live weights: waits for running
        generation calls (holding new ones off until the install is done) and arms recovery."""
        if self.gate is not None and not timer.may_have_written:
            with timer("wait_generation"):
                timer.writing.enter_context(self.gate.installing(self.lock_timeout))
            timer.held_since = time.perf_counter()
        timer.may_have_written = True

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, int] | None:
        """Write validated tensors into the engine; time sub-phases with ``timer``.

        Call :meth:`_begin_writing` right before the first step that can change live weights: it takes the serving
        gate, and a failure after it triggers :meth:`_recover`. May return counters for the report
        (``digests_verified``).
        """

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, int] | None:
        """Install a checked delta: ``delta`` is what to send, ``staged`` the same delta applied to this adapter's
        host copy (its ``items``: what to reinstall). Call :meth:`_begin_writing` as :meth:`_install` does."""
        raise NotImplementedError

    def _capture_base(self, items: Items, version: int) -> DeltaBase:
        """The host copy of what was just installed, for later deltas (where the path keeps it)."""
        return self.path.capture_base(items, version)

    def _recover(self) -> str:
        """After a failure that may have touched live weights: make stale or poisoned KV state unservable (the
        engine's KV cache zeroed where it can be reached, its prefix cache reset).

        Returns what was done, for the error message.
        """
        if self.engine is None:
            return "the KV cache was left as is"
        zeroed = self.engine.workers.clear_kv_cache()
        self.engine.reset_prefix_cache()
        if zeroed is None:
            return "the prefix cache was reset (the KV cache cannot be reached from here)"
        return f"the prefix cache was reset and {zeroed} KV-cache tensors zeroed"

    def _reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefixes; True when the engine confirmed."""
        return self.engine.reset_prefix_cache() if self.engine is not None else False

    def _record_engine_version(self, version: str) -> str | None:
        """Store the version in the engine where it keeps one; return what the engine reports."""
        return self.engine.set_weight_version(version) if self.engine is not None else None

    def _engine_version_now(self) -> str | None:
        """The version the engine reports now (None: unknown); a delta is refused when it is not the one recorded
        by this adapter's last install."""
        return self.engine.get_weight_version() if self.engine is not None else None

    def _probe_logprobs(self, token_ids: tuple[int, ...], label: str) -> list[float | None] | None:
        """The engine's prompt log-probabilities of ``token_ids`` (see
        :meth:`~hotweights.handles.parts.ServedModel.prompt_logprobs`; ``label``: the version being installed); None
        where this adapter cannot ask."""
        return self.engine.model.prompt_logprobs(token_ids, label) if self.engine is not None else None

    # ------------------------------------------------------------------ the caller's controls
    def forget_delta_base(self) -> None:
        """Drop the host copy kept for delta installs (frees the model's size in host memory); the next
        ``delta=True`` install sends everything again (the workers' own copies are dropped too)."""
        self._delta.forget()
        self.path.forget_base()

    def reopen_serving(self) -> None:
        """Let generation calls in again after an install that failed while writing (they raise
        :class:`PartialUpdateError` until a full install succeeds). The engine may serve a mix of old and new
        weights: use it only if that is acceptable, e.g. to inspect the engine."""
        if self.gate is not None:
            self.gate.reopen()


@contextmanager
def _held(lock: threading.Lock, timeout: float | None) -> Iterator[None]:
    """``lock`` (an adapter's own), waited for at most ``timeout`` s."""
    if not lock.acquire(timeout=-1 if timeout is None else timeout):
        raise HotWeightsTimeoutError(
            f"waited {timeout} s for another install on this engine to finish; retry later or raise lock_timeout"
        )
    try:
        yield
    finally:
        lock.release()
