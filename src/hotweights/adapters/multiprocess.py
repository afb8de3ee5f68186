"""Install into a multiprocess vLLM engine (EngineCore and workers in other processes) through a transport."""

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
from hotweights.transports import Descriptor, WeightTransport, make_transport

__all__ = ["VLLMMultiprocessAdapter"]


class VLLMMultiprocessAdapter(WeightInstallAdapter):
    """Installs into an engine started with ``worker_extension_cls=hotweights.WORKER_EXTENSION``.

    The update is cut into buckets; each bucket goes through the transport and is staged by every worker with one
    RPC; a final RPC installs everything staged in one layerwise reload. Until then the model is untouched: any
    failure aborts the session and the previous weights keep serving.

    Args:
        llm: the ``vllm.LLM`` (multiprocess, with the hotweights worker extension).
        transport: ``"shm"`` (default, same host), ``"bytes"``, or a :class:`WeightTransport` instance.
        bucket_bytes: bucket size (default: the transport's ``preferred_bucket_bytes``, capped at an eighth of
            available memory).
        install_method: how the workers install what they staged: ``"reload"`` (vLLM's layerwise reload) or
            ``"direct"`` (the direct setter: planned, then copied into the parameters in place).
        expected, prefix_cache, lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).
        rpc_timeout: seconds each RPC may take before :class:`HotWeightsTimeoutError`.

    Example:
        >>> llm = LLM(model=path, worker_extension_cls=hotweights.WORKER_EXTENSION)       # doctest: +SKIP
        >>> adapter = VLLMMultiprocessAdapter(llm, transport="shm")                      # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                # doctest: +SKIP
    """

    name = "multiprocess"
    verifies_digests_locally = False  # the workers verify after transit

    def __init__(
        self,
        llm: Any,
        *,
        transport: str | WeightTransport = "shm",
        bucket_bytes: int | None = None,
        install_method: str = "reload",
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        rpc_timeout: float | None = 300.0,
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        if install_method not in ("reload", "direct"):
            raise ValueError(f"install_method must be 'reload' or 'direct', not {install_method!r}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive (or None for the default), got {bucket_bytes}")
        if compat.worker_extension(llm) != compat.WORKER_EXTENSION:
            raise EngineNotSupportedError(
                "this engine was not started with hotweights' worker extension, so its workers cannot receive "
                f"weights; start it with LLM(..., worker_extension_cls={compat.WORKER_EXTENSION!r})"
                + (
                    " (it runs in this process: VLLMInProcessWeightReloadAdapter needs no extension)"
                    if compat.engine_mode(llm) == "inprocess"
                    else ""
                )
            )
        super().__init__(
            expected=expected if expected is not None else expected_weights(llm),
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            gate=compat.serving_gate(llm) if guard_generation else None,
        )
        self.llm = llm
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        self.bucket_bytes = bucket_bytes
        self.install_method = install_method
        self.rpc_timeout = rpc_timeout
        self.transport.connect(self)

    @property
    def label(self) -> str:
        method = "" if self.install_method == "reload" else f"-{self.install_method}"
        return f"{self.name}-{self.transport.name}{method}"

    # EngineLink, for transports that set up state with the workers
    @property
    def num_workers(self) -> int:
        return compat.num_workers(self.llm)

    def call(self, method: str, *args: Any) -> list[Any]:
        return compat.rpc(self.llm, method, *args, timeout=self.rpc_timeout)

    _rpc = call

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        tensors = dict(items)
        sent = manifest.model_copy(update={"tensors": {n: manifest.tensors[n] for n in tensors}})
        buckets = plan_buckets(sent, self._bucket_bytes())
        with timer("begin"):
            self._rpc("hotweights_begin", sent.to_json())
        try:
            with timer("transfer"):
                for bucket in buckets:
                    bucket_json = bucket.model_dump_json()

                    def stage(descriptor: Descriptor, bucket_json: str = bucket_json) -> None:
                        self._rpc("hotweights_stage", sent.update_id, bucket_json, descriptor)

                    self.transport.send(bucket, tensors, stage)
            with timer("install"):
                self._may_have_written = True
                summaries = self._rpc("hotweights_finish", sent.update_id, self.install_method)
        except BaseException:
            with contextlib.suppress(Exception):
                compat.rpc(self.llm, "hotweights_abort", sent.update_id, timeout=30.0)
            raise
        return {"digests_verified": min(int(s.get("digests_verified", 0)) for s in summaries)}

    def _recover(self) -> str:
        zeroed = sum(compat.rpc(self.llm, "hotweights_clear_kv_cache", timeout=self.rpc_timeout))
        compat.reset_prefix_cache(self.llm)
        return f"the prefix cache was reset and {zeroed} KV-cache tensors zeroed"

    def _bucket_bytes(self) -> int:
        return self.bucket_bytes or default_bucket_bytes(self.transport.preferred_bucket_bytes)

    def _reset_prefix_cache(self) -> bool:
        return compat.reset_prefix_cache(self.llm)

    def _record_engine_version(self, version: str) -> str | None:
        return compat.set_engine_weight_version(self.llm, version)

    def close(self) -> None:
        self.transport.close()
