"""Direct setter: copy checkpoint-format tensors straight into a live vLLM model's parameters.

The map from checkpoint names to parameters is read from the model itself: its ``packed_modules_mapping`` (which
checkpoint modules are fused into which vLLM module), the fused layers' head counts and output sizes, vocab
padding, tensor-parallel rank/size, and LoRA wrappers (``base_layer``). :func:`plan_direct` computes every copy
before the first one runs; :func:`apply_direct` then copies slices in place (no reallocation, so captured pointers
stay valid). Layers whose weight vLLM repacked on CPU (a 0-element parameter, the data living in a oneDNN handle)
are rebuilt from a full weight and re-processed. A fused parameter is only written with all its parts in the update
(a q without its k and v is refused: vLLM's own reload would leave the other shards uninitialised).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import torch

from hotweights.core.errors import EngineNotSupportedError, Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec
from hotweights.core.placement import ParamKind, Placement, TargetParam, place
from hotweights.vllm.worker.ops import refresh_tied_layers

__all__ = [
    "DirectPlan",
    "ParamSlot",
    "apply_direct",
    "choose_method",
    "describe_model",
    "direct_refusals",
    "model_slots",
    "plan_direct",
    "refuse_unproven",
    "verify_readback",
]


@dataclass(frozen=True)
class ParamSlot:
    """Where one checkpoint tensor goes: the module, the parameter attribute, its description and fused shard."""

    module_name: str
    attr: str
    target: TargetParam
    shard: str | int | None
    rank_shape: tuple[int, ...]
    """This rank's shape of the whole parameter (also for packed, 0-element parameters)."""
    tp_rank: int
    tp_size: int


@dataclass
class _ParamCopies:
    """The copies into one parameter: ``(checkpoint name, whether it may cover the whole parameter, (dim,
    dst_start, src_start, length))``."""

    module_name: str
    attr: str
    rank_shape: tuple[int, ...]
    copies: list[tuple[str, bool, tuple[int, int, int, int]]]


@dataclass
class DirectPlan:
    """Every copy of an update, computed before any is made."""

    placements: list[tuple[Placement, ParamSlot]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    _groups: list[_ParamCopies] | None = field(default=None, repr=False, compare=False)

    def by_param(self) -> list[_ParamCopies]:
        """The placements grouped by destination parameter, in plan order (computed once: a plan is reused)."""
        if self._groups is None:
            groups: dict[tuple[str, str], _ParamCopies] = {}
            for p, slot in self.placements:
                key = (slot.module_name, slot.attr)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = _ParamCopies(slot.module_name, slot.attr, slot.rank_shape, [])
                shape = slot.rank_shape
                covers = p.src_start == 0 == p.dst_start and bool(shape) and p.length == shape[p.dim]
                group.copies.append((p.checkpoint_name, covers, (p.dim, p.dst_start, p.src_start, p.length)))
            self._groups = list(groups.values())
        return self._groups

    def describe(self) -> list[str]:
        """One line per copy: checkpoint tensor -> parameter[slice]."""
        return [
            f"{p.checkpoint_name} -> {p.param}[dim {p.dim}: {p.dst_start}:{p.dst_start + p.length}]"
            f" <- src[{p.src_start}:{p.src_start + p.length}]"
            for p, _ in self.placements
        ]


def _layer_classes() -> dict[str, type]:
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    return {
        "qkv": linear.QKVParallelLinear,
        "merged_column": linear.MergedColumnParallelLinear,
        "row": linear.RowParallelLinear,
        "column": linear.ColumnParallelLinear,
        "vocab": vocab_parallel_embedding.VocabParallelEmbedding,
    }


def _kind(module: torch.nn.Module, attr: str, classes: dict[str, type]) -> ParamKind:
    # order matters: QKV and merged layers are column-parallel subclasses
    for kind in ("qkv", "merged_column", "row", "column", "vocab"):
        if isinstance(module, classes[kind]):
            if kind == "row" and attr == "bias":
                return "replicated"
            return kind
    return "replicated"


def _rank_shape(module: Any, attr: str, param: torch.Tensor, kind: ParamKind) -> tuple[int, ...]:
    if param.numel() > 0 or kind == "replicated":
        return tuple(param.shape)
    if attr == "weight" and hasattr(module, "input_size_per_partition"):
        return (int(module.output_size_per_partition), int(module.input_size_per_partition))
    return tuple(param.shape)


def describe_model(model: torch.nn.Module) -> dict[str, ParamSlot]:
    """Checkpoint name -> slot, for every parameter of a vLLM model (from the model's own metadata)."""
    classes = _layer_classes()
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    slots: dict[str, ParamSlot] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            kind = _kind(module, attr, classes)
            tp_rank, tp_size = int(getattr(module, "tp_rank", 0)), int(getattr(module, "tp_size", 1))
            ckpt_module = module_name.replace(".base_layer", "")
            full = _full_shape(module, attr, param, kind, tp_size)
            target = TargetParam(
                name=f"{module_name}.{attr}",
                kind=kind,
                full_shape=full,
                output_sizes=tuple(int(s) for s in getattr(module, "output_sizes", ()) or ()),
                num_heads=int(getattr(module, "total_num_heads", 0)),
                num_kv_heads=int(getattr(module, "total_num_kv_heads", 0)),
                head_size=int(getattr(module, "head_size", 0)),
                padded_rows=int(getattr(module, "num_embeddings_padded", 0)),
            )
            rank_shape = _rank_shape(module, attr, param, kind)
            prefix, _, leaf = ckpt_module.rpartition(".")
            parts = packed.get(leaf)
            if parts and kind in ("qkv", "merged_column"):
                for i, part in enumerate(parts):
                    shard: str | int = "qkv"[i] if kind == "qkv" else i
                    name = f"{prefix}.{part}.{attr}" if prefix else f"{part}.{attr}"
                    slots[name] = ParamSlot(module_name, attr, target, shard, rank_shape, tp_rank, tp_size)
            else:
                slots[f"{ckpt_module}.{attr}"] = ParamSlot(
                    module_name, attr, target, None, rank_shape, tp_rank, tp_size
                )
    return slots


_SLOTS: WeakKeyDictionary[torch.nn.Module, dict[str, ParamSlot]] = WeakKeyDictionary()


def model_slots(model: torch.nn.Module) -> dict[str, ParamSlot]:
    """:func:`describe_model`, computed once per model (its structure does not change between installs)."""
    slots = _SLOTS.get(model)
    if slots is None:
        slots = _SLOTS[model] = describe_model(model)
    return slots


def _full_shape(module: Any, attr: str, param: torch.Tensor, kind: ParamKind, tp: int) -> tuple[int, ...]:
    if kind == "vocab":
        return (int(module.org_vocab_size), *tuple(param.shape[1:]))
    if kind == "column":
        rows = int(getattr(module, "output_size", param.shape[0] * tp))
        return (rows, int(module.input_size)) if attr == "weight" else (rows,)
    if kind == "row":
        return (int(module.output_size), int(module.input_size))
    return tuple(param.shape)


def plan_direct(
    slots: Mapping[str, ParamSlot], specs: Mapping[str, TensorSpec], ignored: Mapping[str, str] | None = None
) -> DirectPlan:
    """Place every tensor of an update; raise listing every tensor that cannot be placed, before any copy.

    Raises:
        WeightManifestValidationError: a name has no parameter, a placement does not fit the parameter, or a
            fused parameter would receive only some of its parts.
    """
    key = (tuple((n, s.shape, s.dtype) for n, s in specs.items()), tuple(sorted((ignored or {}).items())))
    last = _LAST_PLAN.get("plan")
    if last is not None and last[0] is slots and last[1] == key:
        return last[2]  # the same tensors as the previous install into this model: the same copies
    plan = _plan(slots, specs, ignored)
    _LAST_PLAN["plan"] = (slots, key, plan)
    return plan


#: The last plan made, with the slots and update signature it was made for (every RL step sends the same tensors).
_LAST_PLAN: dict[str, tuple[Mapping[str, ParamSlot], tuple[Any, ...], DirectPlan]] = {}


def _plan(
    slots: Mapping[str, ParamSlot], specs: Mapping[str, TensorSpec], ignored: Mapping[str, str] | None
) -> DirectPlan:
    plan, problems = DirectPlan(skipped=dict(ignored or {})), []
    covered: dict[str, set[str | int | None]] = {}
    for name, spec in specs.items():
        if name in plan.skipped:
            continue
        slot = slots.get(name)
        if slot is None:
            problems.append(Mismatch("unexpected", name, actual="no engine parameter takes this checkpoint name"))
            continue
        try:
            p = place(name, slot.target, shard=slot.shard, tp_rank=slot.tp_rank, tp_size=slot.tp_size)
        except ValueError as exc:
            problems.append(Mismatch("shape", name, expected=slot.target.name, actual=str(exc)))
            continue
        problems += _fit(p, slot, spec)
        covered.setdefault(slot.target.name, set()).add(slot.shard)
        plan.placements.append((p, slot))
        plan.nbytes += spec.expected_nbytes
    fused: dict[str, set[str | int | None]] = {}
    for s in slots.values():
        fused.setdefault(s.target.name, set()).add(s.shard)
    for target, shards in covered.items():
        if shards != fused[target]:
            missing = sorted(str(x) for x in fused[target] - shards)
            problems.append(
                Mismatch("missing", target, expected=f"all fused parts; parts {missing} are not in the update")
            )
    if problems:
        raise WeightManifestValidationError(problems, context="direct install plan")
    return plan


def _fit(p: Placement, slot: ParamSlot, spec: TensorSpec) -> list[Mismatch]:
    src, dst = spec.shape, slot.rank_shape
    ok = (
        len(src) == len(dst)
        and p.src_start + p.length <= (src[p.dim] if src else 1)
        and p.dst_start + p.length <= (dst[p.dim] if dst else 1)
        and all(src[d] == dst[d] for d in range(len(src)) if d != p.dim)
    )
    if ok:
        return []
    return [
        Mismatch(
            "shape", p.checkpoint_name, expected=f"a part of {slot.target.name} {list(dst)}", actual=str(list(src))
        )
    ]


@torch.no_grad()
def apply_direct(
    model: torch.nn.Module, plan: DirectPlan, tensors: Mapping[str, torch.Tensor], *, refresh_tied: bool = True
) -> int:
    """Run a plan: slice copies into live parameters; rebuild and re-process repacked CPU layers (and, with
    ``refresh_tied``, the layers borrowing a tied weight).

    Returns the number of layers re-processed.
    """
    touched: list[torch.nn.Module] = []
    for group in plan.by_param():
        module = _submodule(model, group.module_name)
        param = getattr(module, group.attr)
        shape = group.rank_shape
        rebuild = param.numel() == 0 and bool(shape) and 0 not in shape  # packed by vLLM on CPU: a full weight anew
        dst = torch.empty(shape, dtype=param.dtype, device=param.device) if rebuild else param.data
        for name, covers, (dim, dst_start, src_start, length) in group.copies:
            src = tensors[name]
            if src.dim() == 0 or (covers and src.shape == dst.shape):
                dst.copy_(src)
            else:
                dst.narrow(dim, dst_start, length).copy_(src.narrow(dim, src_start, length))
        if rebuild:
            setattr(module, group.attr, torch.nn.Parameter(dst, requires_grad=False))
        touched.append(module)
    reprocessed = 0
    for module in _needs_reprocessing(dict.fromkeys(touched)):
        module.quant_method.process_weights_after_loading(module)
        reprocessed += 1
    return reprocessed + (refresh_tied_layers(model) if refresh_tied else 0)


_MODULES: WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = WeakKeyDictionary()


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model.get_submodule(name)``, from a name -> submodule map made once per model (an install replaces
    parameters, never modules)."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = dict(model.named_modules())
    module = modules.get(name)
    return module if module is not None else model.get_submodule(name)


def _needs_reprocessing(modules: Iterable[torch.nn.Module]) -> list[Any]:
    """Layers holding state derived from their weight (vLLM's CPU GEMM dispatch): rebuilt from the new weight.

    An input embedding is skipped: its forward is a plain lookup, and the packed copy vLLM makes of it is only read
    through an LM head (which is re-processed itself, or as a tied borrower by :func:`refresh_tied_layers`).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    def derived(m: torch.nn.Module) -> bool:
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead):
            return False
        return hasattr(m, "cpu_linear") and getattr(m, "quant_method", None) is not None

    return [m for m in modules if derived(m)]


# ---------------------------------------------------------------------------------------------- when it is safe
#: Model classes whose ``load_weights`` only renames checkpoint tensors and stacks q/k/v and gate/up (what the
#: plan reproduces): checked against vLLM 0.32 and tested HF-equal: Qwen2 and Llama (tied/untied, LoRA, TP=2), Qwen3
#: (tied/untied) and Mistral by the conformance matrix (tests/engine/test_architectures.py). Mistral's loader permutes
#: only Mistral-format names (``wq``/``wk``), which have no slot in the plan: such an update is refused by the plan.
#: Forced direct installs into Phi-3 (fused checkpoint tensors) and Gemma 2 served wrong tokens: not on the list.
DIRECT_SAFE_MODELS = frozenset({"Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})
#: Quant methods that keep the checkpoint values as they are. On CPU ``UnquantizedLinearMethod`` packs the weight
#: into a oneDNN handle, which :func:`apply_direct` rebuilds by re-running its ``process_weights_after_loading``.
DIRECT_SAFE_QUANT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
#: Layers that may hold parameters the plan writes: nothing derived from them outside the quant method's state.
DIRECT_SAFE_PARAM_LAYERS = frozenset(
    {
        "QKVParallelLinear",
        "MergedColumnParallelLinear",
        "RowParallelLinear",
        "ColumnParallelLinear",
        "ReplicatedLinear",
        "VocabParallelEmbedding",
        "ParallelLMHead",
        "RMSNorm",
    }
)
#: Layers with their own post-load hook that derive nothing from the model's weights, provided they hold no
#: parameters (vLLM's ``Attention``: its hook sets KV-cache scales; an MLA attention derives absorbed weights).
DIRECT_SAFE_HOOK_LAYERS = frozenset({"Attention"})

_REFUSALS: WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = WeakKeyDictionary()


def direct_refusals(model: torch.nn.Module) -> tuple[str, ...]:
    """Why the direct setter cannot prove an install into ``model`` correct (empty: it can); computed once per model.

    The rule is an allow-list: the model's class is in :data:`DIRECT_SAFE_MODELS`; every layer with a quant method
    uses one of :data:`DIRECT_SAFE_QUANT_METHODS`; every layer holding parameters is one of
    :data:`DIRECT_SAFE_PARAM_LAYERS` (LoRA wrappers hold theirs in ``base_layer``); every other layer with a
    ``process_weights_after_loading`` hook is one of :data:`DIRECT_SAFE_HOOK_LAYERS` and holds no parameters.
    Anything else (quantized layers, MLA attention absorbing ``kv_b_proj``, MoE experts, an unknown layer or model)
    may derive tensors from its weights after loading that the setter would not rebuild: vLLM's layerwise reload,
    which re-runs every post-load step, installs it instead.
    """
    cached = _REFUSALS.get(model)
    if cached is not None:
        return cached
    reasons: list[str] = []
    if type(model).__name__ not in DIRECT_SAFE_MODELS:
        reasons.append(
            f"model class {type(model).__name__} is not one whose loader the direct setter reproduces "
            f"({', '.join(sorted(DIRECT_SAFE_MODELS))})"
        )
    refused: dict[str, str] = {}  # one line per layer class
    for name, module in model.named_modules():
        cls = type(module).__name__
        method = getattr(module, "quant_method", None)
        holds = any(True for _ in module.parameters(recurse=False))
        hook = callable(getattr(module, "process_weights_after_loading", None))
        if method is not None and type(method).__name__ not in DIRECT_SAFE_QUANT_METHODS:
            refused.setdefault(cls, f"{name} ({cls}) uses quant method {type(method).__name__}")
        elif holds and cls not in DIRECT_SAFE_PARAM_LAYERS:
            refused.setdefault(cls, f"{name} ({cls}) holds parameters and is not a layer the setter rebuilds")
        elif hook and (cls not in DIRECT_SAFE_HOOK_LAYERS or holds):
            refused.setdefault(cls, f"{name} ({cls}) derives state in process_weights_after_loading")
    reasons += refused.values()
    result = _REFUSALS[model] = tuple(reasons)
    return result


def refuse_unproven(model: torch.nn.Module) -> None:
    """Raise before any write when :func:`direct_refusals` finds a reason: a direct install into a model the rule
    cannot prove served wrong tokens silently (measured: Phi-3, Gemma 2)."""
    refusals = direct_refusals(model)
    if refusals:
        more = f" (+{len(refusals) - 1} more)" if len(refusals) > 1 else ""
        raise EngineNotSupportedError(
            f"the direct setter cannot prove an install into this model exact: {refusals[0]}{more}; nothing was "
            "written. Use install_method='auto' (it falls back to vLLM's layerwise reload) or 'reload'."
        )


def choose_method(
    get_model: Callable[[], torch.nn.Module], specs: Mapping[str, TensorSpec], method: str
) -> tuple[DirectPlan | None, str, str]:
    """``(plan, method, reason)``: how a worker installs ``specs`` when the trainer asked for ``method``.

    ``"reload"``/``"direct"`` are forced (``"direct"`` plans, raising if the update cannot be placed); ``"auto"``
    picks the direct setter when :func:`direct_refusals` finds nothing and the plan places every tensor, else
    vLLM's layerwise reload; ``reason`` says why, for the report. ``get_model`` is called unless ``"reload"``.
    """
    if method == "reload":
        return None, "reload", "install_method='reload' was asked for"
    model = get_model()
    if method == "direct":
        refuse_unproven(model)
        return plan_direct(model_slots(model), specs), "direct", "install_method='direct' was asked for"
    if method != "auto":
        raise ValueError(f"unknown install method {method!r}; use 'auto', 'direct' or 'reload'")
    refusals = direct_refusals(model)
    if refusals:
        more = f" (+{len(refusals) - 1} more)" if len(refusals) > 1 else ""
        return None, "reload", f"auto: the direct setter cannot prove this model safe: {refusals[0]}{more}"
    try:
        plan = plan_direct(model_slots(model), specs)
    except WeightManifestValidationError as exc:
        first = str(exc.mismatches[0]) if exc.mismatches else str(exc)
        return None, "reload", f"auto: the direct setter's plan cannot place this update: {first}"
    why = f"auto: {type(model).__name__}, only allow-listed layers, plan placed all {len(plan.placements)} copies"
    return plan, "direct", why


@torch.no_grad()
def verify_readback(
    model: torch.nn.Module, plan: DirectPlan, tensors: Mapping[str, torch.Tensor]
) -> tuple[int, int, list[str]]:
    """Read every placement of ``plan`` back from the live parameters and compare it with the slice of the
    trainer's tensor that the plan put there (q/k/v and gate/up slices of fused parameters included).

    Returns ``(verified, unreadable, mismatched)``: checkpoint tensors whose every placement read back equal; those
    with a placement in a parameter that holds no data (on CPU vLLM moves linear weights into packed oneDNN handles,
    leaving a 0-element parameter: nothing to read); and the names that differ.
    """
    unreadable: set[str] = set()
    bad: set[str] = set()
    for p, slot in plan.placements:
        param = getattr(_submodule(model, slot.module_name), slot.attr)
        if param.numel() == 0:
            unreadable.add(p.checkpoint_name)
            continue
        src = tensors[p.checkpoint_name]
        if src.dim() == 0:
            live, want = param.data, src
        else:
            live = param.data.narrow(p.dim, p.dst_start, p.length)
            want = src.narrow(p.dim, p.src_start, p.length)
        if not torch.equal(live, want.to(device=live.device, dtype=live.dtype)):
            bad.add(p.checkpoint_name)
    names = {p.checkpoint_name for p, _ in plan.placements}
    return len(names - unreadable - bad), len(unreadable - bad), sorted(bad)
