"""A LoRA adapter checked against the base checkpoint before anything is written (hotweights.core.lora)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hotweights
from hotweights.core.lora import adapter_config, lora_items, lora_mismatches, lora_rank
from hotweights.core.manifest import ExpectedWeights, TensorSpec

P = "base_model.model.model.layers.0.self_attn."


def expected() -> ExpectedWeights:
    spec = TensorSpec(shape=(64, 32), dtype="float32")
    return ExpectedWeights(tensors={"model.layers.0.self_attn.q_proj.weight": spec})


def test_live_and_saved_peft_names_become_the_saved_form() -> None:
    items, problems = lora_items(
        {f"{P}q_proj.lora_A.default.weight": torch.zeros(8, 32), f"{P}q_proj.lora_B.weight": torch.zeros(64, 8)}
    )
    assert problems == [] and sorted(items) == [f"{P}q_proj.lora_A.weight", f"{P}q_proj.lora_B.weight"]
    assert lora_rank(items) == 8 and lora_mismatches(items, expected(), max_rank=8) == []
    config = adapter_config({"lora_alpha": 16, "target_modules": {"q_proj"}}, items)
    assert (config["r"], config["lora_alpha"], config["target_modules"], config["peft_type"]) == (
        8,
        16,
        ["q_proj"],
        "LORA",
    )


def test_every_problem_is_named() -> None:
    items, problems = lora_items(
        {
            f"{P}q_proj.lora_A.weight": torch.zeros(16, 31),  # rank 16 > 8, in_features 31 != 32
            f"{P}q_proj.lora_B.weight": torch.zeros(63, 8),  # out 63 != 64, rank 8 != A's 16
            f"{P}k_proj.lora_A.weight": torch.zeros(8, 32),  # no B, and no k_proj in the base
            "model.embed_tokens.weight": torch.zeros(2),  # not an adapter weight
        }
    )
    found = {(m.kind, m.name.rsplit(".", 2)[-2] if m.kind != "unexpected" else m.name) for m in problems}
    found |= {(m.kind, m.name) for m in lora_mismatches(items, expected(), max_rank=8)}
    text = " ".join(str(m) for m in lora_mismatches(items, expected(), max_rank=8))
    assert ("unexpected", "model.embed_tokens.weight") in found
    assert ("missing", f"{P}k_proj.lora_B.weight") in found
    assert "rank <= 8" in text and "[16, 32]" in text and "[64, 16]" in text and "(lora_A's rank)" in text


def test_an_engine_without_lora_is_refused_before_anything_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotweights.handles.handle import EngineHandle

    class Handle(EngineHandle):  # type: ignore[misc]
        kind = "fake"

    for method in Handle.__abstractmethods__:
        setattr(Handle, method, lambda *a, **k: None)
    Handle.__abstractmethods__ = frozenset()
    Handle.describe = lambda self: "a fake engine"  # type: ignore[method-assign]
    tensors: Any = {f"{P}q_proj.lora_A.weight": torch.zeros(8, 32)}
    with pytest.raises(hotweights.EngineNotSupportedError, match="enable_lora=True"):
        hotweights.install_lora(Handle(), tensors, name="policy", weight_version=1)
    with pytest.raises(hotweights.HotWeightsError, match="no LoRA adapter 'policy'"):
        hotweights.lora_request(Handle(), "policy")
