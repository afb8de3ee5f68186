"""What hotweights reads of a vLLM engine object (a ``vllm.LLM`` or an ``AsyncLLM``) and asks of it directly.

Nothing here imports vLLM at module import time: the engine object is passed in and only its attributes are used,
so ``import hotweights`` stays cheap and works without vLLM (checked against vLLM 0.31 to 0.34).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.facts import EngineFacts
from hotweights.vllm.compat import TESTED_VLLM
from hotweights.vllm.worker.runner import worker_model

__all__ = [
    "WORKER_EXTENSION",
    "config_ties_embeddings",
    "dp_engines",
    "engine_dtype",
    "engine_facts",
    "engine_kind",
    "engine_load_config",
    "engine_mode",
    "engine_model_config",
    "engine_weight_version",
    "extensible_kv_cache",
    "extension_class_is_ours",
    "has_unfinished_requests",
    "inprocess_model",
    "is_sleeping",
    "llm_engine",
    "lora_request",
    "max_lora_rank",
    "num_workers",
    "requests_in_flight",
    "reset_prefix_cache",
    "scheduler_paused",
    "set_engine_weight_version",
    "tie_word_embeddings",
    "weight_transfer_backend",
    "weights_asleep_inprocess",
    "worker_extension",
    "worker_lora_modules",
    "worker_lora_rank",
]

_log = logging.getLogger("hotweights")


def engine_kind(obj: Any) -> str:
    """``"llm"`` for a ``vllm.LLM``, ``"async_llm"`` for a ``vllm.v1.engine.async_llm.AsyncLLM``, else ``""``."""
    engine = getattr(obj, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        return "llm"
    if hasattr(obj, "engine_core") and hasattr(obj, "pause_generation") and hasattr(obj, "vllm_config"):
        return "async_llm"
    return ""


def llm_engine(llm: Any) -> Any:
    """The object that holds the engine's config and core client: ``llm.llm_engine``, or the ``AsyncLLM``."""
    kind = engine_kind(llm)
    if kind == "llm":
        return llm.llm_engine
    if kind == "async_llm":
        return llm
    raise EngineNotSupportedError(
        f"{type(llm).__name__} is not a vLLM engine hotweights can install into: pass a vllm.LLM, an AsyncLLM, or "
        f"the handle returned by hotweights.connect(url) (vLLM {TESTED_VLLM} is the tested version)."
    )


def engine_mode(llm: Any) -> str:
    """``"inprocess"`` when the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    else ``"multiprocess"``."""
    core = llm_engine(llm).engine_core
    return "inprocess" if type(core).__name__ == "InprocClient" else "multiprocess"


def has_unfinished_requests(llm: Any) -> bool:
    """Whether a ``vllm.LLM``'s engine still has requests to run (from any caller, gated or not)."""
    return bool(llm_engine(llm).has_unfinished_requests())


def is_sleeping(llm: Any) -> bool:
    """vLLM's own report: True while any part of the engine sleeps *or its scheduler is paused* (coarse)."""
    engine = llm_engine(llm)
    check = getattr(engine, "is_sleeping", None)
    return bool(check()) if callable(check) else False


def weights_asleep_inprocess(llm: Any) -> bool | None:
    """Whether an in-process engine's weights sleep, read from its executor's sleeping tags; None where they cannot
    be reached (then use :func:`is_sleeping`)."""
    inner = getattr(llm_engine(llm).engine_core, "engine_core", None)  # InprocClient -> EngineCore
    tags = getattr(getattr(inner, "model_executor", None), "sleeping_tags", None)
    return "weights" in tags if isinstance(tags, set) else None


def scheduler_paused(llm: Any) -> bool | None:
    """Whether the engine's scheduler is paused (``sleep(level=0)``, ``pause_generation``), asked of the engine
    core itself; None where it cannot be asked."""
    client = llm_engine(llm).engine_core
    inner = getattr(client, "engine_core", None)  # InprocClient -> EngineCore
    try:
        if inner is not None and callable(getattr(inner, "is_scheduler_paused", None)):
            return bool(inner.is_scheduler_paused())
        if callable(getattr(client, "call_utility", None)):  # a core in another process: a utility call
            return bool(client.call_utility("is_scheduler_paused"))
    except Exception:
        _log.debug("hotweights: the engine core did not say whether it is paused", exc_info=True)
    return None


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine keeps its weights in."""
    dtype = engine_model_config(llm).dtype
    assert isinstance(dtype, torch.dtype)
    return dtype


def extensible_kv_cache(llm: Any) -> bool:
    """Whether the engine runs vLLM 0.34's extensible KV cache (``cache_config.enable_extensible_kv_cache``; on by
    default on CUDA): its memory is all the KV cache's but for measured transients, and a weight reload must borrow
    from it (:func:`kv_cache_lent`). False where vLLM has no such cache."""
    cache = getattr(getattr(llm_engine(llm), "vllm_config", None), "cache_config", None)
    return getattr(cache, "enable_extensible_kv_cache", None) is True


def engine_model_config(llm: Any) -> Any:
    """vLLM's ``ModelConfig`` of the engine (``model``, ``revision``, ``dtype``, ``hf_text_config``)."""
    return llm_engine(llm).model_config


def max_lora_rank(llm: Any) -> int | None:
    """The engine's ``max_lora_rank``; None when it was started without ``enable_lora=True``."""
    return _max_lora_rank(getattr(llm_engine(llm), "vllm_config", None))


def _max_lora_rank(vllm_config: Any) -> int | None:
    config = getattr(vllm_config, "lora_config", None)
    return int(config.max_lora_rank) if config is not None else None


def lora_request(name: str, lora_id: int, path: str, *, replace: bool = False) -> Any:
    """vLLM's ``LoRARequest`` for the adapter saved in ``path``; ``replace``: load it even where an adapter of that
    id is loaded already (``load_inplace``), which vLLM does new-first: a failed load keeps the old one."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path, load_inplace=replace)


def worker_lora_rank(worker: Any) -> int | None:
    """The largest rank a vLLM worker's engine takes; None where it was started without LoRA (``enable_lora``)."""
    return _max_lora_rank(getattr(worker, "vllm_config", None))


def worker_lora_modules(worker: Any) -> set[str] | None:
    """The module names (last part, e.g. ``q_proj``) a vLLM worker's LoRA layers take, packed ones unpacked as vLLM
    reads an adapter (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``); None where the worker does not say."""
    manager = getattr(getattr(getattr(worker, "model_runner", None), "lora_manager", None), "_adapter_manager", None)
    supported = getattr(manager, "supported_lora_modules", None)
    if not supported:
        return None
    packed: dict[str, list[str]] = getattr(manager, "packed_modules_mapping", None) or {}
    return {name for module in supported for name in packed.get(module, [module])}


def engine_load_config(llm: Any) -> Any:
    """vLLM's ``LoadConfig`` of the engine (``download_dir``), or None where the engine keeps none."""
    return getattr(getattr(llm_engine(llm), "vllm_config", None), "load_config", None)


def config_ties_embeddings(model_config: Any) -> bool:
    """Whether ``lm_head`` shares the input embedding (its checkpoint then has no ``lm_head.weight``)."""
    for c in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        if c is not None and getattr(c, "tie_word_embeddings", None) is not None:
            return bool(c.tie_word_embeddings)
    return False


def tie_word_embeddings(llm: Any) -> bool:
    """:func:`config_ties_embeddings` of ``llm``'s model."""
    return config_ties_embeddings(engine_model_config(llm))


def inprocess_model(llm: Any) -> torch.nn.Module:
    """The model object of an in-process engine (single worker)."""
    executor = llm_engine(llm).model_executor
    return worker_model(executor.driver_worker)


def reset_prefix_cache(llm: Any) -> bool:
    """Drop cached prefixes computed with the old weights; True when the engine confirmed."""
    return bool(llm.reset_prefix_cache())


def set_engine_weight_version(llm: Any, version: str) -> str | None:
    """Record ``version`` in the engine (vLLM attaches it to outputs); None where this vLLM has no such API."""
    engine = llm_engine(llm)
    if not hasattr(engine, "set_weight_version"):
        return None
    engine.set_weight_version(version)
    return str(engine.get_weight_version())


def engine_weight_version(llm: Any) -> str | None:
    """The version the engine reports; None where this vLLM keeps none."""
    engine = llm_engine(llm)
    if not hasattr(engine, "get_weight_version"):
        return None
    return str(engine.get_weight_version())


def requests_in_flight(engine: Any) -> dict[str, tuple[int, str | None]]:
    """The requests an ``AsyncLLM``'s front end serves now: request id -> (output tokens so far, the weight-version
    label of the last one, None before its first). Read from vLLM 0.32's output processor
    (``RequestState.detokenizer`` and ``weight_version_starts``), which its output handler updates whether or not
    the caller reads the outputs; empty where the engine has no such state."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    found: dict[str, tuple[int, str | None]] = {}
    for rid, state in list(states.items()) if isinstance(states, dict) else []:
        detokenizer = getattr(state, "detokenizer", None)
        tokens = int(detokenizer.num_output_tokens()) if detokenizer is not None else 0
        starts = getattr(state, "weight_version_starts", None) or []
        found[str(rid)] = (tokens, str(starts[-1][0]) if starts else None)
    return found


WORKER_EXTENSION = "hotweights.vllm.worker.extension.HotWeightsWorkerExtension"
"""``worker_extension_cls`` to start a multiprocess engine with, so hotweights can install into it."""


def worker_extension(llm: Any) -> str:
    """The ``worker_extension_cls`` the engine was started with ("" when none)."""
    parallel = getattr(llm_engine(llm).vllm_config, "parallel_config", None)
    return str(getattr(parallel, "worker_extension_cls", "") or "")


def extension_class_is_ours(name: str) -> bool | None:
    """Whether the ``worker_extension_cls`` ``name`` is hotweights' worker extension or a subclass of it (such as
    :class:`hotweights.integrations.verl.VerlWorkerExtension`), so the workers carry every ``hotweights_`` method:
    decided by importing the class here; None where it cannot be imported in this process (the workers' own answer
    decides then)."""
    if not name or name == WORKER_EXTENSION:
        return bool(name)
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        _log.debug("hotweights: the worker extension %r cannot be imported here", name, exc_info=True)
        return None
    from hotweights.vllm.worker.extension import HotWeightsWorkerExtension  # the worker's code, imported only here

    return isinstance(found, type) and issubclass(found, HotWeightsWorkerExtension)


def weight_transfer_backend(llm: Any) -> str:
    """The ``weight_transfer_config.backend`` the engine was started with ("" when none)."""
    config = getattr(llm_engine(llm).vllm_config, "weight_transfer_config", None)
    return str(getattr(config, "backend", "") or "") if config is not None else ""


def engine_facts(engine: Any) -> EngineFacts:
    """What a ``vllm.LLM`` or an ``AsyncLLM`` is, read from its config (see :class:`EngineFacts`)."""
    return EngineFacts(
        num_workers=num_workers(engine),
        worker_extension=worker_extension(engine),
        weight_transfer_backend=weight_transfer_backend(engine),
        inprocess=engine_kind(engine) == "llm" and engine_mode(engine) == "inprocess",
        extensible_kv_cache=extensible_kv_cache(engine),
    )


def num_workers(llm: Any) -> int:
    """Worker processes of the engine (tensor x pipeline parallel size, times the data-parallel ranks an
    ``AsyncLLM`` drives itself: see :func:`dp_engines`)."""
    parallel = llm_engine(llm).vllm_config.parallel_config
    return int(parallel.world_size) * max(1, len(dp_engines(llm)))


def dp_engines(engine: Any) -> list[Any]:
    """The engine cores an ``AsyncLLM`` started with ``data_parallel_size > 1`` drives (one per DP rank it
    manages), or ``[]`` for one engine core.

    vLLM 0.32's data-parallel client (``DPLBAsyncMPClient``) sends every utility call, ``collective_rpc`` included,
    to every rank, but returns rank 0's answer only (``call_utility_async`` -> ``call_utility_all_async(...)[0]``):
    a refusal or read-back from another rank would be lost. :func:`collective_rpc_all` asks every rank and keeps
    every answer.
    """
    client = getattr(engine, "engine_core", None)
    cores = getattr(client, "core_engines", None)
    if not isinstance(cores, list) or len(cores) < 2 or not hasattr(client, "call_utility_all_async"):
        return []
    return cores
