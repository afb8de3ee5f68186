"""The trainer's tensors in the engine's checkpoint names: pure name and shape mapping, no vLLM.

transformers 5 holds some weights in memory under other names and layouts than its checkpoints: a
mixture-of-experts layer's experts fused as ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` and ``<p>.experts.down_proj``
``[E, H, I]`` where the checkpoint has one tensor per expert and projection, Mixtral's ``.block_sparse_moe.`` as
``.mlp.``, GraniteMoE's ``input_linear`` as ``experts.gate_up_proj``, ERNIE 4.5's ``mlp.moe_statics`` under
``mlp.gate``. ``model.state_dict()`` gives the in-memory form; the engine was started from a checkpoint, and
``save_pretrained`` writes the checkpoint form. :func:`to_checkpoint` maps the first onto the second with
transformers' own rules (``transformers.conversion_mapping``, the ones ``save_pretrained`` reverts through
``revert_weight_conversion``), for whichever model type the engine serves, as views of the trainer's tensors where
a view suffices (splitting experts copies nothing).

No model instance is needed: the rules of the engine's model type (or architecture class) are run forwards, as
``from_pretrained`` would load them, over meta tensors shaped like the engine's checkpoint. That gives every name and
shape the trainer's ``state_dict()`` holds, so a tensor of the right name but the wrong shape (an expert missing,
transposed, gate_up and down swapped) is refused by name before anything moves; the reversed rules then give the
checkpoint tensors. Without transformers, or without a model type it has rules for, hand-written rules for fused
experts and Mixtral's rename apply instead.

Example:
    >>> import torch
    >>> from hotweights.core.manifest import TensorSpec
    >>> expected = {f"m.experts.{e}.{k}.weight": TensorSpec(shape=(2, 3) if k != "down_proj" else (3, 2),
    ...             dtype="float32") for e in range(4) for k in ("gate_proj", "up_proj", "down_proj")}
    >>> items, renamed = to_checkpoint([("m.experts.gate_up_proj", torch.zeros(4, 4, 3)),
    ...                                 ("m.experts.down_proj", torch.zeros(4, 3, 2))], expected)
    >>> len(items), renamed
    (12, 2)
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hotweights.core.errors import Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec

__all__ = ["to_checkpoint"]

log = logging.getLogger("hotweights")

Items = Sequence[tuple[str, torch.Tensor]]
_CONTEXT = "fused MoE experts (transformers 5 names)"


def to_checkpoint(
    items: Items,
    expected: Mapping[str, TensorSpec],
    model_type: str | None = None,
    *,
    architectures: Sequence[str] = (),
) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """``items`` with every name the engine does not know mapped to the checkpoint names it does, and how many
    trainer tensors were mapped.

    ``model_type`` (the engine's ``config.model_type``) and ``architectures`` (its ``config.architectures``, looked
    up first, as transformers does) choose transformers' conversion rules; without them, or without transformers,
    the hand-written rules for fused experts and Mixtral apply. Names the engine expects, and names no rule maps,
    pass unchanged (validation then names them). A tensor that is split (fused experts) becomes views of it.

    Raises:
        WeightManifestValidationError: a tensor the rules map has a shape that does not fit the engine's checkpoint
            (wrong expert count, transposed, or another shape), naming the tensor and the fix; nothing was written.
    """
    if all(name in expected for name, _ in items):
        return list(items), 0
    plan = _plan_for(expected, model_type, tuple(architectures))
    if plan is None:
        return _legacy(items, expected)
    return plan.apply(items, expected)


# ---------------------------------------------------------------- transformers' rules


@dataclass(frozen=True)
class _Target:
    """One tensor of the trainer's ``state_dict()`` that the engine's checkpoint holds under other names."""

    shape: tuple[int, ...] | None  # None: the forward rules could not be run on shapes alone
    key: str  # the reversed rules' key: the checkpoint name, or the first of a converter's (with ``*``)
    converter: Any  # the reversed WeightConverter (a template, copied per use); None for a rename
    pattern: str | None  # the converter's source pattern this tensor matched


class _Plan:
    """The engine's checkpoint seen from the trainer: which in-memory names it holds, in which shapes, and how to
    turn each back into checkpoint tensors."""

    def __init__(self, targets: dict[str, _Target]) -> None:
        self.targets = targets
        self.members = Counter(t.key for t in targets.values() if t.converter is not None)

    def apply(self, items: Items, expected: Mapping[str, TensorSpec]) -> tuple[list[tuple[str, torch.Tensor]], int]:
        out: list[tuple[str, torch.Tensor]] = []
        problems: list[Mismatch] = []
        pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        renamed = 0
        for name, tensor in items:
            target = None if name in expected else self.targets.get(name)
            if target is None:
                out.append((name, tensor))
                continue
            got = tuple(tensor.shape)
            if target.shape is not None and got != target.shape:
                problems.append(_shape_problem(name, got, target.shape))
                continue
            if target.converter is None:
                out.append((target.key, tensor))
                renamed += 1
                continue
            group = pending.setdefault(target.key, [])
            group.append((name, tensor))
            if len(group) < self.members[target.key]:
                continue  # a converter that joins several trainer tensors: wait for the others
            del pending[target.key]
            converted = self._convert(target, group, expected, problems)
            out += converted
            renamed += len(group) if converted else 0
        for group in pending.values():  # a partial group cannot be converted: validation names what is missing
            out += group
        if problems:
            raise WeightManifestValidationError(problems, context=_CONTEXT)
        return out, renamed

    def _convert(
        self,
        target: _Target,
        group: list[tuple[str, torch.Tensor]],
        expected: Mapping[str, TensorSpec],
        problems: list[Mismatch],
    ) -> list[tuple[str, torch.Tensor]]:
        converter = copy.deepcopy(target.converter)
        for name, tensor in sorted(group, key=lambda kv: _natural(kv[0])):
            converter.add_tensor(target.key, name, self.targets[name].pattern, tensor)
        names = ", ".join(name for name, _ in group)
        try:
            converted = _run_converter(converter, target.key)
        except Exception as err:  # an operation that does not fit these tensors
            problems.append(
                Mismatch("shape", names, expected="tensors the checkpoint's rules convert", actual=str(err))
            )
            return []
        bad = [
            Mismatch("shape", f"{name} (from {names})", expected=_spec(expected.get(name)), actual=str(list(t.shape)))
            for name, t in converted.items()
            if name not in expected or tuple(expected[name].shape) != tuple(t.shape)
        ]
        problems += bad
        return [] if bad else list(converted.items())


_PLANS: dict[tuple[int, str | None, tuple[str, ...]], tuple[Mapping[str, TensorSpec], _Plan | None]] = {}
_PLANS_LOCK = threading.Lock()


def _plan_for(
    expected: Mapping[str, TensorSpec], model_type: str | None, architectures: tuple[str, ...]
) -> _Plan | None:
    """The plan for ``expected``, built once per expectation (an adapter keeps the same one across installs)."""
    key = (id(expected), model_type, architectures)
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
    if hit is not None and hit[0] is expected:
        return hit[1]
    plan = _build_plan(expected, model_type, architectures)
    with _PLANS_LOCK:
        while len(_PLANS) >= 8:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = (expected, plan)  # holding ``expected`` keeps its id from being reused while cached
    return plan


def _rules(model_type: str | None, architectures: tuple[str, ...]) -> list[Any] | None:
    """transformers' conversion rules for the engine's model: by class name first, then by model type."""
    if model_type is None and not architectures:
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except Exception:  # no transformers, or one without conversion rules (< 5)
        return None
    for key in (*architectures, model_type):
        if key is not None:
            rules = get_checkpoint_conversion_mapping(key)  # type: ignore[no-untyped-call]  # a fresh copy
            if rules is not None:
                return list(rules)
    return None


def _build_plan(
    expected: Mapping[str, TensorSpec], model_type: str | None, architectures: tuple[str, ...]
) -> _Plan | None:
    rules = _rules(model_type, architectures)
    if not rules:
        return None
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    # Forwards, as from_pretrained loads the engine's checkpoint: the trainer's names and shapes.
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    shapes: dict[str, tuple[int, ...] | None] = {}
    groups: dict[str, Any] = {}
    for name in sorted(expected, key=_natural):
        new, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            if new != name:
                shapes[new] = tuple(expected[name].shape)
            continue
        group = groups.get(new)
        if group is None:
            group = groups[new] = copy.deepcopy(by_pattern[pattern])
        meta = torch.empty(tuple(expected[name].shape), device="meta")  # a shape, no memory
        group.add_tensor(new, name, pattern, meta)  # type: ignore[arg-type]  # typed for loading's futures
    for key, group in groups.items():
        try:
            loaded = group.convert(key)
        except Exception:  # e.g. an operation that needs the model (Transpose(check_dims=True)): shapes unknown
            shapes[key] = None
            continue
        for name, tensor in loaded.items():
            shapes[name] = tuple((tensor[0] if isinstance(tensor, list) else tensor).shape)
    if not shapes:
        return None
    # Backwards, as save_pretrained writes it (revert_weight_conversion): only the rules the checkpoint used.
    used = [r.reverse_transform() for r in rules if r.was_used()][::-1]
    back_renamings = [r for r in used if isinstance(r, WeightRenaming)]
    back_converters = [r for r in used if isinstance(r, WeightConverter)]
    back_by_pattern = {p: c for c in back_converters for p in c.source_patterns}
    targets: dict[str, _Target] = {}
    for name, shape in shapes.items():
        key, pattern = rename_source_key(name, back_renamings, back_converters, reverse=True)
        if pattern is not None:
            targets[name] = _Target(shape, key, back_by_pattern[pattern], pattern)
        elif key in expected:
            targets[name] = _Target(shape, key, None, None)
        else:
            log.debug("hotweights: transformers' rules do not map %r back to the checkpoint (%r)", name, key)
    return _Plan(targets) if targets else None


def _run_converter(converter: Any, key: str) -> dict[str, torch.Tensor]:
    """What ``WeightConverter.convert`` gives, with views where transformers would copy (chunks, per-expert
    slices, transposes); any other operation runs as transformers has it."""
    collected: dict[str, Any] = converter.materialize_tensors()
    for op in converter.operations:
        collected = _run_op(op, collected, converter, key)
    full = key.replace("*.", "0.")
    found = next((full.partition(k) for k in collected if k in full), None)
    if found is not None:
        prefix, _, suffix = found
        collected = {prefix + k + suffix: v for k, v in collected.items()}
    return {k: v[0] if isinstance(v, list) else v for k, v in collected.items()}


def _run_op(op: Any, collected: dict[str, Any], converter: Any, key: str) -> dict[str, Any]:
    from transformers.core_model_loading import Chunk, SplitModulelist, Transpose

    def first(tensors: Any) -> torch.Tensor:
        return tensors[0] if isinstance(tensors, list) else tensors  # type: ignore[no-any-return]

    if type(op) is Chunk and op.num_shards_attribute is None and len(collected) == 1:
        tensor = first(next(iter(collected.values())))
        targets = op.get_target_patterns(converter.target_patterns)
        return dict(zip(targets, torch.chunk(tensor, len(targets), dim=op.dim), strict=False))
    if type(op) is SplitModulelist:
        out: dict[str, Any] = {}
        for pattern, tensors in collected.items():
            tensor = first(tensors)
            names = op.get_target_patterns(collected, pattern, converter.target_patterns, tensor.size(op.dim))
            out.update(zip(names, tensor.unbind(op.dim), strict=False))
        return out
    if type(op) is Transpose and len(collected) == 1:
        target = op.get_target_pattern(collected, converter.source_patterns, converter.target_patterns)
        tensor = first(next(iter(collected.values())))
        # check_dims: transformers transposes only a tensor not already in the model's shape, which a trainer's
        # tensor always is (save_pretrained writes it as it is)
        return {target: tensor if op.check_dims else tensor.transpose(op.dim0, op.dim1)}
    result: dict[str, Any] = op.convert(
        collected,
        source_patterns=converter.source_patterns,
        target_patterns=converter.target_patterns,
        full_layer_name=key,
        model=None,
        config=None,
        missing_keys=None,
    )
    return result


def _natural(name: str) -> Any:
    """transformers' order of names (``dot_natural_key``: expert 10 after expert 9), which its rules rely on."""
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def _spec(spec: TensorSpec | None) -> str:
    return "no such tensor in the engine's checkpoint" if spec is None else str(list(spec.shape))


def _shape_problem(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> Mismatch:
    hint = ""
    if len(got) == 3 == len(want) and got[0] != want[0]:
        hint = f"; the engine has {want[0]} experts here, the tensor {got[0]}"
    elif len(got) == 3 and (got[0], got[2], got[1]) == want:
        hint = "; it is transposed: pass tensor.transpose(1, 2).contiguous()"
    elif len(got) == 2 and got[::-1] == want:
        hint = "; it is transposed: pass tensor.T.contiguous()"
    layout = " (experts, out, in)" if len(want) == 3 else ""
    return Mismatch("shape", name, expected=f"{list(want)}{layout}", actual=f"{list(got)}{hint}")


# ---------------------------------------------------------------- hand-written rules (no transformers rules)

_FUSED = re.compile(r"(?P<prefix>.+)\.experts\.(?P<kind>gate_up_proj|down_proj)")
#: Per-expert leaf names of the checkpoint formats: (gate, up, down).
_LEAVES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
#: Module renames between transformers 5's in-memory names and checkpoint names (trainer, checkpoint).
_MODULE_RENAMES = ((".mlp", ".block_sparse_moe"),)


@dataclass(frozen=True)
class _Experts:
    """One MoE layer's experts as the checkpoint names them."""

    prefix: str
    gate: str
    up: str
    down: str
    count: int

    def name(self, expert: int, leaf: str) -> str:
        return f"{self.prefix}.experts.{expert}.{leaf}.weight"


def _legacy(items: Items, expected: Mapping[str, TensorSpec]) -> tuple[list[tuple[str, torch.Tensor]], int]:
    out: list[tuple[str, torch.Tensor]] = []
    problems: list[Mismatch] = []
    renamed = 0
    for name, tensor in items:
        if name in expected:
            out.append((name, tensor))
            continue
        match = _FUSED.fullmatch(name)
        experts = _experts(match["prefix"], expected) if match else None
        if match is None or experts is None:
            new = _renamed(name, expected)
            renamed += new != name
            out.append((new, tensor))
            continue
        split = _split(name, tensor, match["kind"], experts, expected, problems)
        renamed += bool(split)
        out += split
    if problems:
        raise WeightManifestValidationError(problems, context=_CONTEXT)
    return out, renamed


def _experts(prefix: str, expected: Mapping[str, TensorSpec]) -> _Experts | None:
    for candidate in (prefix, *_module_variants(prefix)):
        for gate, up, down in _LEAVES:
            count = 0
            while f"{candidate}.experts.{count}.{gate}.weight" in expected:
                count += 1
            if count:
                return _Experts(candidate, gate, up, down, count)
    return None


def _module_variants(prefix: str) -> list[str]:
    return [prefix[: -len(trainer)] + checkpoint for trainer, checkpoint in _MODULE_RENAMES if prefix.endswith(trainer)]


def _renamed(name: str, expected: Mapping[str, TensorSpec]) -> str:
    for trainer, checkpoint in _MODULE_RENAMES:
        candidate = name.replace(trainer + ".", checkpoint + ".", 1)
        if candidate != name and candidate in expected:
            return candidate
    return name


def _split(
    name: str,
    tensor: torch.Tensor,
    kind: str,
    experts: _Experts,
    expected: Mapping[str, TensorSpec],
    problems: list[Mismatch],
) -> list[tuple[str, torch.Tensor]]:
    if kind == "gate_up_proj":
        i, h = expected[experts.name(0, experts.gate)].shape
        want: tuple[int, ...] = (experts.count, 2 * i, h)
    else:
        h, i = expected[experts.name(0, experts.down)].shape
        want = (experts.count, h, i)
    got = tuple(tensor.shape)
    if got != want:
        problems.append(_shape_problem(name, got, want))
        return []
    if kind == "down_proj":
        return [(experts.name(e, experts.down), tensor[e]) for e in range(experts.count)]
    out = []
    for e in range(experts.count):
        out.append((experts.name(e, experts.gate), tensor[e, :i]))
        out.append((experts.name(e, experts.up), tensor[e, i:]))
    return out
