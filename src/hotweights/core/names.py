"""The trainer's tensors in the engine's checkpoint names: pure name and shape mapping, no vLLM.

transformers 5 keeps a mixture-of-experts layer's experts fused in memory: ``model.state_dict()`` holds
``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up) and ``<p>.experts.down_proj`` ``[E, H, I]``,
and Mixtral's experts sit under ``.mlp.`` rather than its checkpoint's ``.block_sparse_moe.``. The engine was
started from a checkpoint in the per-expert format that ``save_pretrained`` writes
(``<p>.experts.<e>.gate_proj.weight``, or ``w1``/``w3``/``w2`` for Mixtral). :func:`to_checkpoint` maps the first
onto the second, guided by the names the engine expects, as views of the trainer's tensors (nothing is copied).

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hotweights.core.errors import Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec

__all__ = ["to_checkpoint"]

Items = Sequence[tuple[str, torch.Tensor]]

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


def to_checkpoint(items: Items, expected: Mapping[str, TensorSpec]) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """``items`` with every name the engine does not know mapped to the checkpoint names it does, and how many
    trainer tensors were mapped.

    Names the engine expects, and names no rule maps, pass unchanged (validation then names them). Fused expert
    tensors become one view per expert and projection.

    Raises:
        WeightManifestValidationError: a fused expert tensor does not fit the engine's experts (wrong expert count,
            transposed, or another shape), naming the tensor and the fix; nothing was written.
    """
    if all(name in expected for name, _ in items):
        return list(items), 0
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
        raise WeightManifestValidationError(problems, context="fused MoE experts (transformers 5 names)")
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
        hint = ""
        if len(got) == 3 and got[0] != experts.count:
            hint = f"; the engine has {experts.count} experts here, the tensor {got[0]}"
        elif len(got) == 3 and (got[0], got[2], got[1]) == want:
            hint = "; it is transposed: pass tensor.transpose(1, 2).contiguous()"
        problems.append(
            Mismatch("shape", name, expected=f"{list(want)} (experts, out, in)", actual=f"{list(got)}{hint}")
        )
        return []
    if kind == "down_proj":
        return [(experts.name(e, experts.down), tensor[e]) for e in range(experts.count)]
    out = []
    for e in range(experts.count):
        out.append((experts.name(e, experts.gate), tensor[e, :i]))
        out.append((experts.name(e, experts.up), tensor[e, i:]))
    return out
