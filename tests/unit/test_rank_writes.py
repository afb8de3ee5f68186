"""The leader's plan of rank-parallel writes (pure logic): every row of every tensor in exactly one bucket, each
bucket written by one rank, gathered tensors first."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.rank_writes import _GATHERED, RankWrites


class Shards:
    """Who holds which rows: ``embed`` and ``head`` split over 2 ranks at row 5; ``norm`` is gathered; ``expert``
    (a view of rows rank 1 holds, e.g. one expert of fused experts) is rank 1's to write whole."""

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        rows = tensor.shape[0]
        if rows == 3:  # ``cols``: a tensor-parallel chunk cut along dim 1, columns 0-3 on rank 0, 4-5 on rank 1
            return 4, [(0, 0, 4), (1, 4, 6)], 1
        return None if rows in (2, 4) else (0, [(0, 0, 5), (1, 5, rows)], 0)

    def view_of_rank(self, tensor: torch.Tensor) -> tuple[int, int, list[list[int]]] | None:
        return (3, 1, [[2, 4], [4, 1], [8]]) if tensor.shape[0] == 2 else None


def plan(bucket_bytes: int) -> tuple[RankWrites, Any, WeightUpdateManifest]:
    tensors = {"embed": torch.zeros(10, 4), "norm": torch.zeros(4), "head": torch.zeros(9, 4)}
    tensors["expert"], tensors["cols"] = torch.zeros(2, 4), torch.zeros(3, 6)
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    writes = RankWrites.__new__(RankWrites)
    writes.gatherer, writes.items, writes.me = Shards(), tensors, 0  # type: ignore[assignment]
    writes.owner, writes.sources, writes.views, writes.buckets = {}, {}, {}, 0
    return writes, writes.plan(manifest, bucket_bytes), manifest


def test_every_row_once_in_buckets_of_one_writer() -> None:
    writes, buckets, manifest = plan(bucket_bytes=48)  # 3 rows of 16 bytes
    assert writes.owner[buckets[0].index] == _GATHERED and [e.name for e in buckets[0].entries] == ["norm"]
    rows: dict[str, list[tuple[int, int]]] = {}
    for bucket in buckets:
        owner = writes.owner[bucket.index]
        assert bucket.nbytes <= 48
        for e in bucket.entries:
            if e.rows is None:
                assert owner == (1 if e.name == "expert" else _GATHERED), (e.name, owner)
                continue
            rows.setdefault(e.name, []).append(e.rows)
            if e.name == "cols":  # columns of the rank holding them, cut at 4 columns (48 bytes) at most
                assert e.dim == 1 and owner == (0 if e.rows[1] <= 4 else 1), (e.rows, owner)
                assert e.nbytes == (e.rows[1] - e.rows[0]) * 3 * 4
                continue
            assert e.dim == 0 and owner == (0 if e.rows[1] <= 5 else 1), (e.name, e.rows, owner)  # the holder
    assert sorted(rows["cols"]) == [(0, 4), (4, 6)]
    for name in ("embed", "head"):
        covered = sorted(rows[name])
        assert covered[0][0] == 0 and covered[-1][1] == manifest.tensors[name].shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), covered
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert writes.views == {"expert": [[2, 4], [4, 1], [8]]} and writes.sources["expert"] == 3


class _Local:
    """A rank's shard as a ``DTensor`` gives it (``to_local()``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to_local(self) -> torch.Tensor:
        return self.tensor


def test_a_rank_writes_views_of_its_own_shard_only() -> None:
    from hotweights.core.rank_writes import _OwnRows

    shard = torch.arange(24.0).reshape(2, 3, 4)  # this rank's two experts
    views = {"e1.up": [[3, 2], [4, 1], [14]], "bad": [[3, 2], [4, 1], [20]]}
    rows = _OwnRows({"e1.up": 0, "bad": 0, "embed": 0}, [("fused", _Local(shard))], None, views)
    got = rows["e1.up"]
    assert torch.equal(got, shard[1, :, 2:4]) and got.data_ptr() == shard[1, 0, 2:].data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match=r"'bad': the view .* is not inside this rank's shard"):
        rows["bad"]
    with pytest.raises(KeyError, match="rows of its shards and views of them only"):
        rows["embed"]
