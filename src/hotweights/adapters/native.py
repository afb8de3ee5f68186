"""Install through vLLM's own weight-transfer API, with hotweights' ``"hotweights"`` backend on the engine side."""

from __future__ import annotations

import contextlib
from typing import Any

from hotweights.adapters.base import Items, PrefixCachePolicy, WeightInstallAdapter
from hotweights.core.buckets import default_bucket_bytes, plan_buckets
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine import compat
from hotweights.engine.expected import expected_weights
from hotweights.engine.vllm_plugin import BACKEND
from hotweights.transports import Descriptor, WeightTransport, make_transport

__all__ = ["VLLMWeightTransferAdapter"]


class VLLMWeightTransferAdapter(WeightInstallAdapter):
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
    verifies_digests_locally = False  # the backend verifies after transit

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
        if compat.weight_transfer_backend(llm) != BACKEND:
            raise EngineNotSupportedError(
                "this engine's weight transfer backend is "
                f"{compat.weight_transfer_backend(llm) or 'not configured'!r}; start it with "
                f"LLM(..., weight_transfer_config={{'backend': {BACKEND!r}}}) with hotweights installed"
            )
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive (or None for the default), got {bucket_bytes}")
        super().__init__(
            expected=expected if expected is not None else expected_weights(llm),
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            gate=compat.serving_gate(llm) if guard_generation else None,
        )
        self.llm = llm
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        self.bucket_bytes = bucket_bytes
        self.rpc_timeout = rpc_timeout
        self.transport.connect(self)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.transport.name}"

    def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        return compat.rpc(self.llm, method, timeout=self.rpc_timeout, kwargs=kwargs or None)

    # EngineLink: the collective transport's rendezvous goes through vLLM's init_weight_transfer_engine
    @property
    def num_workers(self) -> int:
        return compat.num_workers(self.llm)

    def call(self, method: str, *args: Any) -> list[Any]:
        if method == "hotweights_init_communicator":
            host, port, world_size, backend, timeout = args
            info = {"host": host, "port": port, "world_size": world_size, "backend": backend, "timeout": timeout}
            return self._rpc("init_weight_transfer_engine", init_info=info)
        if method == "hotweights_close_communicator":
            return self._rpc("shutdown_weight_transfer_engine")
        raise ValueError(f"{method!r} has no vLLM weight-transfer equivalent")

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        tensors = dict(items)
        sent = manifest.model_copy(update={"tensors": {n: manifest.tensors[n] for n in tensors}})
        with timer("begin"):
            self._rpc("start_weight_update")
        try:
            with timer("transfer"):
                for bucket in plan_buckets(
                    sent, self.bucket_bytes or default_bucket_bytes(self.transport.preferred_bucket_bytes)
                ):
                    info: dict[str, Any] = {"update_id": sent.update_id, "bucket_json": bucket.model_dump_json()}
                    if bucket.index == 0:
                        info["manifest_json"] = sent.to_json()

                    def stage(descriptor: Descriptor, info: dict[str, Any] = info) -> None:
                        self._rpc("update_weights", update_info={**info, "descriptor": descriptor})

                    self.transport.send(bucket, tensors, stage)
            with timer("install"):
                self._may_have_written = True
                self._rpc("finish_weight_update")
        except BaseException:
            if not self._may_have_written:  # drop what was staged, then close vLLM's session: the model is untouched
                with contextlib.suppress(Exception):
                    self._rpc("update_weights", update_info={"update_id": sent.update_id, "abort": True})
                    self._rpc("finish_weight_update")
            raise
        return {"digests_verified": sum(s.digest is not None for s in sent.tensors.values())}

    def _bucket_bytes(self) -> int:
        return self.bucket_bytes or default_bucket_bytes(self.transport.preferred_bucket_bytes)

    def _reset_prefix_cache(self) -> bool:
        return compat.reset_prefix_cache(self.llm)

    def _record_engine_version(self, version: str) -> str | None:
        return compat.set_engine_weight_version(self.llm, version)

    def _recover(self) -> str:
        compat.reset_prefix_cache(self.llm)
        return "the prefix cache was reset (the KV cache is not reachable through vLLM's weight-transfer API)"

    def close(self) -> None:
        self.transport.close()
