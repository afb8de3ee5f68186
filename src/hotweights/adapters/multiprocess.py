"""Install into a multiprocess vLLM engine (EngineCore and workers in other processes) through a transport."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, cast

import torch

from hotweights.adapters._vllm import VLLMTransportAdapter
from hotweights.adapters.base import Items, PrefixCachePolicy
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.cast import lazy_mapping
from hotweights.core.delta import EncodedDelta, StagedDelta
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    EngineNotSupportedError,
    InstallError,
    Mismatch,
    MismatchKind,
    WeightManifestValidationError,
    engine_refusal,
)
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine import compat
from hotweights.handles import as_engine
from hotweights.telemetry import best_effort
from hotweights.transports import Descriptor, WeightTransport

__all__ = ["VLLMMultiprocessAdapter"]


class VLLMMultiprocessAdapter(VLLMTransportAdapter):
    """Installs into an engine started with ``worker_extension_cls=hotweights.WORKER_EXTENSION``.

    The update is cut into buckets; each bucket goes through the transport and is staged by every worker with one
    RPC; a final RPC installs everything staged (by default with the direct setter where it is proven safe, else in
    one layerwise reload: see ``install_method``). Until then the model is untouched: any
    failure aborts the session and the previous weights keep serving (``commit="atomic"``, the default). The
    engine host then holds the whole update once, on top of the model.

    With ``commit="streaming"`` buckets are cut between layers and each one is installed as soon as the workers
    received it: the extra memory is one bucket (plus a layer whose parts span buckets), not the whole update.
    Generation waits from the first bucket to the end. Everything that can be checked before the first byte moves
    still is (names, shapes, dtypes; the direct setter's plan), but a failure *during* the transfer (a dead
    sender, a digest mismatch in a later bucket) leaves some layers new and some old: the install then raises
    :class:`InstallError`, the KV cache is zeroed, and a full install must follow before serving.

    Args:
        llm: the engine (a multiprocess ``vllm.LLM``, an ``AsyncLLM`` or an engine handle), started with the
            hotweights worker extension.
        transport: ``"shm"`` (default, same host), ``"bytes"``, or a :class:`WeightTransport` instance.
        bucket_bytes: bucket size (default: the transport's ``preferred_bucket_bytes``, capped at an eighth of
            available memory).
        install_method: how the workers install what they staged: ``"auto"`` (default: the direct setter where
            the workers' plan proves it safe at ``begin``, else vLLM's layerwise reload; see
            :func:`~hotweights.engine.direct.direct_refusals`), ``"direct"`` (the direct setter: planned, then copied
            into the parameters in place) or ``"reload"``. ``report.install_method``/``install_reason`` say which
            ran and why.
        commit: ``"atomic"`` (stage everything, then install: all or nothing) or ``"streaming"`` (install bucket
            by bucket: memory bounded by the bucket, a failed transfer leaves a partial update).
        expected, prefix_cache, lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).
        rpc_timeout: seconds each RPC may take before :class:`HotWeightsTimeoutError`.
        verify: default of ``install(..., verify=...)``: after the commit every worker reads its parameters back and
            compares them with the staged tensors (each fused slice through the direct setter's plan); a mismatch
            is an :class:`InstallError` and generation fails closed. Parameters that hold no data (linear weights
            packed by vLLM on CPU) cannot be read: ``report.readback_unreadable`` counts them. Needs
            ``commit="atomic"`` (a streaming install keeps no copy of what it wrote).

    Example:
        >>> llm = LLM(model=path, worker_extension_cls=hotweights.WORKER_EXTENSION)       # doctest: +SKIP
        >>> adapter = VLLMMultiprocessAdapter(llm, transport="shm")                      # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                # doctest: +SKIP
    """

    name = "multiprocess"
    verifies_readback = True

    def __init__(
        self,
        llm: Any,
        *,
        transport: str | WeightTransport = "shm",
        bucket_bytes: int | None = None,
        install_method: str = "auto",
        commit: str = "atomic",
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        rpc_timeout: float | None = 300.0,
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
        verify: bool = False,
    ) -> None:
        if install_method not in ("auto", "reload", "direct"):
            raise ValueError(f"install_method must be 'auto', 'reload' or 'direct', not {install_method!r}")
        engine = as_engine(llm)
        if engine.worker_extension != compat.WORKER_EXTENSION:
            raise EngineNotSupportedError(
                f"this engine ({engine.describe()}) was not started with hotweights' worker extension, which "
                "VLLMMultiprocessAdapter (and with it streaming commits, kept shm segments and the direct setter) "
                f"needs; start it with worker_extension_cls={compat.WORKER_EXTENSION!r}"
                + (
                    " (it runs in this process: VLLMInProcessWeightReloadAdapter needs no extension)"
                    if engine.inprocess
                    else ", or use hotweights.install(engine, ...), which reaches it without the extension"
                )
            )
        if commit not in ("atomic", "streaming"):
            raise ValueError(f"commit must be 'atomic' or 'streaming', not {commit!r}")
        if commit == "streaming" and install_method != "direct" and getattr(transport, "keep_segments", False):
            raise ValueError(
                "a shm transport with keep_segments=True keeps one segment per bucket when vLLM's layerwise reload "
                "may still read a bucket after its stage, which defeats commit='streaming' (memory bounded by the "
                "bucket), and install_method='auto' may fall back to that reload: use install_method='direct' (one "
                "segment for every bucket), or a plain shm transport"
            )
        if verify and commit == "streaming":
            raise ValueError("verify=True needs commit='atomic': a streaming install keeps no copy of what it wrote")
        self.verify = verify
        self.install_method = install_method
        self.commit = commit
        super().__init__(
            llm,
            transport=transport,
            bucket_bytes=bucket_bytes,
            rpc_timeout=rpc_timeout,
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            guard_generation=guard_generation,
        )

    @property
    def releases_buckets_after_stage(self) -> bool:
        """EngineLink: the workers keep no view of a bucket once its ``stage`` RPC returned (a streaming direct
        install copies out the few parts that wait for the next bucket), so a transport may reuse one buffer."""
        return self.commit == "streaming" and self.install_method == "direct"

    @property
    def label(self) -> str:
        method = "" if self.install_method in ("auto", "reload") else f"-{self.install_method}"
        commit = "" if self.commit == "atomic" else f"-{self.commit}"
        return f"{super().label}{method}{commit}"

    # Delta installs: the workers keep the host copy (:mod:`hotweights.engine.delta`); only the delta's wire tensors
    # (indices, values, changed whole tensors) cross, as buckets through the transport, staged like any update.
    def _delta_refusal(self) -> str | None:
        if self.commit != "atomic":
            return (
                "delta installs need commit='atomic': a streaming install writes while it receives, so the workers "
                "keep no copy of what they serve"
            )
        return None

    def forget_delta_base(self) -> None:
        super().forget_delta_base()
        with best_effort("stop the workers' delta copies"):
            self.call("hotweights_delta_track", False)

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: PhaseTimer
    ) -> dict[str, int]:
        dm = delta.manifest
        wire = dm.wire_manifest(delta.wire if manifest.has_digests else None)
        with timer("begin"):
            answers = self.call("hotweights_delta_begin", dm.to_json(), wire.to_json() if wire is not None else "")
        refused = [str(a.get("serving")) for a in answers if not a.get("ok")]
        if refused:
            self._delta_base = None  # the next install sends everything
            raise DeltaBaseMismatchError(dm.weight_version, dm.base_version, refused[0])

        def stage(bucket: Bucket, descriptor: Descriptor) -> None:
            self.call("hotweights_stage", dm.update_id, bucket.model_dump_json(), descriptor)

        try:
            if wire is not None:
                self._send_buckets(wire, delta.wire, timer, stage)
            with timer("delta_apply"):  # every worker checks the delta and rebuilds its tensors aside
                found = [p for worker in self.call("hotweights_delta_prepare", dm.update_id) for p in worker]
            if found:
                problems = [
                    Mismatch(cast(MismatchKind, p["kind"]), p["name"], p["expected"], p["actual"]) for p in found
                ]
                raise WeightManifestValidationError(problems, context="delta update (engine side)")
            self._begin_writing(timer)
            with timer("install"):
                summaries = self.call("hotweights_delta_commit", dm.update_id, self.install_method)
        except BaseException:
            with best_effort("abort the workers' delta session"):
                self.engine.call("hotweights_delta_abort", dm.update_id, timeout=30.0)
            raise
        methods = sorted({str(s.get("install_method")) for s in summaries})
        self._ran(
            methods[0] if len(methods) == 1 else "mixed",
            " | ".join(sorted({str(s.get("install_reason")) for s in summaries})),
        )
        return {"digests_verified": min(int(s.get("digests_verified", 0)) for s in summaries)}

    def _install_in_one_call(
        self, sent: WeightUpdateManifest, tensors: Mapping[str, torch.Tensor], bucket: Bucket, timer: PhaseTimer
    ) -> list[dict[str, Any]]:
        """An atomic update that fits in one bucket, into a local engine with one worker: the worker begins, stages
        and installs it in one RPC (``hotweights_install``) once the trainer has written it, saving two round trips
        (about 2 ms). The ``transfer`` phase is the trainer's write. (A server may run a hotweights without this
        call: it gets the three.)"""
        summaries: list[dict[str, Any]] = []
        start = time.perf_counter()

        def deliver(descriptor: Descriptor) -> None:
            timer.add("transfer", time.perf_counter() - start)
            self._begin_writing(timer)  # the gate is held before the worker may write
            with timer("install"):
                try:
                    summaries[:] = self.call(
                        "hotweights_install",
                        sent.to_json(),
                        bucket.model_dump_json(),
                        descriptor,
                        self.install_method,
                        self._verify_now,
                    )
                except EngineNotSupportedError:
                    self._untouched()  # refused by the engine handle before the call left this process
                    raise
            refused = [str(s["refused"]) for s in summaries if "refused" in s]
            if refused:  # raised here, so a transport waiting on the worker stops at once
                self._untouched()  # the worker refused it before installing: nothing to recover
                raise engine_refusal(refused[0]) or InstallError(
                    f"the engine's worker refused update {sent.update_id} (v{sent.weight_version}) before installing "
                    f"it: {refused[0]}. Nothing was written; fix the cause and install again."
                )

        self.transport.send(bucket, tensors, deliver)
        return summaries

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, Any]:
        if self._verify_now and self.commit == "streaming":
            raise ValueError("verify=True needs commit='atomic': a streaming install keeps no copy of what it wrote")
        tensors = lazy_mapping(items)
        sent = self._sent_manifest(manifest, tensors)
        streaming = self.commit == "streaming"

        def stage(bucket: Bucket, descriptor: Descriptor) -> None:
            if streaming:
                self._begin_writing(timer)  # this bucket goes into the live model
            self.call("hotweights_stage", sent.update_id, bucket.model_dump_json(), descriptor)

        if self._delta_tracking:  # delta installs were asked for: the workers keep a copy of what this installs
            self.call("hotweights_delta_track", True)
        plan = plan_buckets(sent, self.bucket_size, whole_layers=streaming)
        try:
            if len(plan) == 1 and not streaming and self.num_workers == 1 and self.engine.same_hotweights:
                summaries = self._install_in_one_call(sent, tensors, plan[0], timer)
            else:
                with timer("begin"):  # a streaming direct install is planned here: refused before anything moves
                    self.call("hotweights_begin", sent.to_json(), self.commit, self.install_method)
                self._send_buckets(sent, tensors, timer, stage, plan=plan)
                self._begin_writing(timer)
                with timer("install"):
                    summaries = self.call(
                        "hotweights_finish", sent.update_id, self.install_method, None, self._verify_now
                    )
        except BaseException:
            with best_effort("abort the workers' install session"):
                self.engine.call("hotweights_abort", sent.update_id, timeout=30.0)
            raise
        methods = sorted({str(s.get("install_method", self.install_method)) for s in summaries})
        reasons = sorted({str(s.get("install_reason", "")) for s in summaries})
        self._ran(methods[0] if len(methods) == 1 else "mixed", " | ".join(reasons))  # workers agree on one model
        return {
            "digests_verified": min(int(s.get("digests_verified", 0)) for s in summaries),
            "readback_verified": min(int(s.get("readback_verified", 0)) for s in summaries),
            "readback_unreadable": max(int(s.get("readback_unreadable", 0)) for s in summaries),
            **next(({"readback_note": s["readback_note"]} for s in summaries if s.get("readback_note")), {}),
        }
