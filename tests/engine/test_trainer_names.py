"""Families whose transformers 5 in-memory names differ from their checkpoint's in more than fused experts
(GraniteMoE's ``input_linear``/``output_linear``/``router.layer``, ERNIE 4.5's ``moe_statics`` under ``mlp.gate``):
the trainer's ``state_dict()`` is mapped with transformers' own conversion rules, and the engine then holds and
serves exactly what a fresh engine on the same weights does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights.vllm import introspect

from .conftest import greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

transformers = pytest.importorskip("transformers")

_DECODER = dict(
    hidden_size=128,  # head_dim 32: the CPU attention's smallest
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
CONFIGS = {
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **_DECODER, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64
    ),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(  # layer 1 is MoE, with two shared experts
        **_DECODER, moe_num_experts=4, moe_k=2, moe_intermediate_size=64, intermediate_size=256
    ),
}
#: vLLM 0.32's CPU router ignores ERNIE 4.5's ``e_score_correction_bias`` (plain softmax top-k), so its output
#: differs from transformers' and the family probe, whose reference is transformers, cannot pass; the fresh engine
#: on B is the reference here.
UNPROVEN = {"granitemoe": None, "ernie4_5_moe": "trust"}


def _build(family: str, seed: int) -> Any:
    """A random tiny model (std 0.3, as hotweights.testing.build_tiny_model: seeds give different tokens)."""
    gen = torch.Generator().manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _engine_params(llm: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in introspect.inprocess_model(llm).state_dict().items()}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_trainers_state_dict_installs_like_a_restart(family: str, tmp_path: Path) -> None:
    a, b = _build(family, 0), _build(family, 1)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    llm = start_engine(tmp_path / "b")
    try:
        fresh_b, params_b = greedy_vllm(llm), _engine_params(llm)
    finally:
        stop_engine(llm)
    llm = start_engine(tmp_path / "a")
    try:
        assert greedy_vllm(llm) != fresh_b
        report = hotweights.install(llm, b.state_dict(), weight_version=1, unproven=UNPROVEN[family])
        assert greedy_vllm(llm) == fresh_b, f"via {report.adapter} ({report.install_method})"
        params = _engine_params(llm)
        assert params.keys() == params_b.keys()
        assert [n for n in params if not torch.equal(params[n], params_b[n])] == []
    finally:
        stop_engine(llm)
