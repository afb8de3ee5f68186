"""Pure placement of checkpoint tensors into fused, tensor-parallel parameters (tp 1, 2, 4)."""

from __future__ import annotations

import pytest

from hotweights.core.placement import TargetParam, place

# Qwen2-7B-like attention: 28 query heads, 4 kv heads, head_dim 128; MLP 18944; vocab 152064 padded to 152064.
QKV = TargetParam("qkv_proj.weight", "qkv", (3584, 3584), num_heads=28, num_kv_heads=4, head_size=128)
GATE_UP = TargetParam("gate_up_proj.weight", "merged_column", (18944, 3584), output_sizes=(18944, 18944))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_per_rank_layout(tp: int) -> None:
    for r in range(tp):
        q, k, v = (place(f"{s}_proj.weight", QKV, shard=s, tp_rank=r, tp_size=tp) for s in "qkv")
        assert (q.dst_start, q.length) == (0, 28 // tp * 128)
        assert (k.dst_start, k.length) == (q.length, 4 // tp * 128)
        assert (v.dst_start, v.length) == (q.length + k.length, 4 // tp * 128)
        assert q.src_start == r * q.length and k.src_start == r * k.length == v.src_start


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    small = TargetParam("qkv", "qkv", (128, 128), num_heads=4, num_kv_heads=2, head_size=32)
    ks = [place("k", small, shard="k", tp_rank=r, tp_size=4) for r in range(4)]
    assert [(p.src_start, p.length) for p in ks] == [(0, 32), (0, 32), (32, 32), (32, 32)]
    assert all(p.dst_start == 32 for p in ks)  # after this rank's single query head


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_column_and_row_and_vocab(tp: int) -> None:
    up = place("up_proj.weight", GATE_UP, shard=1, tp_rank=tp - 1, tp_size=tp)
    assert (up.dim, up.dst_start, up.length, up.src_start) == (0, 18944 // tp, 18944 // tp, (tp - 1) * 18944 // tp)
    row = place("o_proj.weight", TargetParam("o", "row", (3584, 3584)), tp_rank=tp - 1, tp_size=tp)
    assert (row.dim, row.src_start, row.length) == (1, (tp - 1) * 3584 // tp, 3584 // tp)
    vocab = TargetParam("embed", "vocab", (1000, 128), padded_rows=1024)
    parts = [place("embed", vocab, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert sum(p.length for p in parts) == 1000  # padding rows are never written
    assert parts[-1].src_start + parts[-1].length == 1000


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="parts 'q', 'k', 'v'"):
        place("x", QKV, shard=0)
    with pytest.raises(ValueError, match=r"parts 0\.\.1"):
        place("x", GATE_UP, shard="q")
    with pytest.raises(ValueError, match="not divisible by tp_size 3"):
        place("x", QKV, shard="q", tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="not fused"):
        place("x", TargetParam("n", "replicated", (8,)), shard=0)
    with pytest.raises(ValueError, match="outside tp_size"):
        place("x", GATE_UP, shard=0, tp_rank=2, tp_size=2)
