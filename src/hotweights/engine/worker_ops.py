"""Operations that run inside a vLLM worker (in-process, or through a worker extension in a spawned worker).

This module and :mod:`hotweights.engine.compat` are the only places that touch vLLM's worker and model internals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["clear_kv_cache", "refresh_tied_layers", "reload_checkpoint_tensors", "reload_model", "worker_model"]


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a worker (or its wrapper) serves."""
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    assert isinstance(model, torch.nn.Module)
    return model


def reload_checkpoint_tensors(worker: Any, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """One layerwise reload of checkpoint-format tensors, then :func:`refresh_tied_layers`.

    Returns the number of tied layers refreshed.
    """
    worker = getattr(worker, "worker", worker)
    worker.reload_weights(weights_iterator=items, is_checkpoint_format=True)
    return refresh_tied_layers(worker_model(worker))


def reload_model(vllm_config: Any, model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The same install for callers that hold the model, not the worker (vLLM's weight-transfer backends)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    reload_weights(vllm_config, model, weights_iterator=items, weights_path=None, is_checkpoint_format=True)
    return refresh_tied_layers(model)


@torch.no_grad()
def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Re-run post-load processing of layers whose weight is tied to another layer's.

    vLLM's layerwise reload rebuilds the layer that owns a tied weight (e.g. ``embed_tokens``) but not the layer
    that borrows it (``lm_head``): on CPU the borrower keeps a packed copy of the *old* weight and keeps computing
    logits from it (measured: a tied Llama served its previous model's tokens). Re-processing the borrower rebuilds
    its derived state from the shared, already-updated weight. Returns how many layers were refreshed.
    """
    owners: dict[int, torch.nn.Module] = {}
    refreshed = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        owner = owners.setdefault(id(weight), module)
        method = getattr(module, "quant_method", None)
        if owner is not module and method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


@torch.no_grad()
def clear_kv_cache(worker: Any) -> int:
    """Zero every KV-cache tensor of a worker.

    A model that was served while half-installed writes NaNs into KV blocks; ``reset_prefix_cache()`` forgets the
    blocks' hashes but not their contents, and the NaNs then leak into later requests even after a correct install
    (measured). Returns the number of tensors zeroed.
    """
    worker = getattr(worker, "worker", worker)
    caches = getattr(worker.model_runner, "kv_caches", None) or []
    n = 0
    for cache in caches:
        for t in cache if isinstance(cache, (list, tuple)) else [cache]:
            t.zero_()
            n += 1
    return n
