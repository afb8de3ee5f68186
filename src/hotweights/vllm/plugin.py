"""vLLM general plugin (entry point ``vllm.general_plugins``), run in every vLLM process: mends vLLM's weight
reload where it would serve wrong output (:data:`~hotweights.vllm.fixes.VLLM_FIXES`) and registers the
``"hotweights"`` weight-transfer backend, engine side and trainer side. Safe to call more than once."""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "hotweights"


def register() -> None:
    """Apply :func:`~hotweights.vllm.fixes.apply_vllm_fixes`; register
    :class:`~hotweights.vllm.worker.transfer_backend.HotWeightsTransferEngine` (lazily imported)."""
    from hotweights.vllm.fixes import apply_vllm_fixes

    apply_vllm_fixes()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer registry: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "hotweights.vllm.worker.transfer_backend", "HotWeightsTransferEngine"
        )
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:  # a vLLM without the trainer-side registry
        return
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "hotweights.vllm.trainer_backend", "HotWeightsTrainerEngine"
        )
