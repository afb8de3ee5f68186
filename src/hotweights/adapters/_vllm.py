"""What every adapter bound to a vLLM engine shares: expected weights, the serving gate, prefix-cache reset,
version record and recovery; and, for adapters that move buckets through a transport, the bucket loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hotweights.adapters.base import Items, PrefixCachePolicy, WeightInstallAdapter
from hotweights.core.buckets import Bucket, default_bucket_bytes, plan_buckets
from hotweights.core.errors import EngineSleepingError, engine_refusal
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.handles import EngineHandle, as_engine
from hotweights.telemetry import bucket_progress, logger
from hotweights.transports import Descriptor, WeightTransport, make_transport

__all__ = ["VLLMEngineAdapter", "VLLMTransportAdapter"]


class VLLMEngineAdapter(WeightInstallAdapter):
    """Base of the adapters that install into a vLLM engine: a ``vllm.LLM``, an ``AsyncLLM``, or any
    :class:`~hotweights.handles.EngineHandle`. What differs between engine kinds goes through ``self.engine``."""

    def __init__(
        self,
        llm: Any,
        *,
        expected: ExpectedWeights | None,
        prefix_cache: PrefixCachePolicy,
        lock_timeout: float | None,
        guard_generation: bool,
    ) -> None:
        self.engine: EngineHandle = as_engine(llm)
        if expected is None:
            expected = self.engine.expected_weights()
            if expected is None:  # never skipped silently
                logger.warning(
                    "%s: the engine's checkpoint cannot be read from here (not a local directory), so names and "
                    "shapes are checked only by the engine itself, possibly after a partial write. Pass "
                    "expected=ExpectedWeights(...) (e.g. WeightUpdateManifest.from_safetensors(dir).tensors) to "
                    "validate before anything is written.",
                    self.engine.describe(),
                )
        super().__init__(
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            gate=self.engine.gate if guard_generation else None,
            version=self.engine.active_version,
        )
        self.llm = llm
        """The engine object this adapter was given."""

    def _validate(
        self, manifest: WeightUpdateManifest, items: Items, force: bool
    ) -> tuple[Items, list[tuple[str, str]]]:
        if self.engine.is_sleeping():  # its weights may be offloaded or discarded: writing them crashes the engine
            raise EngineSleepingError(
                f"the engine ({self.engine.describe()}) is asleep, so its weights cannot be written; nothing was "
                "written. Wake it first (llm.wake_up(), or `await engine.wake_up()` for an AsyncLLM; waking only "
                "the weights, wake_up(tags=['weights']), is enough), then install again. An engine that slept before "
                "hotweights first saw it is judged by vLLM's is_sleeping(), which is also True while its scheduler is "
                "paused: resume it too."
            )
        return super()._validate(manifest, items, force)

    def _reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _record_engine_version(self, version: str) -> str | None:
        return self.engine.set_weight_version(version)

    def _clear_kv_cache(self) -> int | None:
        """Zero the KV cache; the number of tensors zeroed, or None where it cannot be reached."""
        return self.engine.clear_kv_cache()

    def _recover(self) -> str:
        zeroed = self._clear_kv_cache()
        self.engine.reset_prefix_cache()
        if zeroed is None:
            return "the prefix cache was reset (the KV cache cannot be reached from here)"
        return f"the prefix cache was reset and {zeroed} KV-cache tensors zeroed"

    @staticmethod
    def _digests(manifest: WeightUpdateManifest) -> dict[str, int]:
        return {"digests_verified": sum(s.digest is not None for s in manifest.tensors.values())}


class VLLMTransportAdapter(VLLMEngineAdapter):
    """Base of the adapters that move buckets through a :class:`WeightTransport` to a multiprocess engine.

    It is also the :class:`~hotweights.transports.EngineLink` its transport connects through.
    """

    verifies_digests_locally = False  # the engine side verifies after transit

    def __init__(
        self,
        llm: Any,
        *,
        transport: str | WeightTransport,
        bucket_bytes: int | None,
        rpc_timeout: float | None,
        **common: Any,
    ) -> None:
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive (or None for the default), got {bucket_bytes}")
        super().__init__(llm, **common)
        self.transport = make_transport(transport) if isinstance(transport, str) else transport
        self.bucket_bytes = bucket_bytes
        self.rpc_timeout = rpc_timeout
        self.transport.connect(self)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.transport.name}"

    @property
    def bucket_size(self) -> int:
        """Bytes per bucket: ``bucket_bytes``, or the transport's preferred size capped by free memory."""
        return self.bucket_bytes or default_bucket_bytes(self.transport.preferred_bucket_bytes)

    @property
    def num_workers(self) -> int:
        return self.engine.num_workers

    def call(self, method: str, *args: Any) -> list[Any]:
        """EngineLink: the worker method ``method`` on every worker; a manifest a worker refused comes back as
        :class:`WeightManifestValidationError` (nothing was written)."""
        try:
            return self.engine.call(method, *args, timeout=self.rpc_timeout)
        except Exception as exc:
            refusal = engine_refusal(exc)
            if refusal is None:
                raise
            raise refusal from exc

    @staticmethod
    def _sent_manifest(manifest: WeightUpdateManifest, tensors: Mapping[str, torch.Tensor]) -> WeightUpdateManifest:
        """The manifest of what is actually sent (tensors the engine ignores are left out)."""
        return manifest.model_copy(update={"tensors": {n: manifest.tensors[n] for n in tensors}})

    def _send_buckets(
        self,
        manifest: WeightUpdateManifest,
        tensors: Mapping[str, torch.Tensor],
        timer: PhaseTimer,
        stage: Callable[[Bucket, Descriptor], None],
        *,
        whole_layers: bool = False,
        plan: list[Bucket] | None = None,
    ) -> None:
        """Every bucket of ``manifest`` (cut as ``plan``, by default by :func:`plan_buckets`) through the transport;
        ``stage(bucket, descriptor)`` hands one over."""
        plan = plan if plan is not None else plan_buckets(manifest, self.bucket_size, whole_layers=whole_layers)
        with timer("transfer"), bucket_progress(plan, f"{self.label} v{manifest.weight_version}") as buckets:
            for bucket in buckets:

                def deliver(descriptor: Descriptor, bucket: Bucket = bucket) -> None:
                    stage(bucket, descriptor)

                self.transport.send(bucket, tensors, deliver)

    def close(self) -> None:
        self.transport.close()
