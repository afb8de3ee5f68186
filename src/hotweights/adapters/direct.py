"""Install by copying checkpoint tensors straight into an in-process engine's parameters: the in-process install
session with ``install_method="direct"``, plus a dry-run ``plan``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hotweights.adapters._vllm import EngineOptions
from hotweights.adapters.inprocess import VLLMInProcessAdapter
from hotweights.adapters.options import InstallMethod
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.vllm.worker.setter import DirectPlan, model_slots, plan_direct, refuse_unproven

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VLLMDirectSetterAdapter"]


class VLLMDirectSetterAdapter(VLLMInProcessAdapter):
    """Copies checkpoint-format tensors into the engine's own parameters, in place: the in-process install session
    with ``install_method="direct"``.

    Checkpoint names are mapped to vLLM parameters from the model's metadata (``packed_modules_mapping``, fused
    layers' head counts and output sizes, vocab padding, tensor-parallel rank, LoRA ``base_layer``): q/k/v land in
    their ``qkv_proj`` slices, gate/up in ``gate_up_proj``. :meth:`plan` is a dry run; an update that cannot be
    placed entirely is refused before the first copy. Parameters are written in place; layers that vLLM repacked on
    CPU (0-element parameters) are rebuilt from a full weight and re-processed. A fused parameter is written only
    with all its parts (q, k and v; gate and up) in the same update.

    Args:
        engine: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); for multiprocess engines use
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
    default_method: InstallMethod = "direct"

    def __init__(self, engine: Any, *, verify: bool = False, **options: Unpack[EngineOptions]) -> None:
        super().__init__(engine, install_method="direct", verify=verify, **options)

    @property
    def label(self) -> str:
        return self.name

    def plan(self, manifest: WeightUpdateManifest) -> DirectPlan:
        """Every copy the install would make (target parameter, slice, bytes); raises if any tensor cannot be placed.

        Raises:
            WeightManifestValidationError: listing every tensor with no parameter, a wrong shape, or a repacked
                fused parameter that would get only some of its parts.
            EngineNotSupportedError: the model is not one the direct setter's rule proves (see
                :func:`~hotweights.vllm.worker.setter.direct_refusals`).
        """
        model = self.model
        refuse_unproven(model)
        ignored = self.expected.ignored if self.expected is not None else {}
        return plan_direct(model_slots(model), manifest.tensors, ignored)
