"""The installer: one install session through a wire and a transport, with options checked once.

:class:`Installer` ``(engine, wire, transport, options)`` runs every install path that has the install session in
the engine (:mod:`hotweights.vllm.worker.session`): ``begin`` -> every bucket through the transport -> ``prepare`` on
every worker -> ``commit``, or ``abort``. The named adapters (:class:`~hotweights.adapters.VLLMMultiprocessAdapter`,
...) are configurations of it: a wire (:mod:`hotweights.adapters.wires`: how the session's calls reach the workers),
a transport (:mod:`hotweights.transports`: how the bytes travel; ``reference`` for an engine in this process) and
:class:`~hotweights.adapters.options.InstallerOptions`, validated once when the installer is built.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hotweights.adapters._vllm import EngineOptions, VLLMEngineAdapter
from hotweights.adapters.contract import InstallCall, Items
from hotweights.adapters.options import CommitMode, InstallerOptions, InstallMethod, PathAbilities
from hotweights.adapters.wires import Wire
from hotweights.core import envelope, two_phase
from hotweights.core.buckets import Bucket, default_bucket_bytes, plan_buckets
from hotweights.core.cast import BucketSource, item_names, lazy_mapping
from hotweights.core.delta import DeltaBase, EncodedDelta, StagedDelta
from hotweights.core.errors import DeltaBaseMismatchError, EngineNotSupportedError, InstallError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.pipeline import send_pipelined
from hotweights.telemetry import best_effort, bucket_progress
from hotweights.transports import Descriptor, WeightTransport, make_transport
from hotweights.transports.shm_base import SharedDeltaBase
from hotweights.vllm.worker.session import SessionOptions, refusal

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ASIDE_BUCKET_BYTES",
    "GATHERED_BUCKET_BYTES",
    "Installer",
    "SessionAdapterOptions",
    "bucket_default",
    "split_options",
]

#: Most bytes of a default bucket with ``install_method="aside"``: a multiprocess worker builds each bucket inside
#: its ``stage`` call, which holds the engine's step loop (and every running request) for that long.
ASIDE_BUCKET_BYTES = 32 << 20
#: Most bytes of a default bucket that the leader of a sharded state dict gathers (rank writes off or not possible):
#: it holds about two such buckets at once, on the trainer's device.
GATHERED_BUCKET_BYTES = 32 << 20


def bucket_default(preferred: int, method: str, *, gathered: bool = False) -> int:
    """Bytes per bucket when none was given: the transport's ``preferred`` size, at most :data:`ASIDE_BUCKET_BYTES`
    for ``install_method="aside"`` and :data:`GATHERED_BUCKET_BYTES` for the buckets the leader of a sharded state
    dict gathers, capped by free memory (:func:`~hotweights.core.buckets.default_bucket_bytes`)."""
    if method == "aside":
        preferred = min(preferred, ASIDE_BUCKET_BYTES)
    if gathered:
        preferred = min(preferred, GATHERED_BUCKET_BYTES)
    return default_bucket_bytes(preferred)


class SessionAdapterOptions(EngineOptions, total=False):
    """What the named adapters that run the install session take besides their transport: the fields of
    :class:`InstallerOptions` and of :class:`~hotweights.adapters._vllm.EngineOptions`."""

    bucket_bytes: int | None
    install_method: InstallMethod
    commit: CommitMode
    rpc_timeout: float | None
    verify: bool
    buckets_in_flight: int | None


def split_options(options: SessionAdapterOptions) -> tuple[InstallerOptions, EngineOptions]:
    """A named adapter's keyword arguments: the installer's options, and what every engine adapter takes."""
    fields = InstallerOptions.__dataclass_fields__
    chosen = InstallerOptions(**{k: v for k, v in options.items() if k in fields})  # type: ignore[arg-type]
    common: EngineOptions = {k: v for k, v in options.items() if k not in fields}  # type: ignore[assignment]
    return chosen, common


class Installer(VLLMEngineAdapter):
    """One install session through ``wire`` and ``transport``, with ``options`` checked once, here.

    Args:
        engine: the engine, or its handle (made once per engine, shared by every installer on it).
        wire: how the session's calls reach the engine's workers (:class:`~hotweights.adapters.wires.Wire`).
        transport: how the tensors travel: a :class:`~hotweights.transports.WeightTransport` or a registered name.
        options: method, commit, verify default, bucket size, RPC timeout (:class:`InstallerOptions`).
        expected, prefix_cache, lock_timeout, guard_generation: see
            :class:`~hotweights.adapters._vllm.VLLMEngineAdapter`.

    It is also the :class:`~hotweights.transports.EngineLink` its transport connects through.
    """

    name = "installer"

    def __init__(
        self,
        engine: Any,
        wire: Wire,
        transport: str | WeightTransport,
        options: InstallerOptions | None = None,
        **common: Unpack[EngineOptions],
    ) -> None:
        self.options = options or InstallerOptions()
        self.wire = wire
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        self.options.validate(self.abilities, keeps_segments=self.transport.keeps_segments)
        super().__init__(engine, **common)
        self.transport.connect(self)

    @property
    def abilities(self) -> PathAbilities:
        return PathAbilities(
            self.label, reads_back=self.wire.reads_back, deltas=True, releases_segments=self.wire.releases_segments
        )

    @property
    def install_method(self) -> InstallMethod:
        return self.options.install_method

    @property
    def commit(self) -> CommitMode:
        return self.options.commit

    @property
    def bucket_bytes(self) -> int | None:
        return self.options.bucket_bytes

    @property
    def rpc_timeout(self) -> float | None:
        """Seconds each call into the workers may take before :class:`~hotweights.HotWeightsTimeoutError`."""
        return self.wire.timeout

    @property
    def label(self) -> str:
        method = "" if self.install_method in ("auto", "reload") else f"-{self.install_method}"
        commit = "" if self.commit == "atomic" else f"-{self.commit}"
        via = "" if self.transport.by_reference else f"-{self.transport.name}"
        return f"{self.name}{via}{method}{commit}"

    @property
    def bucket_size(self) -> int | None:
        """Bytes per bucket: ``bucket_bytes``, or the transport's preferred size capped by free memory; None where
        the transport hands the whole update over by reference (one bucket, nothing packed)."""
        if self.transport.by_reference:
            return None
        return self.bucket_bytes or bucket_default(self.transport.preferred_bucket_bytes, self.install_method)

    @property
    def sends_bytes(self) -> bool:
        return not self.transport.by_reference

    @property
    def stages_apart(self) -> bool:
        return self.commit == "atomic"

    @property
    def shared_transport(self) -> WeightTransport | None:
        return self.transport if self.transport.shareable else None

    # ------------------------------------------------------------------ EngineLink (for the transport)
    @property
    def num_workers(self) -> int:
        return self.engine.num_workers

    @property
    def releases_buckets_after_stage(self) -> bool:
        """The workers keep no view of a bucket once its ``stage`` returned (a streaming direct install copies out
        the few parts that wait for the next bucket), so a transport may reuse one buffer."""
        return self.commit == "streaming" and self.install_method == "direct"

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        return self.wire.engine_op(op, **args)

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` when the engine stops (where its kind has a hook: see ``EngineHandle.on_shutdown``)."""
        self.engine.on_shutdown(callback)

    # ------------------------------------------------------------------ the session
    def _session_options(self, timer: InstallCall, **more: Any) -> SessionOptions:
        return SessionOptions(
            method=self.install_method,
            commit=self.commit,
            verify=timer.verify,
            expires_s=_expiry(timer),
            kv_reclaimable=self._kv_reclaimable,
            allow_nonfinite=timer.allow_nonfinite,
            **more,
        )

    @property
    def _kv_reclaimable(self) -> bool:
        """Whether a reload may borrow the engine's KV cache (vLLM 0.34's extensible one): nothing runs on it
        during the install (pause wait or abort) and the caches are reset after."""
        return self.engine.extensible_kv_cache and self.engine.pause_mode != "keep"

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, Any]:
        keep = self._delta.tracking and self._keeps_base_on_workers and not self._shares_base
        sent = self._sent_manifest(manifest, item_names(items))
        return self._session(sent, self._session_options(timer, keep_base=keep), lazy_mapping(items), timer)

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, Any]:
        dm = delta.manifest
        wire = dm.wire_manifest(delta.wire if manifest.has_digests else None)
        shared = self._shared_base() if self._shares_base else None
        options = self._session_options(  # a delta is atomic and never read back (check_call refused the others)
            timer,
            delta=dm.to_json(),
            keep_base=self._keeps_base_on_workers and shared is None,
            shared_base=shared.descriptor() if shared is not None else None,
        )
        try:
            return self._session(wire, options, delta.wire, timer)
        except DeltaBaseMismatchError:  # the workers' own, typed: the versions that met are in it
            self._delta.base = None  # the next install sends everything
            raise

    @property
    def _keeps_base_on_workers(self) -> bool:
        """Whether the workers keep their own copy for deltas (in-process, the trainer's copy is lent instead)."""
        return not self.transport.by_reference

    @property
    def _shares_base(self) -> bool:
        """Whether the workers map the trainer's copy from this host's shared memory instead of keeping their own
        (one copy per host: :mod:`hotweights.transports.shm_base`)."""
        return not self.transport.by_reference and self.engine.same_host

    def _capture_base(self, items: Items, version: int) -> DeltaBase:
        if self._shares_base:
            return SharedDeltaBase.capture(items, version)
        return super()._capture_base(items, version)

    def _shared_base(self) -> SharedDeltaBase:
        """The trainer's copy, moved into shared memory if it was taken elsewhere (e.g. by another adapter)."""
        base = self._delta.base
        assert base is not None
        if not isinstance(base, SharedDeltaBase):
            base = self._delta.base = SharedDeltaBase(base.version, base.tensors)
        return base

    def _session(
        self, sent: WeightUpdateManifest | None, options: SessionOptions, tensors: Any, timer: InstallCall
    ) -> dict[str, Any]:
        """Run one session: begin, every bucket through the transport, prepare, commit; abort on any failure.
        ``sent`` describes what crosses (None: a delta that changes nothing)."""
        streaming = options.commit == "streaming" and options.delta is None
        member = timer.member  # inside a fleet: stop between staged and written (see core.two_phase)
        size = member.bucket_bytes if member and self.bucket_size else self.bucket_size
        tensors = BucketSource.of(tensors)
        split = tensors.split  # a sharded state dict: tensors over a bucket travel in parts
        ranks = self._rank_writes(tensors, options, member)
        if split is not None and ranks is None and size and not self.bucket_bytes:
            size = min(size, bucket_default(self.transport.preferred_bucket_bytes, self.install_method, gathered=True))
        limit = size or (
            default_bucket_bytes(self.transport.preferred_bucket_bytes) if ranks is not None else sys.maxsize
        )
        tensors.parts_at_most(limit)  # a sharded state dict: views of a tensor over a bucket are read from parts of it
        if ranks is not None and sent is not None:  # every rank writes its own rows
            plan = ranks.plan(sent, limit)
        elif sent is not None:
            plan = plan_buckets(sent, limit, whole_layers=streaming, split=split)
        else:
            plan = []
        update_id = sent.update_id if sent is not None else _delta_id(options)
        lent = self._delta.base if options.delta is not None and self.transport.by_reference else None
        try:
            one = self.wire.one_call and len(plan) == 1 and member is None and not streaming
            if one and sent is not None and self.install_method != "aside":  # aside: built before the gate is held
                summaries = self._one_call(options, sent, tensors, plan, timer)
            else:
                with timer("begin"):  # the workers check the manifest and plan the method: refused before any byte
                    self.wire.begin(options, sent, lent)  # a refusal (a delta's base the workers lack too): typed
                if sent is not None:
                    self._send(sent, tensors, plan, timer, streaming, ranks)
                with timer("prepare"):  # every worker (of every replica) ready first, nothing written
                    found = [p for worker in self.wire.prepare(update_id) for p in worker]
                if found:
                    raise refusal(found)
                two_phase.commit_point(member)
                self._begin_writing(timer)
                with timer("install"):
                    summaries = self.wire.commit(update_id)
        except BaseException:
            with best_effort("abort the workers' install session"):
                self.wire.abort(update_id)
            raise
        readback = max((float(s.get("readback_seconds", 0.0)) for s in summaries if isinstance(s, dict)), default=0)
        if readback:  # the workers' read-back, inside the install call: its own phase in the report
            timer.phases["install"] = max(0.0, timer.phases.get("install", 0.0) - readback)
            timer.add("verify", readback)
        return self._summary(summaries, sent, timer)

    def _send(
        self,
        sent: WeightUpdateManifest,
        tensors: BucketSource,
        plan: list[Bucket],
        timer: InstallCall,
        streaming: bool,
        ranks: Any = None,
    ) -> None:
        """Every bucket of ``plan`` through the transport, each staged by every worker; with ``ranks``, the buckets
        of other ranks' rows written by those ranks (:mod:`hotweights.core.rank_writes`)."""

        def deliver(bucket: Bucket) -> Callable[[Descriptor], None]:
            def stage(descriptor: Descriptor) -> None:
                if streaming:
                    self._begin_writing(timer)  # this bucket goes into the live model
                self.wire.stage(sent.update_id, bucket.model_dump_json(), descriptor)

            return stage

        with timer("transfer"), bucket_progress(plan, f"{self.label} v{sent.weight_version}") as buckets:
            writable = self.transport.rank_writable()
            if ranks is not None and writable is not None:
                ranks.transfer(
                    list(buckets),
                    lambda b: self.transport.send(b, tensors, deliver(b)),
                    writable,
                    lambda b, descriptor: deliver(b)(descriptor),
                )
                return

            def send(bucket: Bucket, stage: Callable[[Descriptor], None]) -> None:
                two_phase.share(timer.member, self.transport, bucket, tensors, stage)

            def stage(bucket: Bucket, descriptor: Descriptor) -> None:
                deliver(bucket)(descriptor)

            send_pipelined(plan, send, stage, self._in_flight(tensors), done=buckets)

    def _in_flight(self, tensors: BucketSource) -> int:
        """Buckets packed while earlier ones are staged: the installer's ``buckets_in_flight``, else the
        transport's; one where the transport cannot overlap its sends or where reading the tensors is a collective
        (a sharded state dict's gathers run in order on every rank)."""
        depth = self.options.buckets_in_flight or self.transport.buckets_in_flight
        if not self.transport.overlaps or tensors.reads_in_order:
            return 1
        return depth

    def _rank_writes(self, tensors: BucketSource, options: SessionOptions, member: Any) -> Any:
        """The leader's side of rank-parallel writes, where they apply: a sharded state dict whose ranks share this
        host, a transport whose bucket files the ranks can write into (:meth:`WeightTransport.rank_writable`: shm
        writing a file per bucket), one engine (not a fleet), an atomic full install; ``HOTWEIGHTS_RANK_WRITES=0``
        turns them off (the leader gathers every tensor)."""
        if os.environ.get("HOTWEIGHTS_RANK_WRITES", "1").strip() == "0":
            return None
        writable = self.transport.rank_writable() is not None
        if not writable or member is not None or options.commit != "atomic" or options.delta:
            return None
        return tensors.rank_writes()

    def _one_call(
        self,
        options: SessionOptions,
        sent: WeightUpdateManifest,
        tensors: Any,
        plan: list[Bucket],
        timer: InstallCall,
    ) -> list[dict[str, Any]]:
        """The whole session in one call: a one-bucket update into one worker (once the trainer wrote the bucket).
        The ``transfer`` phase is the trainer's write."""
        summaries: list[dict[str, Any]] = []

        def run(call_payload: Any) -> None:
            self._begin_writing(timer)  # the gate is held before the worker may write
            with timer("install"):
                try:
                    summaries[:] = self.wire.install(options, sent, call_payload)
                except EngineNotSupportedError:
                    self._untouched(timer)  # refused by the engine handle before the call left this process
                    raise
            refused = [s["refused"] for s in summaries if isinstance(s, dict) and "refused" in s]
            if refused:  # raised here, so a transport waiting on the worker stops at once
                self._untouched(timer)  # the worker refused it before installing: nothing to recover
                typed = envelope.decode(refused[0])  # e.g. a forced direct install into a model it cannot prove
                raise typed or InstallError(
                    f"the engine's worker refused update {sent.update_id} before installing it, "
                    f"with an answer this hotweights cannot read ({str(refused[0])[:300]}). Nothing was written; "
                    "run the same hotweights on the trainer and the engine."
                )

        assert len(plan) == 1
        start = time.perf_counter()

        def deliver(descriptor: Descriptor) -> None:
            timer.add("transfer", time.perf_counter() - start)
            run((plan[0].model_dump_json(), descriptor))

        self.transport.send(plan[0], tensors, deliver)
        return summaries

    def _summary(
        self, summaries: list[dict[str, Any]], sent: WeightUpdateManifest | None, timer: InstallCall
    ) -> dict[str, Any]:
        """The workers' summaries as one (they serve one model, so they agree on the method). A wire whose calls
        return nothing: the digests the workers checked by having accepted every bucket (a mismatch raises)."""
        if not self.wire.summarises:
            return {"digests_verified": sum(s.digest is not None for s in sent.tensors.values()) if sent else 0}
        if summaries and all(s for s in summaries):
            methods = sorted({str(s.get("install_method", self.install_method)) for s in summaries})
            reasons = sorted({str(s.get("install_reason", "")) for s in summaries})
            self._ran(timer, methods[0] if len(methods) == 1 else "mixed", " | ".join(reasons))
        if not summaries:
            return {}
        return {
            "digests_verified": min(int(s.get("digests_verified", 0)) for s in summaries),
            "readback_verified": min(int(s.get("readback_verified", 0)) for s in summaries),
            "readback_unreadable": max(int(s.get("readback_unreadable", 0)) for s in summaries),
            **next(({"readback_note": s["readback_note"]} for s in summaries if s.get("readback_note")), {}),
        }

    @staticmethod
    def _sent_manifest(manifest: WeightUpdateManifest, tensors: Iterable[str]) -> WeightUpdateManifest:
        """The manifest of what is actually sent (tensors the engine ignores are left out)."""
        if len(manifest.tensors) == len(names := list(tensors)):
            return manifest
        return manifest.model_copy(update={"tensors": {n: manifest.tensors[n] for n in names}})

    def forget_delta_base(self) -> None:
        super().forget_delta_base()
        if self._keeps_base_on_workers:
            with best_effort("stop the workers' delta copies"):
                self.wire.engine_op("forget_base")

    def close(self) -> None:
        self.transport.close()


def _expiry(call: InstallCall) -> float | None:
    """Seconds the workers keep a staged update without a commit: the fleet's staging expiry (None: until the
    next install opens a session)."""
    return call.member.expires_s if call.member is not None else None


def _delta_id(options: SessionOptions) -> str:
    return str(json.loads(options.delta or "{}").get("update_id", ""))
