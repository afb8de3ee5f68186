"""A LoRA adapter's tensors, checked against the base model an engine serves before anything is written.

PEFT names an adapter's weights ``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and
``...lora_B.weight`` (``[out_features, r]``) when it saves them, and ``...lora_A.<adapter>.weight`` in a live
model's ``state_dict()``. :func:`lora_items` takes either and returns the saved form; :func:`lora_mismatches`
lists every way the adapter does not fit: a module without its A or B, A and B of different ranks, a rank above what
the engine was started with, a module the base checkpoint does not have, shapes that do not match the base
weight's. Nothing here knows vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.errors import Mismatch
from hotweights.core.manifest import ExpectedWeights, TensorsLike, _as_items

__all__ = ["adapter_config", "base_name", "lora_items", "lora_mismatches", "lora_rank"]

#: ``[base_model.model.]<module>.lora_A|lora_B[.<adapter name>].weight``
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_PREFIX = "base_model.model."


def base_name(name: str) -> str:
    """The checkpoint's name of a base weight under a PEFT model's name: ``base_model.model.`` dropped from the
    front, ``.base_layer`` from before the weight."""
    return name.removeprefix(_PREFIX).replace(".base_layer.", ".")


def lora_items(tensors: TensorsLike) -> tuple[dict[str, torch.Tensor], list[Mismatch]]:
    """The adapter's A and B weights under PEFT's saved names, and a mismatch for every other name (an adapter's
    embedding, bias or ``modules_to_save`` tensors are not installed alone)."""
    found: dict[str, torch.Tensor] = {}
    problems: list[Mismatch] = []
    for name, tensor in _as_items(tensors):
        match = _KEY.match(name)
        if match is None:
            problems.append(Mismatch("unexpected", name, "a LoRA A or B weight (<module>.lora_A.weight)", "other"))
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(Mismatch("not_tensor", name, "torch.Tensor", type(tensor).__name__))
            continue
        found[f"{_PREFIX}{match['module']}.lora_{match['ab']}.weight"] = tensor
    return found, problems


def lora_rank(tensors: Mapping[str, torch.Tensor]) -> int:
    """The adapter's largest rank (0 for no tensors)."""
    return max((int(t.shape[0]) for n, t in tensors.items() if n.endswith(".lora_A.weight") and t.ndim == 2), default=0)


def lora_mismatches(
    tensors: Mapping[str, torch.Tensor], expected: ExpectedWeights | None, max_rank: int | None
) -> list[Mismatch]:
    """Every way ``tensors`` (from :func:`lora_items`) does not fit a base model whose checkpoint is ``expected``,
    in an engine that takes ranks up to ``max_rank``."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        assert match is not None
        modules.setdefault(match["module"], {})[match["ab"]] = tensor
    problems: list[Mismatch] = []
    for module, pair in sorted(modules.items()):
        for ab in "AB":
            if ab not in pair:
                problems.append(Mismatch("missing", f"{_PREFIX}{module}.lora_{ab}.weight"))
        if len(pair) != 2:
            continue
        a, b = pair["A"], pair["B"]
        where = f"{_PREFIX}{module}"
        if a.ndim != 2 or b.ndim != 2:
            problems.append(Mismatch("shape", where, "2-D lora_A and lora_B", f"{tuple(a.shape)}, {tuple(b.shape)}"))
            continue
        rank = int(a.shape[0])
        if int(b.shape[1]) != rank:
            problems.append(Mismatch("shape", f"{where}.lora_B.weight", f"[out, {rank}] (lora_A's rank)", _s(b)))
        if max_rank is not None and rank > max_rank:
            problems.append(
                Mismatch("shape", f"{where}.lora_A.weight", f"rank <= {max_rank} (the engine's max_lora_rank)", _s(a))
            )
        base = expected.tensors.get(f"{module}.weight") if expected is not None else None
        if expected is None:
            continue
        if base is None:
            problems.append(Mismatch("unexpected", where, "a module of the base model with a weight", "no such module"))
            continue
        if len(base.shape) != 2:
            problems.append(Mismatch("shape", where, "a linear base weight", f"base weight {list(base.shape)}"))
            continue
        out_features, in_features = int(base.shape[0]), int(base.shape[1])
        if int(a.shape[1]) != in_features:
            problems.append(Mismatch("shape", f"{where}.lora_A.weight", f"[{rank}, {in_features}]", _s(a)))
        if int(b.shape[0]) != out_features:
            problems.append(Mismatch("shape", f"{where}.lora_B.weight", f"[{out_features}, {rank}]", _s(b)))
    return problems


def adapter_config(config: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``adapter_config.json`` for ``tensors``: a PEFT ``LoraConfig`` (or its dict) as given, with what the
    tensors say where it is silent (``r``, ``target_modules``); ``peft_type`` is ``LORA``."""
    given = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in given.items()}
    targets = sorted({_KEY.match(n)["module"].rsplit(".", 1)[-1] for n in tensors})  # type: ignore[index]
    data.setdefault("r", lora_rank(tensors))
    data.setdefault("lora_alpha", data["r"])
    data["target_modules"] = data.get("target_modules") or targets
    data["peft_type"] = "LORA"
    return data


def _s(t: torch.Tensor) -> str:
    return str(list(t.shape))
