"""Install through vLLM's layerwise ``reload_weights`` into an engine that runs in this process."""

from __future__ import annotations

from typing import Any

from hotweights.adapters._vllm import VLLMEngineAdapter
from hotweights.adapters.base import Items, PrefixCachePolicy
from hotweights.core.delta import EncodedDelta, StagedDelta
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine import compat

__all__ = ["VLLMInProcessWeightReloadAdapter"]


class VLLMInProcessWeightReloadAdapter(VLLMEngineAdapter):
    """Installs checkpoint-format tensors into an in-process ``vllm.LLM`` with one layerwise reload.

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): tensors are then handed over by
    reference, never serialised. All tensors of an update go into a single ``reload_weights`` call, so fused
    parameters (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) are always rebuilt from complete parts, and
    vLLM's post-load processing (e.g. oneDNN packing on CPU) runs on the new weights.

    Args:
        llm: the ``vllm.LLM``.
        expected: what the engine accepts; by default read from the safetensors headers of the model directory the
            engine was started from, in the engine's dtype.
        prefix_cache: ``"reset"`` (default) or ``"keep"``.
        rpc_timeout: seconds vLLM may take for the reload call (None: no limit).
        lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).

    Example:
        >>> adapter = VLLMInProcessWeightReloadAdapter(llm)                          # doctest: +SKIP
        >>> manifest = WeightUpdateManifest.from_module(model, weight_version=step)  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                            # doctest: +SKIP
    """

    name = "inprocess-reload"

    def __init__(
        self,
        llm: Any,
        *,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        rpc_timeout: float | None = None,
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        mode = compat.engine_mode(llm)
        if mode != "inprocess":
            raise EngineNotSupportedError(
                "this vllm.LLM runs its engine in other processes; the in-process adapter hands tensors over by "
                "reference and cannot reach them. Start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0, or use "
                "hotweights.install(llm, ...) to pick an adapter that fits."
            )
        super().__init__(
            llm,
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            guard_generation=guard_generation,
        )
        self.rpc_timeout = rpc_timeout

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        self._begin_writing(timer)
        with timer("install"):
            compat.reload_weights(self.llm, items, timeout=self.rpc_timeout)
        return self._digests(manifest)

    # Delta installs: this adapter's host copy is the engine side's too. The delta was applied to it aside
    # (``staged``); the blocks it touched are reinstalled whole in one layerwise reload, then the copy moves on.
    def _delta_refusal(self) -> str | None:
        return None

    def _engine_version_now(self) -> str | None:
        return self.engine.get_weight_version()

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: PhaseTimer
    ) -> dict[str, int]:
        if staged.items:
            self._begin_writing(timer)
            with timer("install"):
                compat.reload_weights(self.llm, staged.items, timeout=self.rpc_timeout)
        return {"digests_verified": sum(e.digest is not None for e in delta.manifest.entries.values())}
