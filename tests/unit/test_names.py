"""The trainer's names (transformers 5's in-memory ones: fused MoE experts, renamed modules) mapped to the names of
the checkpoint the engine serves: hand-written rules, and transformers' own conversion rules per model type."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from hotweights import WeightManifestValidationError, WeightUpdateManifest
from hotweights._install import update_for
from hotweights.core.manifest import ExpectedWeights, TensorSpec
from hotweights.core.names import to_checkpoint
from hotweights.vllm.expected import checkpoint_expected

try:  # transformers >= 5: its conversion rules (transformers.conversion_mapping)
    import transformers
    import transformers.conversion_mapping
except ImportError:
    transformers = None

needs_rules = pytest.mark.skipif(transformers is None, reason="needs transformers >= 5 (conversion_mapping)")

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


# ---------------------------------------------------------------- transformers' own rules, per model type

_DECODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
#: Tiny configs of the MoE families whose in-memory names differ from their checkpoints'.
_FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_DECODER, head_dim=16, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **_DECODER, num_local_experts=E, num_experts_per_tok=2, intermediate_size=32
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_DECODER, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96
    ),
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **_DECODER, num_local_experts=E, num_experts_per_tok=2, intermediate_size=32
    ),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **_DECODER, moe_num_experts=E, moe_k=2, moe_intermediate_size=32, intermediate_size=96
    ),
}

#: Families whose in-memory names are their checkpoint's.
_OTHERS = {
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_DECODER, head_dim=16, num_local_experts=E, num_experts_per_tok=2, intermediate_size=32
    ),
}


def _trainer_and_checkpoint(
    model_type: str, tmp_path: Path
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, TensorSpec]]:
    """A tiny model's ``state_dict()`` (what a trainer sends) and the checkpoint ``save_pretrained`` writes."""
    torch.manual_seed(0)
    config = _FAMILIES[model_type]() if model_type in _FAMILIES else _OTHERS[model_type]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    specs = {n: TensorSpec(shape=tuple(t.shape), dtype="float32") for n, t in saved.items()}
    return model, model.state_dict(), saved, specs


@needs_rules
@pytest.mark.parametrize("model_type", list(_FAMILIES))
def test_a_trainers_state_dict_becomes_the_checkpoint_save_pretrained_writes(model_type: str, tmp_path: Path) -> None:
    model, sd, saved, specs = _trainer_and_checkpoint(model_type, tmp_path)
    assert set(sd) != set(saved)  # the in-memory names differ: that is what is mapped
    items, renamed = to_checkpoint(
        list(sd.items()), specs, model.config.model_type, architectures=model.config.architectures
    )
    out = dict(items)
    assert len(items) == len(out) and set(out) == set(saved) and renamed > 0
    for name, tensor in out.items():
        assert torch.equal(tensor, saved[name]), name
    storages = {t.untyped_storage().data_ptr() for t in sd.values()}
    assert all(t.untyped_storage().data_ptr() in storages for t in out.values())  # views of the trainer's tensors
    manifest = WeightUpdateManifest.from_state_dict(items, weight_version=1)
    assert ExpectedWeights(specs).mismatches(manifest) == []


@needs_rules
def test_the_issues_names_granitemoe_and_ernie(tmp_path: Path) -> None:
    """The two families the hand-written rules refused, with the names the issue quoted."""
    _, sd, _, specs = _trainer_and_checkpoint("granitemoe", tmp_path / "granite")
    out = dict(to_checkpoint(list(sd.items()), specs, "granitemoe")[0])
    fused = sd["model.layers.0.block_sparse_moe.experts.gate_up_proj"]
    assert out["model.layers.0.block_sparse_moe.input_linear.weight"] is fused  # a rename: the same tensor
    _, sd, _, specs = _trainer_and_checkpoint("ernie4_5_moe", tmp_path / "ernie")
    out = dict(to_checkpoint(list(sd.items()), specs, "ernie4_5_moe")[0])
    bias = sd["model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"]
    assert out["model.layers.1.mlp.moe_statics.e_score_correction_bias"] is bias


@needs_rules
def test_gpt_oss_has_no_rules_and_needs_none(tmp_path: Path) -> None:
    """GPT-OSS keeps its experts fused in its checkpoint too: transformers has no rule for it and nothing is mapped."""
    assert transformers.conversion_mapping.get_checkpoint_conversion_mapping("gpt_oss") is None
    _, sd, saved, specs = _trainer_and_checkpoint("gpt_oss", tmp_path)
    assert set(sd) == set(saved)
    items = list(sd.items())
    assert to_checkpoint(items, specs, "gpt_oss") == (items, 0)


@needs_rules
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ((E - 1, 2 * N, H), f"the engine has {E} experts here, the tensor {E - 1}"),
        ((E + 1, 2 * N, H), f"the engine has {E} experts here, the tensor {E + 1}"),
        ((E, H, 2 * N), "transposed: pass tensor.transpose(1, 2)"),
        ((E, N, H), f"[{E}, {2 * N}, {H}]"),
    ],
)
def test_transformers_rules_refuse_a_fused_tensor_that_does_not_fit_by_name(
    model_type: str, shape: tuple[int, ...], says: str
) -> None:
    sd = fused()
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(shape)
    with pytest.raises(WeightManifestValidationError) as err:
        to_checkpoint(list(sd.items()), expected(), model_type)
    assert "model.layers.0.mlp.experts.gate_up_proj" in str(err.value) and says in str(err.value)
    assert [m.name for m in err.value.mismatches] == ["model.layers.0.mlp.experts.gate_up_proj"]


@needs_rules
def test_transformers_rules_refuse_gate_up_and_down_swapped() -> None:
    sd = fused()
    names = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    sd[names[0]], sd[names[1]] = sd[names[1]], sd[names[0]]
    with pytest.raises(WeightManifestValidationError) as err:
        to_checkpoint(list(sd.items()), expected(), "qwen3_moe")
    assert sorted(m.name for m in err.value.mismatches) == sorted(names)


@needs_rules
def test_mixtral_through_transformers_rules() -> None:
    specs = expected("model.layers.0.block_sparse_moe", ("w1", "w3", "w2"))
    items, renamed = to_checkpoint(list(fused().items()), specs, "mixtral")
    assert set(dict(items)) == set(specs) and renamed == 3
    gate_up = fused()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(dict(items)["model.layers.0.block_sparse_moe.experts.2.w3.weight"], gate_up[2, N:])
    bad = fused()
    bad["model.layers.0.mlp.experts.down_proj"] = torch.zeros(E - 1, H, N)
    with pytest.raises(WeightManifestValidationError, match=f"the engine has {E} experts here, the tensor {E - 1}"):
        to_checkpoint(list(bad.items()), specs, "mixtral")


@needs_rules
def test_a_renamed_tensor_of_the_wrong_shape_is_refused_by_the_trainers_name(tmp_path: Path) -> None:
    _, sd, _, specs = _trainer_and_checkpoint("granitemoe", tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.gate_up_proj"
    sd = {**sd, name: sd[name][:-1]}  # an expert missing
    with pytest.raises(WeightManifestValidationError) as err:
        to_checkpoint(list(sd.items()), specs, "granitemoe")
    assert [m.name for m in err.value.mismatches] == [name]
    assert f"the engine has {E} experts here, the tensor {E - 1}" in str(err.value)


def test_without_transformers_the_hand_written_rules_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # import fails
    specs = expected()
    items, renamed = to_checkpoint(list(fused().items()), specs, "qwen3_moe")
    assert set(dict(items)) == set(specs) and renamed == 2


@needs_rules
def test_install_maps_with_the_model_type_of_the_engines_checkpoint(tmp_path: Path) -> None:
    """The engine's expectation carries its checkpoint's model type, and update_for maps with its rules."""
    _, sd, saved, _ = _trainer_and_checkpoint("ernie4_5_moe", tmp_path)
    expected_weights = checkpoint_expected(tmp_path, "float32", tied=False)
    assert expected_weights.model_type == "ernie4_5_moe"
    assert expected_weights.architectures == ("Ernie4_5_MoeForCausalLM",)
    _, manifest = update_for(SimpleNamespace(expected=expected_weights), sd, weight_version=1)
    assert set(manifest.tensors) == set(saved) and expected_weights.mismatches(manifest) == []
