"""The leader's plan of rank-parallel writes (pure logic): every row of every tensor in exactly one bucket, each
bucket written by one rank, gathered tensors first."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.rank_writes import _GATHERED, RankWrites


class Shards:
    """Who holds which rows: ``embed`` and ``head`` split over 2 ranks at row 5; ``norm`` is gathered."""

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]] | None:
        rows = tensor.shape[0]
        return None if rows == 4 else (0, [(0, 0, 5), (1, 5, rows)])


def plan(bucket_bytes: int) -> tuple[RankWrites, Any, WeightUpdateManifest]:
    tensors = {"embed": torch.zeros(10, 4), "norm": torch.zeros(4), "head": torch.zeros(9, 4)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    writes = RankWrites.__new__(RankWrites)
    writes.gatherer, writes.items, writes.me = Shards(), tensors, 0  # type: ignore[assignment]
    writes.owner, writes.sources, writes.buckets = {}, {}, 0
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
                assert owner == _GATHERED
                continue
            rows.setdefault(e.name, []).append(e.rows)
            assert owner == (0 if e.rows[1] <= 5 else 1), (e.name, e.rows, owner)  # the rank holding them
    for name in ("embed", "head"):
        covered = sorted(rows[name])
        assert covered[0][0] == 0 and covered[-1][1] == manifest.tensors[name].shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), covered
    assert [b.index for b in buckets] == list(range(len(buckets)))
