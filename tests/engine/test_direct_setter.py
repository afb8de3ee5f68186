"""VLLMDirectSetterAdapter against real in-process tiny engines: Qwen2 and Llama, tied and untied, with and
without LoRA wrappers (``enable_lora=True`` puts ``base_layer`` into vLLM's parameter names)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hotweights import WeightManifestValidationError, WeightUpdateManifest
from hotweights.adapters import VLLMDirectSetterAdapter
from hotweights.core.placement import place
from hotweights.vllm.worker.setter import model_slots

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

CASES = [
    (Variant("qwen2", torch.float32, tie=False), False),
    (Variant("llama", torch.float32, tie=True), False),
    (Variant("qwen2", torch.float32, tie=False), True),
    (Variant("llama", torch.float32, tie=True), True),
]


class Engine:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint, lora: bool) -> None:
        self.llm, self.a, self.b, self.lora = llm, a, b, lora
        self.adapter = VLLMDirectSetterAdapter(llm)
        self.version = 0

    def install(self, ckpt: TinyCheckpoint) -> None:
        self.version += 1
        sd = ckpt.state_dict()
        report = self.adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version), sd)
        assert report.adapter == "direct-setter"


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].id}{'-lora' if c[1] else ''}")
def engine(request: pytest.FixtureRequest, checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Engine]:
    variant, lora = request.param
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    extra = {"enable_lora": True, "max_lora_rank": 8} if lora else {}
    eng = Engine(start_engine(a.path, dtype=variant.vllm_dtype, **extra), a, b, lora)
    yield eng
    stop_engine(eng.llm)


def test_a_to_b_to_a_matches_fresh_engine_and_hf(engine: Engine) -> None:
    if engine.lora:
        assert any(".base_layer." in n for n, _ in engine.adapter.model.named_parameters())
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.fresh == engine.b.hf
    engine.install(engine.a)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.fresh


def test_dry_run_plan_places_every_tensor_and_writes_nothing(engine: Engine) -> None:
    engine.install(engine.a)
    sd = engine.b.state_dict()
    plan = engine.adapter.plan(WeightUpdateManifest.from_state_dict(sd, weight_version=99))
    placed = {p.checkpoint_name for p, _ in plan.placements}
    assert placed == set(sd) - set(plan.skipped)
    assert ("lm_head.weight" in plan.skipped) == engine.a.variant.tie
    assert plan.nbytes == sum(sd[n].nbytes for n in placed)
    q = "model.layers.1.self_attn.q_proj.weight"
    k = "model.layers.1.self_attn.k_proj.weight"
    by_name = {p.checkpoint_name: p for p, _ in plan.placements}
    assert by_name[q].param.endswith("qkv_proj.base_layer.weight" if engine.lora else "qkv_proj.weight")
    assert (by_name[k].dst_start, by_name[k].length) == (sd[q].shape[0], sd[k].shape[0])
    assert greedy_vllm(engine.llm) == engine.a.fresh  # planning wrote nothing


def test_unplaceable_updates_refused_before_the_first_copy(engine: Engine) -> None:
    engine.install(engine.a)
    sd = engine.b.state_dict()
    only_q = {k: v for k, v in sd.items() if ".k_proj." not in k and ".v_proj." not in k}
    with pytest.raises(WeightManifestValidationError, match="all fused parts") as info:
        engine.adapter.plan(WeightUpdateManifest.from_state_dict(only_q, weight_version=99))
    fused_q = sum(".q_proj." in k for k in sd)  # every qkv_proj weight (and bias) misses its k and v parts
    assert len([m for m in info.value.mismatches if m.kind == "missing"]) == fused_q
    bogus = {**sd, "model.layers.0.mlp.fc9.weight": torch.zeros(2, 2)}
    with pytest.raises(WeightManifestValidationError, match="fc9"):
        engine.adapter.plan(WeightUpdateManifest.from_state_dict(bogus, weight_version=99))
    assert greedy_vllm(engine.llm) == engine.a.fresh


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tensor_parallel_plan_on_real_layer_shapes(engine: Engine, tp_size: int) -> None:
    """For each fused layer of the real model, the per-rank slices of every checkpoint tensor tile it exactly
    (k/v heads replicated when tp_size exceeds them) and fill each rank's parameter without gaps."""
    sd = engine.b.state_dict()
    engine.adapter.plan(WeightUpdateManifest.from_state_dict(sd, weight_version=99))
    slots = model_slots(engine.adapter.model)
    for name, slot in slots.items():
        if name not in sd or slot.target.kind not in ("qkv", "merged_column", "column", "row", "vocab"):
            continue
        rows = [place(name, slot.target, shard=slot.shard, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        dim_len = sd[name].shape[rows[0].dim]
        covered = sorted({(p.src_start, p.src_start + p.length) for p in rows})
        assert covered[0][0] == 0 and covered[-1][1] == dim_len, (name, covered)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), (name, covered)
    for target in {s.target for s in slots.values() if s.target.kind == "qkv"}:
        parts = [place(n, target, shard=s.shard, tp_size=tp_size) for n, s in slots.items() if s.target == target]
        per_rank = sum(p.length for p in parts)
        heads, kv = target.num_heads // tp_size, max(1, target.num_kv_heads // tp_size)
        assert per_rank == (heads + 2 * kv) * target.head_size
        assert sorted((p.dst_start, p.dst_start + p.length) for p in parts)[-1][1] == per_rank
