"""The trainer's MoE names (transformers 5, fused experts) mapped to the checkpoint's per-expert names."""

from __future__ import annotations

import pytest
import torch

from hotweights import WeightManifestValidationError, WeightUpdateManifest
from hotweights.core.manifest import ExpectedWeights, TensorSpec
from hotweights.core.names import to_checkpoint

E, N, H = 4, 3, 5  # experts, expert intermediate size (N), hidden size


def expected(prefix: str = "model.layers.0.mlp", leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
    gate, up, down = leaves
    specs = {}
    for e in range(E):
        specs[f"{prefix}.experts.{e}.{gate}.weight"] = TensorSpec(shape=(N, H), dtype="float32")
        specs[f"{prefix}.experts.{e}.{up}.weight"] = TensorSpec(shape=(N, H), dtype="float32")
        specs[f"{prefix}.experts.{e}.{down}.weight"] = TensorSpec(shape=(H, N), dtype="float32")
    specs[f"{prefix}.gate.weight"] = TensorSpec(shape=(E, H), dtype="float32")
    return specs


def fused(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * N, H, generator=g),
        "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, N, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(E, H, generator=g),
    }


def test_qwen_moe_experts_become_per_expert_views() -> None:
    specs, sd = expected(), fused()
    items, renamed = to_checkpoint(list(sd.items()), specs)
    out = dict(items)
    assert renamed == 2 and set(out) == set(specs)
    gate_up, down = sd["model.layers.0.mlp.experts.gate_up_proj"], sd["model.layers.0.mlp.experts.down_proj"]
    for e in range(E):
        assert torch.equal(out[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :N])  # gate rows first
        assert torch.equal(out[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], gate_up[e, N:])
        assert torch.equal(out[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
        view = out[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()  # no copy
        assert view.is_contiguous()
    # and the result validates against the engine's expectations
    manifest = WeightUpdateManifest.from_state_dict(items, weight_version=1)
    assert ExpectedWeights(specs).mismatches(manifest) == []


def test_mixtral_experts_and_router_are_renamed_to_block_sparse_moe() -> None:
    specs = expected("model.layers.0.block_sparse_moe", ("w1", "w3", "w2"))
    items, renamed = to_checkpoint(list(fused().items()), specs)
    out = dict(items)
    assert set(out) == set(specs) and renamed == 3  # gate_up, down and the router
    gate_up = fused()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.2.w3.weight"], gate_up[2, N:])


def test_names_the_engine_knows_pass_unchanged() -> None:
    specs = {"a.weight": TensorSpec(shape=(2,), dtype="float32")}
    items = [("a.weight", torch.zeros(2)), ("unknown.weight", torch.zeros(3))]
    assert to_checkpoint(items, specs) == (items, 0)


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ((E - 1, 2 * N, H), f"the engine has {E} experts here, the tensor {E - 1}"),  # an expert missing
        ((E + 1, 2 * N, H), f"the engine has {E} experts here, the tensor {E + 1}"),  # the wrong count
        ((E, H, 2 * N), "transposed: pass tensor.transpose(1, 2)"),
        ((E, N, H), f"[{E}, {2 * N}, {H}]"),  # only one of gate and up
    ],
)
def test_a_fused_tensor_that_does_not_fit_is_refused_by_name(shape: tuple[int, ...], says: str) -> None:
    sd = fused()
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(shape)
    with pytest.raises(WeightManifestValidationError) as err:
        to_checkpoint(list(sd.items()), expected())
    assert "model.layers.0.mlp.experts.gate_up_proj" in str(err.value) and says in str(err.value)
    assert [m.name for m in err.value.mismatches] == ["model.layers.0.mlp.experts.gate_up_proj"]


def test_gate_up_and_down_swapped_are_both_refused() -> None:
    sd = fused()
    names = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    sd[names[0]], sd[names[1]] = sd[names[1]], sd[names[0]]
    with pytest.raises(WeightManifestValidationError) as err:
        to_checkpoint(list(sd.items()), expected())
    assert sorted(m.name for m in err.value.mismatches) == sorted(names)
