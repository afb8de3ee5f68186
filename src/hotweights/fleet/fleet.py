"""``hotweights.Fleet(engines)``: N rollout replicas switch to a version together, or not at all.

One install per replica, each in its own thread, through the adapter :func:`hotweights.adapter_for` picks for it
(or the one given for it: ``Fleet(engines, adapters=...)``), inside one :class:`~hotweights.core.two_phase.Coordinator`:

1. **stage**: every replica validates the update, receives it (replicas that share a transport get each bucket
   written once: one ``/dev/shm`` file for the replicas on this host, one object-store copy for Ray actors) and
   prepares it; nothing is written. Any failure aborts every replica: all keep their previous version.
2. **commit** (the point of no return): every replica pauses as its ``pause`` mode says, writes, resets its prefix
   cache and records the version. A replica that fails here is *fenced*: its generation raises
   :class:`~hotweights.PartialUpdateError` until a later install heals it, and
   :class:`~hotweights.core.errors.FleetPartialCommitError` names it while the others serve the new version.

The workers drop what they staged if no commit comes within ``staging_expiry`` seconds (a trainer that died
between the phases).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hotweights._family import check_family
from hotweights._install import InstallOptions, adapter_for, update_for
from hotweights.adapters.contract import WeightInstallAdapter
from hotweights.core import two_phase
from hotweights.core.buckets import default_bucket_bytes
from hotweights.core.errors import (
    EngineNotSupportedError,
    FleetAbortedError,
    FleetPartialCommitError,
    HotWeightsError,
)
from hotweights.core.manifest import TensorsLike
from hotweights.core.report import InstallReport
from hotweights.fleet.outcome import Fenced, FleetReport
from hotweights.handles import EngineHandle, as_engine
from hotweights.handles.handle import PauseMode
from hotweights.telemetry import logger
from hotweights.vllm.worker.session import MAX_EXPIRY_S

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Fleet", "StagedUpdate"]

#: Seconds a fleet waits, after an abort, for its replicas' installs to stop.
_ABORT_GRACE = 60.0


class Fleet:
    """Several engines serving one model, installed into together (see the module docstring).

    Args:
        engines: ``vllm.LLM`` (with or without the worker extension), ``AsyncLLM``, ``hotweights.connect(url)``
            handles, Ray-hosted engines (:func:`hotweights.integrations.ray.engine`), in any mix.
        adapters: one per engine, in the same order: the adapter that replica installs through, built on that
            engine (its own transport or bucket size, as :func:`hotweights.install`'s ``adapter=``), or None for
            the one :func:`hotweights.adapter_for` picks. Default: :func:`hotweights.adapter_for` for every one.
        timeout: seconds for the whole stage phase (every replica); past it every replica aborts.
        staging_expiry: seconds the replicas' workers keep a staged update without a commit (at most 3600).

    Example:
        >>> fleet = hotweights.Fleet([llm_a, llm_b, hotweights.connect(url)])         # doctest: +SKIP
        >>> report = fleet.install(model.state_dict(), weight_version=step)          # doctest: +SKIP
    """

    def __init__(
        self,
        engines: Iterable[Any],
        *,
        adapters: Sequence[WeightInstallAdapter | None] | None = None,
        timeout: float | None = 600.0,
        staging_expiry: float = 600.0,
    ) -> None:
        self.engines: list[EngineHandle] = [as_engine(e) for e in engines]
        if not self.engines:
            raise ValueError("a Fleet needs at least one engine")
        if len({id(h) for h in self.engines}) != len(self.engines):
            raise ValueError("the same engine appears twice in the fleet; list each replica once")
        self._given = _given_adapters(self.engines, adapters)
        if not 0 < staging_expiry <= MAX_EXPIRY_S:
            raise ValueError(f"staging_expiry must be in (0, {MAX_EXPIRY_S:g}] seconds, got {staging_expiry}")
        self.timeout = timeout
        self.staging_expiry = staging_expiry
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.engines)

    def adapters(self) -> list[WeightInstallAdapter]:
        """The adapter of each replica (the one given for it, else :func:`hotweights.adapter_for`); refuses engines
        that cannot stage apart from their commit."""
        chosen = [a if a is not None else adapter_for(e) for e, a in zip(self.engines, self._given, strict=True)]
        for i, a in enumerate(chosen):
            if a.stages_apart:
                continue
            raise EngineNotSupportedError(
                f"replica {i} ({self.engines[i].describe()}) installs through {a.label}, which cannot stage an "
                "update apart from writing it; a fleet needs atomic installs (the default adapters)"
            )
        return chosen

    # ------------------------------------------------------------------ the verbs
    def install(self, tensors: TensorsLike, *, weight_version: int, **options: Unpack[InstallOptions]) -> FleetReport:
        """Install ``tensors`` into every replica, as :func:`hotweights.install` does into one, in two phases.

        Raises:
            the error :func:`hotweights.install` raises for the first replica that failed while staging (every
            replica aborted and serves its previous version; :class:`FleetAbortedError` is never the one raised);
            FleetPartialCommitError: some replicas failed to commit and are fenced, the others serve
                ``weight_version`` (``exc.report``).
        """
        return self.stage(tensors, weight_version=weight_version, **options).commit()

    async def install_async(
        self, tensors: TensorsLike, *, weight_version: int, **options: Unpack[InstallOptions]
    ) -> FleetReport:
        """:meth:`install` for async code, and the way to reach ``AsyncLLM`` replicas (await it on their loop)."""
        self._bind(asyncio.get_running_loop(), options)
        staged = await asyncio.to_thread(self._stage, tensors, weight_version, options)
        return await asyncio.to_thread(staged.commit)

    def stage(self, tensors: TensorsLike, *, weight_version: int, **options: Unpack[InstallOptions]) -> StagedUpdate:
        """Phase one alone: every replica validated, received and prepared the update; none wrote. Call
        :meth:`StagedUpdate.commit` (or :meth:`~StagedUpdate.abort`) next, within ``staging_expiry``."""
        for e in self.engines:
            if e.kind == "async_llm":
                raise EngineNotSupportedError(
                    f"{e.describe()} is an AsyncLLM: install into this fleet from async code, "
                    "`await fleet.install_async(tensors, weight_version=step)`"
                )
        return self._stage(tensors, weight_version, options)

    # ------------------------------------------------------------------ internals
    def _bind(self, loop: asyncio.AbstractEventLoop, options: InstallOptions) -> None:
        from hotweights.handles.async_llm import AsyncLLMHandle

        for e in self.engines:
            if isinstance(e, AsyncLLMHandle):
                e.bind(loop, options.get("pause", "wait"))

    def _stage(self, tensors: TensorsLike, weight_version: int, options: InstallOptions) -> StagedUpdate:
        if options.get("adapter") is not None:
            raise ValueError(
                "adapter= names one engine's adapter; give a fleet one per replica: Fleet(engines, adapters=[...])"
            )
        if not self._lock.acquire(blocking=False):
            raise HotWeightsError("this fleet has an install staged or running; commit or abort it first")
        try:
            return self._start(tensors, weight_version, options)
        except BaseException:
            self._lock.release()
            raise

    def _start(self, tensors: TensorsLike, weight_version: int, options: InstallOptions) -> StagedUpdate:
        adapters = self.adapters()
        pause = options.get("pause", "wait")
        for e in self.engines:
            e.check_pause_mode(pause)
        items, manifest = update_for(
            adapters[0],
            tensors,
            weight_version,
            update_id=options.get("update_id"),
            layout=options.get("layout"),
            metadata=options.get("metadata"),
            digests=bool(options.get("digests", False)),
        )
        coordinator = two_phase.Coordinator(len(adapters), self.staging_expiry)
        delta = bool(options.get("delta", False))
        if not delta:  # a delta differs per replica's base: each is sent its own
            _group(coordinator, adapters)
        bucket_bytes = min((a.bucket_size for a in adapters if a.bucket_size), default=default_bucket_bytes(32 << 20))
        kwargs = {k: options[k] for k in ("force", "delta", "verify", "cast", "allow_nonfinite") if k in options}
        families = [check_family(e, items, options.get("unproven")) for e in self.engines]  # before any staging
        run = _Run(self, adapters, coordinator, manifest.weight_version, manifest.tensors)
        for i, adapter in enumerate(adapters):
            member = two_phase.Member(coordinator, i, bucket_bytes, self.staging_expiry)
            thread = threading.Thread(
                target=run.member,
                args=(member, self.engines[i], pause, adapter, manifest, items, {**kwargs, "family": families[i]}),
                name=f"hotweights-fleet-{i}",
                daemon=True,
            )
            run.threads.append(thread)
            thread.start()
        try:
            coordinator.wait_staged(self.timeout)
        except BaseException:
            run.finish(release=False)  # _stage releases the fleet
            raise
        run.stage_seconds = time.perf_counter() - run.start
        if coordinator.decision == "abort":
            run.finish(release=False)
            raise run.staging_error()
        return StagedUpdate(run)


def _given_adapters(
    engines: list[EngineHandle], adapters: Sequence[WeightInstallAdapter | None] | None
) -> list[WeightInstallAdapter | None]:
    """``adapters`` checked against ``engines``: one per engine, each built on its engine."""
    if adapters is None:
        return [None] * len(engines)
    given = list(adapters)
    if len(given) != len(engines):
        raise ValueError(
            f"a Fleet takes one adapter per engine (None: hotweights picks): {len(given)} adapters for "
            f"{len(engines)} engines"
        )
    for i, (engine, adapter) in enumerate(zip(engines, given, strict=True)):
        if adapter is not None and adapter.engine is not engine:
            raise ValueError(
                f"adapters[{i}] was built on another engine than engine {i} ({engine.describe()}): build it on that "
                "engine's handle"
            )
    return given


def _group(coordinator: two_phase.Coordinator, adapters: list[WeightInstallAdapter]) -> None:
    """Replicas whose transports can share one copy of each bucket (same kind, nothing kept per engine) share the
    first one's transport."""
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(adapters):
        if a.shared_transport is not None:
            groups.setdefault(a.shared_transport.share_key, []).append(i)
    for members in groups.values():
        if len(members) > 1:
            coordinator.add_group(adapters[members[0]].shared_transport, members)


class _Run:
    """One fleet install in flight: its threads, their outcomes, and the report."""

    def __init__(
        self,
        fleet: Fleet,
        adapters: list[WeightInstallAdapter],
        coordinator: two_phase.Coordinator,
        weight_version: int,
        tensors: Any,
    ) -> None:
        self.fleet, self.adapters, self.coordinator = fleet, adapters, coordinator
        self.weight_version = weight_version
        self.update_bytes = sum(spec.expected_nbytes for spec in tensors.values())
        self.threads: list[threading.Thread] = []
        self.outcomes: dict[int, InstallReport | BaseException] = {}
        self.start = time.perf_counter()
        self.stage_seconds = 0.0
        self.closed = False

    def member(
        self,
        member: two_phase.Member,
        engine: EngineHandle,
        pause: PauseMode,
        adapter: WeightInstallAdapter,
        manifest: Any,
        items: Any,
        kwargs: dict[str, Any],
    ) -> None:
        try:
            with engine.installing(pause, adapter.lock_timeout):  # one install at a time into each replica
                self.outcomes[member.index] = adapter.install(manifest, items, member=member, **kwargs)
        except BaseException as exc:
            self.outcomes[member.index] = exc
            self.coordinator.failed(member.index, exc)
        finally:
            self.coordinator.done(member.index)

    def finish(self, release: bool = True) -> None:
        """Wait for every replica's install to end (after an abort: until each stopped), release the fleet."""
        if self.closed:
            return
        self.closed = True
        self.coordinator.decide("abort", "the fleet was aborted")
        try:
            if not self.coordinator.wait_finished(_ABORT_GRACE if self.coordinator.decision == "abort" else None):
                logger.warning("hotweights: some fleet replicas had not stopped %g s after the abort", _ABORT_GRACE)
        finally:
            self.coordinator.close()
            if release:
                self.fleet._lock.release()

    def staging_error(self) -> BaseException:
        """The first replica's own failure (not the aborts it caused), noting what became of the others."""
        failures = self.coordinator.failures
        causes = {i: e for i, e in failures.items() if not isinstance(e, FleetAbortedError)}
        index, error = min(causes.items()) if causes else min(failures.items(), default=(0, None))
        if error is None:
            error = FleetAbortedError(
                f"the fleet install was aborted before any replica wrote: {self.coordinator.reason}"
            )
        note = (
            f"fleet: replica {index} ({self.fleet.engines[index].describe()}) failed while staging v"
            f"{self.weight_version}; all {len(self.adapters)} replicas were aborted before writing and keep serving "
            "their previous version"
        )
        if hasattr(error, "add_note"):
            error.add_note(note)
        return error

    def report(self) -> FleetReport:
        engines = tuple(e.describe() for e in self.fleet.engines)
        for i in sorted(self.coordinator.unstopped):
            logger.error(
                "hotweights: fleet replica %d (%s) installed without stopping at the commit point: it did not wait "
                "for the other replicas",
                i,
                engines[i],
            )
        reports: list[InstallReport | None] = []
        fenced: list[Fenced] = []
        sent = self.coordinator.bytes_written
        for i, a in enumerate(self.adapters):
            outcome = self.outcomes.get(i)
            if isinstance(outcome, InstallReport):
                reports.append(outcome)
                if self.coordinator.group_of(i) is None and a.sends_bytes:
                    sent += outcome.bytes_sent
            else:
                reports.append(None)
                why = f"{type(outcome).__name__}: {outcome}" if outcome is not None else "did not finish"
                fenced.append(Fenced(i, engines[i], why))
        total = time.perf_counter() - self.start
        return FleetReport(
            weight_version=self.weight_version,
            replicas=tuple(reports),
            engines=engines,
            fenced=tuple(fenced),
            update_bytes=self.update_bytes,
            bytes_written=sent,
            phases={"stage": self.stage_seconds, "commit": total - self.stage_seconds},
        )


class StagedUpdate:
    """An update every replica of a fleet staged and none wrote: :meth:`commit` it or :meth:`abort` it (also on
    leaving a ``with`` block without a commit)."""

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def weight_version(self) -> int:
        return self._run.weight_version

    def commit(self) -> FleetReport:
        """The point of no return: every replica writes. Raises :class:`FleetPartialCommitError` when some failed
        (fenced); the others then serve the new version."""
        run = self._run
        if run.closed:
            raise HotWeightsError("this staged update was already committed or aborted")
        if not run.coordinator.decide("commit", "committed"):
            run.finish()
            raise run.staging_error()
        run.coordinator.wait_finished(None)
        run.finish()
        report = run.report()
        if report.fenced:
            raise FleetPartialCommitError(
                f"v{report.weight_version} was committed on {len(report.replicas) - len(report.fenced)} of "
                f"{len(report.replicas)} replicas; fenced (generation refused until an install heals them): "
                + "; ".join(f"#{f.index} {f.engine}: {f.error}" for f in report.fenced)
                + ". Install again (the fenced replicas accept this same weight_version), or route no rollouts to "
                "them.",
                report,
            )
        return report

    def abort(self) -> None:
        """Drop the update on every replica; all keep serving their previous version."""
        self._run.finish()

    def __enter__(self) -> StagedUpdate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._run.closed:
            self.abort()
