"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the ``"hotweights"`` weight-transfer
backend in every vLLM process. Safe to call more than once."""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "hotweights"


def register() -> None:
    """Register :class:`~hotweights.engine.transfer_engine.HotWeightsTransferEngine` (lazily imported)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer registry: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "hotweights.engine.transfer_engine", "HotWeightsTransferEngine"
        )
