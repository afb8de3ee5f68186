"""Where each checkpoint tensor goes inside an engine's fused, tensor-parallel parameters (pure logic).

A :class:`TargetParam` describes one engine parameter the way vLLM's layers define it (how it is cut across
tensor-parallel ranks, which checkpoint tensors are fused into it). :func:`place` turns a checkpoint tensor into a
:class:`Placement`: which rows/columns of the checkpoint tensor this rank takes, and where they land in the
parameter. Everything is computed before the first copy, so a tensor that cannot be placed is an error up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ParamKind", "Placement", "TargetParam", "place"]

ParamKind = Literal["replicated", "column", "row", "merged_column", "qkv", "vocab"]
"""How a parameter is cut across tensor-parallel ranks:

- ``replicated``: every rank holds it whole (norms, row-parallel biases);
- ``column``: rows (output dim 0) split evenly;
- ``row``: columns (input dim 1) split evenly;
- ``merged_column``: several checkpoint tensors stacked along dim 0 (gate/up), each split evenly;
- ``qkv``: q, k, v stacked along dim 0, split by heads (k/v heads replicated when tp_size > kv heads);
- ``vocab``: embedding rows, padded, split evenly; padding rows are never written.
"""


@dataclass(frozen=True)
class TargetParam:
    """One engine parameter and how vLLM cuts it (full, unsharded sizes)."""

    name: str
    kind: ParamKind
    full_shape: tuple[int, ...]
    """Checkpoint-side full shape of one part (for fused kinds: see ``output_sizes`` / heads)."""
    output_sizes: tuple[int, ...] = ()
    """``merged_column``: full rows of each part, in order."""
    num_heads: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    padded_rows: int = 0
    """``vocab``: rows after padding (all ranks together)."""


@dataclass(frozen=True)
class Placement:
    """Copy ``src[src_start : src_start + length]`` along ``dim`` into ``param[dst_start : dst_start + length]``."""

    checkpoint_name: str
    param: str
    dim: int
    src_start: int
    dst_start: int
    length: int
    shard: str | int | None = None


def _even(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}: {n} is not divisible by tp_size {tp_size}")
    return n // tp_size


def place(
    checkpoint_name: str,
    target: TargetParam,
    *,
    shard: str | int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Placement:
    """This rank's part of checkpoint tensor ``checkpoint_name`` inside ``target``.

    Raises:
        ValueError: the shard id does not fit the parameter kind, or a size does not divide by ``tp_size``.

    Example:
        >>> qkv = TargetParam("qkv_proj.weight", "qkv", (128, 128), num_heads=4, num_kv_heads=2, head_size=32)
        >>> place("k_proj.weight", qkv, shard="k", tp_rank=1, tp_size=2)
        Placement(checkpoint_name='k_proj.weight', param='qkv_proj.weight', dim=0, src_start=32, dst_start=64, length=32, shard='k')
    """  # noqa: E501
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    kind, name = target.kind, target.name

    def at(dim: int, src: int, dst: int, length: int) -> Placement:
        return Placement(checkpoint_name, name, dim, src, dst, length, shard)

    if kind in ("replicated", "column", "row", "vocab") and shard is not None:
        raise ValueError(f"{checkpoint_name!r}: {name} is not fused, but shard {shard!r} was given")
    if kind == "replicated":
        return at(0, 0, 0, target.full_shape[0] if target.full_shape else 1)
    if kind == "column":
        n = _even(target.full_shape[0], tp_size, name)
        return at(0, tp_rank * n, 0, n)
    if kind == "row":
        n = _even(target.full_shape[1], tp_size, name)
        return at(1, tp_rank * n, 0, n)
    if kind == "vocab":
        per_rank = _even(target.padded_rows, tp_size, name)
        start = tp_rank * per_rank
        rows = max(0, min(target.full_shape[0] - start, per_rank))
        return at(0, start, 0, rows)
    if kind == "merged_column":
        if not isinstance(shard, int) or not 0 <= shard < len(target.output_sizes):
            raise ValueError(f"{checkpoint_name!r}: {name} has parts 0..{len(target.output_sizes) - 1}, got {shard!r}")
        sizes = [_even(s, tp_size, name) for s in target.output_sizes]
        return at(0, tp_rank * sizes[shard], sum(sizes[:shard]), sizes[shard])
    if kind == "qkv":
        if shard not in ("q", "k", "v"):
            raise ValueError(f"{checkpoint_name!r}: {name} has parts 'q', 'k', 'v', got {shard!r}")
        heads = _even(target.num_heads, tp_size, f"{name} query heads")
        if tp_size >= target.num_kv_heads:
            kv_heads, replicas = 1, _even(tp_size, target.num_kv_heads, f"{name} kv head replicas")
        else:
            kv_heads, replicas = _even(target.num_kv_heads, tp_size, f"{name} kv heads"), 1
        q_len, kv_len = heads * target.head_size, kv_heads * target.head_size
        if shard == "q":
            return at(0, tp_rank * q_len, 0, q_len)
        kv_rank = tp_rank // replicas
        return at(0, kv_rank * kv_len, q_len if shard == "k" else q_len + kv_len, kv_len)
    raise ValueError(f"unknown parameter kind {kind!r}")
