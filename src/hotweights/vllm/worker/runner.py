"""What hotweights reaches of a vLLM worker's model runner, across vLLM versions: the served model, the layerwise
reload (and vLLM 0.34's flag for it), the loan of vLLM 0.34's extensible KV cache, sleeping weights and the CPU
expert packing. Runs in the worker's process; nothing here imports vLLM at module import time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "cpu_prepack_moe_weight",
    "kv_cache_lent",
    "mark_weight_update",
    "reload_model_inplace",
    "weights_asleep_here",
    "worker_model",
]


def weights_asleep_here() -> bool:
    """Engine side: whether vLLM's sleep mode holds this process's weights offloaded or discarded (its CuMem
    allocator keeps them asleep); False where that allocator was never used (CPU, no sleep mode)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # no CUDA build: no sleep mode here
        return False
    allocator = getattr(CuMemAllocator, "instance", None)
    if allocator is None:
        return False
    return any(d.is_asleep and d.tag == "weights" for d in getattr(allocator, "pointer_to_data", {}).values())


@contextlib.contextmanager
def kv_cache_lent(worker: Any, *, reclaimable: bool, lend: bool) -> Iterator[None]:
    """Room for a weight reload in a worker whose KV cache is vLLM 0.34's extensible one (a no-op elsewhere).

    ``reclaimable``: the trainer keeps generation off the engine and the caches are reset after the install (pause
    ``wait`` or ``abort``), so the KV cache holds nothing to keep: the worker says so to vLLM
    (``Worker.set_kv_cache_reclaimable``) for the duration, as vLLM's own pause with ``clear_cache`` does, and a
    reload short of memory may release the cache's memory and recommit it after. ``lend``: enter vLLM's loan here
    (``extensible_kv_cache.kv_cache_lent_for_weight_update``, which fails before any weight changes when not even the
    largest layer fits); vLLM's ``Worker.reload_weights`` enters it itself, a layerwise reload opened by hotweights
    (a streaming commit) does not.
    """
    worker = getattr(worker, "worker", worker)
    mark = getattr(worker, "set_kv_cache_reclaimable", None)  # 0.34's Worker: only then is its runner read
    kv_cache = getattr(getattr(worker, "model_runner", None), "extensible_kv_cache", None) if callable(mark) else None
    if kv_cache is None or not callable(mark):
        yield
        return
    before = bool(getattr(worker, "_kv_cache_reclaimable", False))
    if reclaimable and not before:
        mark(True)
    try:
        if lend:
            from vllm.v1.worker.extensible_kv_cache import kv_cache_lent_for_weight_update

            with kv_cache_lent_for_weight_update(
                kv_cache, worker_model(worker), reclaimable=reclaimable or before, fail_if_short=True
            ):
                yield
        else:
            yield
    finally:
        if reclaimable and not before:
            mark(False)


def reload_model_inplace(vllm_config: Any, model: torch.nn.Module, items: Any) -> None:
    """vLLM's layerwise reload of checkpoint-format ``items`` into ``model`` (a caller that holds the model, not the
    worker): ``model_loader.reload.inplace.reload_weights`` since vLLM 0.32; 0.31 has no such function and its
    runner runs the three steps inline, as done here."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:  # vLLM 0.31
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import layerwise

        with set_current_vllm_config(vllm_config):
            layerwise.initialize_layerwise_reload(model)
            model.load_weights(items)  # type: ignore[operator]
            layerwise.finalize_layerwise_reload(model, vllm_config.model_config)  # type: ignore[no-untyped-call]
        return
    reload_weights(vllm_config, model, weights_iterator=items, weights_path=None, is_checkpoint_format=True)


def mark_weight_update(active: bool) -> bool:
    """Tell vLLM whether a checkpoint-format weight update is running, as its own ``start_reload`` and
    ``finish_reload`` do (``model_loader.reload.lifecycle``, vLLM 0.34+; models whose ``load_weights`` accepts part of
    the checkpoint per call read it): hotweights' streaming install opens vLLM's layerwise reload itself, whatever
    ``VLLM_RELOAD_MODE`` says, because it feeds it bucket by bucket. False where this vLLM keeps no such flag."""
    import importlib

    try:
        lifecycle = importlib.import_module("vllm.model_executor.model_loader.reload.lifecycle")
    except ImportError:  # vLLM 0.31 to 0.33
        return False
    if not hasattr(lifecycle, "_weight_update_active"):
        return False
    setattr(lifecycle, "_weight_update_active", active)  # noqa: B010 - a private global of vLLM's
    return True


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a worker (or its wrapper) serves."""
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    assert isinstance(model, torch.nn.Module)
    return model


def cpu_prepack_moe_weight() -> Any:
    """vLLM's CPU grouped-GEMM expert packing: ``vllm._cpu_ops`` since 0.34, ``vllm._custom_ops`` before."""
    for module_name in ("vllm._cpu_ops", "vllm._custom_ops"):
        try:
            import importlib

            found = getattr(importlib.import_module(module_name), "cpu_prepack_moe_weight", None)
        except Exception:
            continue
        if found is not None:
            return found
    raise ImportError("this vLLM has no cpu_prepack_moe_weight (looked in vllm._cpu_ops and vllm._custom_ops)")
