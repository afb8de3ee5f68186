"""One install session, run (:func:`run`): ``begin`` -> every bucket through the transport (:func:`send_buckets`)
-> ``prepare`` on every worker -> the commit point -> ``commit``, or ``abort`` on any failure; a one-bucket update
into one worker in one call (:func:`one_call`). The functions take the installer whose wire, transport and options
they use (:class:`~hotweights.adapters.Installer`, or any object with those)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from hotweights.adapters.call import InstallCall
from hotweights.core import envelope, two_phase
from hotweights.core.buckets import Bucket, default_bucket_bytes, plan_buckets
from hotweights.core.cast import BucketSource
from hotweights.core.errors import EngineNotSupportedError, InstallError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.pipeline import send_pipelined
from hotweights.telemetry import best_effort, bucket_progress
from hotweights.transports import Descriptor
from hotweights.vllm.worker.session import SessionOptions, refusal

__all__ = [
    "ASIDE_BUCKET_BYTES",
    "GATHERED_BUCKET_BYTES",
    "bucket_default",
    "in_flight",
    "one_call",
    "rank_writes",
    "run",
    "send_buckets",
    "session_options",
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


def session_options(installer: Any, timer: InstallCall, **more: Any) -> SessionOptions:
    """The session's options for this install: the installer's method and commit mode, this call's read-back,
    expiry (a fleet member's) and NaN policy, and whether a reload may borrow the engine's KV cache (vLLM 0.34's
    extensible one: nothing runs on it during the install, pause wait or abort, and the caches are reset after)."""
    engine = installer.engine
    return SessionOptions(
        method=installer.options.install_method,
        commit=installer.options.commit,
        verify=timer.verify,
        expires_s=timer.member.expires_s if timer.member is not None else None,
        kv_reclaimable=engine.facts.extensible_kv_cache and engine.pause_mode != "keep",
        allow_nonfinite=timer.allow_nonfinite,
        **more,
    )


def run(
    installer: Any, sent: WeightUpdateManifest | None, options: SessionOptions, tensors: Any, timer: InstallCall
) -> dict[str, Any]:
    """Run one session: begin, every bucket through the transport, prepare, commit; abort on any failure.
    ``sent`` describes what crosses (None: a delta that changes nothing)."""
    wire, transport, chosen = installer.wire, installer.transport, installer.options
    streaming = options.commit == "streaming" and options.delta is None
    member = timer.member  # inside a fleet: stop between staged and written (see core.two_phase)
    size = member.bucket_bytes if member and installer.bucket_size else installer.bucket_size
    tensors = BucketSource.of(tensors)
    split = tensors.split  # a sharded state dict: tensors over a bucket travel in parts
    ranks = rank_writes(installer, tensors, options, member)
    if split is not None and ranks is None and size and not chosen.bucket_bytes:
        size = min(size, bucket_default(transport.preferred_bucket_bytes, chosen.install_method, gathered=True))
    limit = size or (default_bucket_bytes(transport.preferred_bucket_bytes) if ranks is not None else sys.maxsize)
    tensors.parts_at_most(limit)  # a sharded state dict: views of a tensor over a bucket are read from parts of it
    if ranks is not None and sent is not None:  # every rank writes its own rows
        plan = ranks.plan(sent, limit)
    elif sent is not None:
        plan = plan_buckets(sent, limit, whole_layers=streaming, split=split)
    else:
        plan = []
    update_id = sent.update_id if sent is not None else _delta_id(options)
    lent = installer._delta.base if options.delta is not None and transport.by_reference else None
    try:
        one = wire.one_call and len(plan) == 1 and member is None and not streaming
        if one and sent is not None and chosen.install_method != "aside":  # aside: built before the gate is held
            summaries = one_call(installer, options, sent, tensors, plan, timer)
        else:
            with timer("begin"):  # the workers check the manifest and plan the method: refused before any byte
                wire.begin(options, sent, lent)  # a refusal (a delta's base the workers lack too): typed
            if sent is not None:
                send_buckets(installer, sent, tensors, plan, timer, streaming, ranks)
            with timer("prepare"):  # every worker (of every replica) ready first, nothing written
                found = [p for worker in wire.prepare(update_id) for p in worker]
            if found:
                raise refusal(found)
            two_phase.commit_point(member)
            installer._begin_writing(timer)
            with timer("install"):
                summaries = wire.commit(update_id)
    except BaseException:
        with best_effort("abort the workers' install session"):
            wire.abort(update_id)
        raise
    readback = max((float(s.get("readback_seconds", 0.0)) for s in summaries if isinstance(s, dict)), default=0)
    if readback:  # the workers' read-back, inside the install call: its own phase in the report
        timer.phases["install"] = max(0.0, timer.phases.get("install", 0.0) - readback)
        timer.add("verify", readback)
    return _summary(installer, summaries, sent, timer)


def send_buckets(
    installer: Any,
    sent: WeightUpdateManifest,
    tensors: BucketSource,
    plan: list[Bucket],
    timer: InstallCall,
    streaming: bool,
    ranks: Any = None,
) -> None:
    """Every bucket of ``plan`` through the installer's transport, each staged by every worker through its wire;
    with ``ranks``, the buckets of other ranks' rows written by those ranks (:mod:`hotweights.core.rank_writes`)."""
    transport = installer.transport

    def deliver(bucket: Bucket) -> Callable[[Descriptor], None]:
        def stage(descriptor: Descriptor) -> None:
            if streaming:
                installer._begin_writing(timer)  # this bucket goes into the live model
            installer.wire.stage(sent.update_id, bucket.model_dump_json(), descriptor)

        return stage

    with timer("transfer"), bucket_progress(plan, f"{installer.label} v{sent.weight_version}") as buckets:
        writable = transport.rank_writable()
        if ranks is not None and writable is not None:
            ranks.transfer(
                list(buckets),
                lambda b: transport.send(b, tensors, deliver(b)),
                writable,
                lambda b, descriptor: deliver(b)(descriptor),
            )
            return

        def send(bucket: Bucket, stage: Callable[[Descriptor], None]) -> None:
            two_phase.share(timer.member, transport, bucket, tensors, stage)

        def stage(bucket: Bucket, descriptor: Descriptor) -> None:
            deliver(bucket)(descriptor)

        send_pipelined(plan, send, stage, in_flight(installer, tensors), done=buckets)


def in_flight(installer: Any, tensors: BucketSource) -> int:
    """Buckets packed while earlier ones are staged: the installer's ``buckets_in_flight``, else the
    transport's; one where the transport cannot overlap its sends or where reading the tensors is a collective
    (a sharded state dict's gathers run in order on every rank)."""
    transport = installer.transport
    depth: int = installer.options.buckets_in_flight or transport.buckets_in_flight
    if not transport.overlaps or tensors.reads_in_order:
        return 1
    return depth


def rank_writes(installer: Any, tensors: BucketSource, options: SessionOptions, member: Any) -> Any:
    """The leader's side of rank-parallel writes, where they apply: a sharded state dict whose ranks share this
    host, a transport whose bucket files the ranks can write into (:meth:`WeightTransport.rank_writable`: shm
    writing a file per bucket), one engine (not a fleet), an atomic full install; ``HOTWEIGHTS_RANK_WRITES=0``
    turns them off (the leader gathers every tensor)."""
    if os.environ.get("HOTWEIGHTS_RANK_WRITES", "1").strip() == "0":
        return None
    writable = installer.transport.rank_writable() is not None
    if not writable or member is not None or options.commit != "atomic" or options.delta:
        return None
    return tensors.rank_writes()


def one_call(
    installer: Any,
    options: SessionOptions,
    sent: WeightUpdateManifest,
    tensors: Any,
    plan: list[Bucket],
    timer: InstallCall,
) -> list[dict[str, Any]]:
    """The whole session in one call: a one-bucket update into one worker (once the trainer wrote the bucket).
    The ``transfer`` phase is the trainer's write."""
    summaries: list[dict[str, Any]] = []

    def install(call_payload: Any) -> None:
        installer._begin_writing(timer)  # the gate is held before the worker may write
        with timer("install"):
            try:
                summaries[:] = installer.wire.install(options, sent, call_payload)
            except EngineNotSupportedError:
                timer.untouched()  # refused by the engine handle before the call left this process
                raise
        refused = [s["refused"] for s in summaries if isinstance(s, dict) and "refused" in s]
        if refused:  # raised here, so a transport waiting on the worker stops at once
            timer.untouched()  # the worker refused it before installing: nothing to recover
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
        install((plan[0].model_dump_json(), descriptor))

    installer.transport.send(plan[0], tensors, deliver)
    return summaries


def _summary(
    installer: Any, summaries: list[dict[str, Any]], sent: WeightUpdateManifest | None, timer: InstallCall
) -> dict[str, Any]:
    """The workers' summaries as one (they serve one model, so they agree on the method). A wire whose calls
    return nothing: the digests the workers checked by having accepted every bucket (a mismatch raises)."""
    if not installer.wire.summarises:
        return {"digests_verified": sum(s.digest is not None for s in sent.tensors.values()) if sent else 0}
    if summaries and all(s for s in summaries):
        methods = sorted({str(s.get("install_method", installer.options.install_method)) for s in summaries})
        reasons = sorted({str(s.get("install_reason", "")) for s in summaries})
        timer.ran(methods[0] if len(methods) == 1 else "mixed", " | ".join(reasons))
    if not summaries:
        return {}
    return {
        "digests_verified": min(int(s.get("digests_verified", 0)) for s in summaries),
        "readback_verified": min(int(s.get("readback_verified", 0)) for s in summaries),
        "readback_unreadable": max(int(s.get("readback_unreadable", 0)) for s in summaries),
        **next(({"readback_note": s["readback_note"]} for s in summaries if s.get("readback_note")), {}),
    }


def _delta_id(options: SessionOptions) -> str:
    """The update id of a delta session (its manifest travels inside the options)."""
    return str(json.loads(options.delta or "{}").get("update_id", ""))
