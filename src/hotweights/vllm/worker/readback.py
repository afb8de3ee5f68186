"""Read fused-MoE experts back after an install: the live kernel layout against the trainer's tensors.

On CPU vLLM keeps each MoE layer's experts as ``w13_weight`` ``[E, 2I, H]`` (gate rows, then up) and ``w2_weight``
``[E, H, I]``, re-packed for its grouped-GEMM kernel. The check rebuilds that layout from the checkpoint-format
tensors that were installed, packs it with the kernel's own packing, and compares it with the live parameters
bit for bit, so an install that left experts unpacked, stale or mixed is caught. A layer whose layout this module
cannot rebuild exactly (tensor or expert parallel, padded intermediate size, another kernel) is counted unreadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hotweights.vllm.worker.staging import InstallSession

__all__ = ["readback", "verify_experts"]

#: Per-expert checkpoint leaves: (gate, up, down).
_LEAVES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@torch.no_grad()
def verify_experts(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> tuple[set[str], set[str], str]:
    """``(equal, differing, note)``: the checkpoint names of expert tensors read back equal, those that differ, and
    why some layers could not be read (empty when all could)."""
    equal: set[str] = set()
    bad: set[str] = set()
    notes: list[str] = []
    for name, layer in model.named_modules():
        if not hasattr(layer, "w13_weight") or not hasattr(layer, "w2_weight"):
            continue
        names = _expert_names(name.removesuffix(".routed_experts"), tensors)
        if names is None:
            continue  # this layer's experts are not in the update
        pack, why = _packer(layer)
        if pack is None:
            notes.append(f"{name}: {why}")
            continue
        gates = [tensors[g] for g, _, _ in names]
        ups = [tensors[u] for _, u, _ in names]
        w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
        w2 = torch.stack([tensors[d] for _, _, d in names])
        for live, want, group in (
            (layer.w13_weight, w13, [n for g, u, _ in names for n in (g, u)]),
            (layer.w2_weight, w2, [d for _, _, d in names]),
        ):
            want = want.to(device=live.device, dtype=live.dtype).contiguous()
            same = live.shape == want.shape and torch.equal(live.data, pack(want))
            (equal if same else bad).update(group)
    return equal, bad, "; ".join(notes[:1])


def _expert_names(experts: str, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str, str]] | None:
    """(gate, up, down) checkpoint names of each expert of the module ``experts`` (``<layer>.mlp.experts``)."""
    for gate, up, down in _LEAVES:
        names: list[tuple[str, str, str]] = []
        while f"{experts}.{len(names)}.{gate}.weight" in tensors:
            e = len(names)
            names.append((f"{experts}.{e}.{gate}.weight", f"{experts}.{e}.{up}.weight", f"{experts}.{e}.{down}.weight"))
        if names:
            return names
    return None


def _packer(layer: Any) -> tuple[Any, str]:
    """The kernel's packing for ``layer`` (a function of the stacked checkpoint layout), or None and why not."""
    method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    config = getattr(layer, "moe_config", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod" or experts is None or config is None:
        return None, f"quant method {type(method).__name__} keeps no checkpoint layout to compare"
    if int(getattr(config, "tp_size", 1)) != 1 or int(getattr(config, "ep_size", 1)) != 1:
        return None, "experts split by tensor or expert parallelism are not read back"
    if getattr(experts, "_use_zentorch", False):
        return None, "zentorch experts are not read back"
    pad = getattr(experts, "_padded_intermediate_size", None)
    if callable(pad) and pad(config) != config.intermediate_size_per_partition:
        return None, "a padded intermediate size is not read back"
    isa = getattr(experts, "isa", None)
    if isa is None:  # a GPU kernel may shuffle its layout in ways not rebuilt here
        return None, f"{type(experts).__name__}'s layout is not rebuilt here (CPU experts are)"
    from hotweights.vllm.worker.runner import cpu_prepack_moe_weight

    prepack = cpu_prepack_moe_weight()
    return (lambda w: prepack(w, isa)), ""


def readback(model: torch.nn.Module, session: InstallSession, items: Any) -> dict[str, int | str]:
    """Compare the live parameters with what ``items`` (the session's staged tensors) put there; raise naming every
    tensor that differs. The direct setter's plan knows each fused slice: a reload install is checked with it when
    the model passes the setter's safety rule (its post-processing then leaves data-holding parameters as loaded).
    Fused-MoE experts are checked in the kernel's own layout (:func:`verify_experts`) on every model. What neither
    covers is counted unreadable, and ``readback_note`` says why."""
    from hotweights.core.cast import lazy_mapping
    from hotweights.vllm.worker.setter import direct_refusals, model_slots, plan_direct, verify_readback

    tensors = lazy_mapping(items)
    experts_equal, experts_bad, note = verify_experts(model, tensors)
    plan = session.direct_plan
    refusals = direct_refusals(model) if plan is None else ()
    if plan is None and not refusals:
        plan = plan_direct(model_slots(model), session.manifest.tensors)
    if plan is not None:
        verified, unreadable, bad = verify_readback(model, plan, tensors)
        bad = sorted(set(bad) | experts_bad)
    else:
        verified, bad = len(experts_equal), sorted(experts_bad)
        unreadable = len(tensors) - verified - len(bad)
        note = note or refusals[0]
    if bad:
        raise ValueError(
            f"readback after the install: {len(bad)} tensor(s) in the live parameters differ from what the trainer "
            f"sent: {bad[:5]}"
        )
    summary: dict[str, int | str] = {"readback_verified": verified, "readback_unreadable": unreadable}
    if unreadable and note:
        summary["readback_note"] = note
    return summary
