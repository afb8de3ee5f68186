"""Install through vLLM's own weight-transfer API, with hotweights' ``"hotweights"`` backend on the engine side."""

from __future__ import annotations

from typing import Any

from hotweights.adapters._vllm import VLLMTransportAdapter
from hotweights.adapters.base import Items, PrefixCachePolicy
from hotweights.core.buckets import Bucket
from hotweights.core.cast import lazy_mapping
from hotweights.core.errors import EngineNotSupportedError, engine_refusal
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine.vllm_plugin import BACKEND
from hotweights.handles import as_engine
from hotweights.telemetry import best_effort
from hotweights.transports import Descriptor, WeightTransport

__all__ = ["VLLMWeightTransferAdapter"]


class VLLMWeightTransferAdapter(VLLMTransportAdapter):
    """Drives vLLM's ``init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update``.

    The engine is started with ``weight_transfer_config={"backend": "hotweights"}`` (registered by hotweights'
    vLLM plugin); buckets travel through any hotweights transport. With ``transport="collective"`` the trainer is
    rank 0 of a process group created through ``init_weight_transfer_engine`` — NCCL on GPU, gloo on CPU — and a
    new adapter (e.g. after a trainer restart) replaces the workers' stale group. Everything else (validation,
    versions, prefix cache, staged all-or-nothing installs) is as for :class:`VLLMMultiprocessAdapter`.

    Example:
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "hotweights"})            # doctest: +SKIP
        >>> adapter = VLLMWeightTransferAdapter(llm, transport="collective")                  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                     # doctest: +SKIP
    """

    name = "vllm-weight-transfer"

    def __init__(
        self,
        llm: Any,
        *,
        transport: str | WeightTransport = "shm",
        bucket_bytes: int | None = None,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        rpc_timeout: float | None = 300.0,
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        backend = as_engine(llm).weight_transfer_backend
        if backend != BACKEND:
            raise EngineNotSupportedError(
                f"this engine's weight transfer backend is {backend or 'not configured'!r}; start it with "
                f"LLM(..., weight_transfer_config={{'backend': {BACKEND!r}}}) with hotweights installed"
            )
        if getattr(transport, "keep_segments", False):
            raise ValueError(
                "kept shm segments are released through hotweights' worker extension, which vLLM's weight-transfer "
                "API cannot reach; use a plain make_transport('shm') here, or VLLMMultiprocessAdapter"
            )
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

    def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        try:
            return self.engine.call(method, timeout=self.rpc_timeout, kwargs=kwargs or None)
        except Exception as exc:
            refusal = engine_refusal(exc)  # a manifest a worker refused at its first bucket: nothing was written
            if refusal is None:
                raise
            raise refusal from exc

    def call(self, method: str, *args: Any) -> list[Any]:
        """EngineLink: the collective transport's rendezvous goes through ``init_weight_transfer_engine``."""
        if method == "hotweights_init_communicator":
            host, port, world_size, backend, timeout = args
            info = {"host": host, "port": port, "world_size": world_size, "backend": backend, "timeout": timeout}
            return self._rpc("init_weight_transfer_engine", init_info=info)
        if method == "hotweights_close_communicator":
            return self._rpc("shutdown_weight_transfer_engine")
        raise ValueError(f"{method!r} has no vLLM weight-transfer equivalent")

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        tensors = lazy_mapping(items)
        sent = self._sent_manifest(manifest, tensors)

        def stage(bucket: Bucket, descriptor: Descriptor) -> None:
            info: dict[str, Any] = {"update_id": sent.update_id, "bucket_json": bucket.model_dump_json()}
            if bucket.index == 0:
                info["manifest_json"] = sent.to_json()
            self._rpc("update_weights", update_info={**info, "descriptor": descriptor})

        with timer("begin"):
            self._rpc("start_weight_update")
        try:
            self._send_buckets(sent, tensors, timer, stage)
            self._begin_writing(timer)
            with timer("install"):
                self._rpc("finish_weight_update")
        except BaseException:
            if not self._may_have_written:  # drop what was staged, then close vLLM's session: the model is untouched
                with best_effort("abort vLLM's weight-transfer session"):
                    self._rpc("update_weights", update_info={"update_id": sent.update_id, "abort": True})
                    self._rpc("finish_weight_update")
            raise
        return self._digests(sent)
