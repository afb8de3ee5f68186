"""Install by copying checkpoint tensors straight into an in-process engine's parameters."""

from __future__ import annotations

from typing import Any

from hotweights.adapters._vllm import VLLMEngineAdapter
from hotweights.adapters.base import Items, PrefixCachePolicy
from hotweights.core.cast import lazy_mapping
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine import compat
from hotweights.engine.direct import (
    DirectPlan,
    ParamSlot,
    apply_direct,
    describe_model,
    plan_direct,
    refuse_unproven,
    verify_readback,
)

__all__ = ["VLLMDirectSetterAdapter"]


class VLLMDirectSetterAdapter(VLLMEngineAdapter):
    """Copies checkpoint-format tensors into the engine's own parameters, in place.

    Checkpoint names are mapped to vLLM parameters from the model's metadata (``packed_modules_mapping``, fused
    layers' head counts and output sizes, vocab padding, tensor-parallel rank, LoRA ``base_layer``): q/k/v land in
    their ``qkv_proj`` slices, gate/up in ``gate_up_proj``. :meth:`plan` is a dry run; an update that cannot be
    placed entirely is refused before the first copy. Parameters are written in place; layers that vLLM repacked on
    CPU (0-element parameters) are rebuilt from a full weight and re-processed. A fused parameter is written only
    with all its parts (q, k and v; gate and up) in the same update.

    Args:
        llm: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); for multiprocess engines use
            ``VLLMMultiprocessAdapter(llm, install_method="direct")``.
        expected, prefix_cache, lock_timeout, guard_generation: as for the other adapters.
        verify: default of ``install(..., verify=...)``: after the copies, read every placed slice back from the
            live parameters and compare it with the trainer's tensor (a ``verify`` phase in the report); a mismatch
            is an :class:`InstallError` and generation fails closed. On CPU, linear weights packed by vLLM hold no
            data to read (``report.readback_unreadable``); an engine that keeps them unpacked is verified whole.

    Example:
        >>> adapter = VLLMDirectSetterAdapter(llm)                                     # doctest: +SKIP
        >>> print("\\n".join(adapter.plan(manifest).describe()[:3]))                   # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                             # doctest: +SKIP
    """

    name = "direct-setter"
    verifies_readback = True

    def __init__(
        self,
        llm: Any,
        *,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
        verify: bool = False,
    ) -> None:
        if compat.engine_mode(llm) != "inprocess":
            raise EngineNotSupportedError(
                "the direct setter reaches the model's parameters and needs an in-process engine "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0); for a multiprocess engine use "
                "VLLMMultiprocessAdapter(llm, install_method='direct')."
            )
        super().__init__(
            llm,
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            guard_generation=guard_generation,
        )
        self.model = compat.inprocess_model(llm)
        self.verify = verify
        self._slots: dict[str, ParamSlot] | None = None

    def plan(self, manifest: WeightUpdateManifest) -> DirectPlan:
        """Every copy the install would make (target parameter, slice, bytes); raises if any tensor cannot be placed.

        Raises:
            WeightManifestValidationError: listing every tensor with no parameter, a wrong shape, or a repacked
                fused parameter that would get only some of its parts.
            EngineNotSupportedError: the model is not one the direct setter's rule proves (see
                :func:`~hotweights.engine.direct.direct_refusals`).
        """
        refuse_unproven(self.model)
        if self._slots is None:
            self._slots = describe_model(self.model)
        ignored = self.expected.ignored if self.expected is not None else {}
        return plan_direct(self._slots, manifest.tensors, ignored)

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        with timer("plan"):
            plan = self.plan(manifest)
        self._begin_writing(timer)
        with timer("install"):
            apply_direct(self.model, plan, lazy_mapping(items))
        self._ran("direct", "VLLMDirectSetterAdapter writes the parameters in place")
        if not self._verify_now:
            return self._digests(manifest)
        with timer("verify"):
            verified, unreadable, bad = verify_readback(self.model, plan, lazy_mapping(items))
        if bad:
            raise ValueError(
                f"readback after the install: {len(bad)} tensor(s) in the live parameters differ from what the "
                f"trainer sent: {bad[:5]}"
            )
        return {**self._digests(manifest), "readback_verified": verified, "readback_unreadable": unreadable}
