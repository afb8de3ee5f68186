"""Operations that run inside a vLLM worker, for the install session (:mod:`hotweights.vllm.worker.session`): in this
process, through the worker extension in a spawned worker, or in the weight-transfer backend (which passes a
stand-in with the worker's ``model_runner`` and ``reload_weights``).

With :mod:`hotweights.vllm.worker.runner`, the only place that reaches vLLM's worker (its model runner, layerwise reload
and KV cache); :mod:`~hotweights.vllm.worker.setter`, :mod:`~hotweights.vllm.worker.readback` and the streams read the
model's layers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hotweights.vllm.fixes import apply_vllm_fixes
from hotweights.vllm.tied import refresh_tied_layers, tied_borrowers
from hotweights.vllm.worker.runner import mark_weight_update, reload_model_inplace, worker_model

__all__ = [
    "after_weights_changed",
    "clear_kv_cache",
    "close_layerwise_reload",
    "open_layerwise_reload",
    "refresh_tied_layers",
    "reload_checkpoint_tensors",
    "reload_model",
    "worker_model",
]


def reload_checkpoint_tensors(worker: Any, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """One layerwise reload of checkpoint-format tensors, with vLLM's reload mended
    (:func:`~hotweights.vllm.fixes.apply_vllm_fixes`: MoE experts re-packed, tied heads refreshed).

    Returns the number of tied layers refreshed.
    """
    fixes = apply_vllm_fixes()
    worker = getattr(worker, "worker", worker)
    worker.reload_weights(weights_iterator=items, is_checkpoint_format=True)
    if "tied-lm-head" in fixes:  # refreshed inside reload_weights
        return sum(1 for _ in tied_borrowers(worker_model(worker)))
    return refresh_tied_layers(worker_model(worker))


def reload_model(vllm_config: Any, model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The same install for callers that hold the model, not the worker (vLLM's weight-transfer backends)."""
    apply_vllm_fixes()
    reload_model_inplace(vllm_config, model, items)
    return refresh_tied_layers(model)


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


def _model_config(worker: Any) -> Any:
    worker = getattr(worker, "worker", worker)
    return worker.model_runner.vllm_config.model_config


def open_layerwise_reload(model: torch.nn.Module) -> None:
    """Start a layerwise reload that later ``model.load_weights`` calls feed (vLLM buffers each layer until all
    its parts arrived, then processes it). The model cannot serve until :func:`close_layerwise_reload`."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    apply_vllm_fixes()  # MoE experts re-packed as their layers complete

    initialize_layerwise_reload(model)
    mark_weight_update(True)


@torch.no_grad()
def close_layerwise_reload(worker: Any, model: torch.nn.Module, *, discard_incomplete: bool = False) -> None:
    """Finish a reload opened by :func:`open_layerwise_reload`; layers that never got weights keep their previous
    ones. With ``discard_incomplete``, so do layers that got only some of their parts (their buffered parts are
    dropped instead of being processed next to uninitialised memory)."""
    from vllm.model_executor.model_loader.reload import layerwise

    quiet: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if discard_incomplete:
        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and info.load_numel > 0:
                info.loaded_weights.clear()
                info.load_numel = 0
        quiet = _quiet(layerwise.logger)  # "Failed to load weights" for every layer left as it was
    mark_weight_update(False)  # as vLLM's finish_reload: cleared before the layers are finalised
    with quiet:
        layerwise.finalize_layerwise_reload(model, _model_config(worker))  # type: ignore[no-untyped-call]
    after_weights_changed(worker)


@contextlib.contextmanager
def _quiet(logger: Any) -> Iterator[None]:
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def after_weights_changed(worker: Any) -> None:
    """Drop the worker's state derived from the old weights, as vLLM's own ``reload_weights`` does (LoRA,
    encoder and multimodal caches)."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(runner, name, None)
        if callable(reset):
            reset()
