"""Layers that borrow another layer's weight (a tied LM head): vLLM's reload rebuilds the owner, not the borrower.

Used by every install path in a worker (:mod:`~hotweights.vllm.worker.ops`, the direct setter, the streams) and
by the tied-head mend of vLLM's reload (:mod:`~hotweights.vllm.fixes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["refresh_tied_layers", "tied_borrowers"]


@torch.no_grad()
def refresh_tied_layers(model: torch.nn.Module) -> int:
    """Re-run post-load processing of layers whose weight is tied to another layer's.

    vLLM's layerwise reload rebuilds the layer that owns a tied weight (e.g. ``embed_tokens``) but not the layer
    that borrows it (``lm_head``): on CPU the borrower keeps a packed copy of the *old* weight and keeps computing
    logits from it (measured: a tied Llama served its previous model's tokens). Re-processing the borrower rebuilds
    its derived state from the shared, already-updated weight. Returns how many layers were refreshed.
    """
    refreshed = 0
    for module in tied_borrowers(model):
        module.quant_method.process_weights_after_loading(module)
        refreshed += 1
    return refreshed


def tied_borrowers(model: torch.nn.Module) -> Iterator[Any]:
    """Layers whose weight is another (earlier) layer's and that derive state from it in their quant method."""
    owners: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        owner = owners.setdefault(id(weight), module)
        method = getattr(module, "quant_method", None)
        if owner is not module and method is not None and hasattr(method, "process_weights_after_loading"):
            yield module
