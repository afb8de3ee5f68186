"""Rank-parallel writes, without a process group: the leader's plan (every row of every tensor written by exactly
one rank, into buckets of whole tensors, gathered tensors first) and the writes of pieces into a real bucket file
(rows, columns, views; refusals before a byte is written)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.rank_writes import _GATHERED, _RANKS, RankWrites
from hotweights.transports.shm_files import new_file, remove
from hotweights.transports.shm_writes import BucketFile, opened_for_writes


class Shards:
    """Who holds which rows: ``embed`` and ``head`` split over 2 ranks at row 5; ``norm`` is gathered; ``expert``
    (a view of rows rank 1 holds, e.g. one expert of fused experts) is rank 1's to write whole; ``cols`` is a
    tensor-parallel chunk cut along dim 1 (columns 0-3 on rank 0, 4-5 on rank 1)."""

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        rows = tensor.shape[0]
        if rows == 3:
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
    writes.owner, writes.pieces = {}, {}
    return writes, writes.plan(manifest, bucket_bytes), manifest


def test_every_row_written_once_into_buckets_of_whole_tensors() -> None:
    writes, buckets, manifest = plan(bucket_bytes=160)
    assert writes.owner[buckets[0].index] == _GATHERED and [e.name for e in buckets[0].entries] == ["norm"]
    assert [b.index for b in buckets] == list(range(len(buckets)))
    names = [e.name for b in buckets for e in b.entries]
    assert sorted(names) == sorted(manifest.tensors)  # every tensor once, whole
    for bucket in buckets[1:]:
        assert writes.owner[bucket.index] == _RANKS
        assert all(e.rows is None for e in bucket.entries)
        assert bucket.nbytes <= 160 or len(bucket.entries) == 1  # a larger tensor: a bucket of its own
    assert writes.pieces["embed"] == [
        (0, {"source": 0, "shape": [10, 4], "rows": [0, 5, 0]}),
        (1, {"source": 0, "shape": [10, 4], "rows": [5, 10, 0]}),
    ]
    assert [r for r, _ in writes.pieces["head"]] == [0, 1] and writes.pieces["head"][1][1]["rows"] == [5, 9, 0]
    assert writes.pieces["expert"] == [(1, {"source": 3, "shape": [2, 4], "view": [[2, 4], [4, 1], [8]]})]
    assert [p["rows"] for _, p in writes.pieces["cols"]] == [[0, 4, 1], [4, 6, 1]]
    assert "norm" not in writes.pieces


def test_a_piece_names_the_dtype_the_engine_gets_when_it_differs() -> None:
    """A cast install (``cast="engine"``): each rank casts its piece to the manifest's dtype as it writes it."""
    writes, _, manifest = plan(bucket_bytes=160)
    cast = WeightUpdateManifest.from_state_dict(
        {
            n: torch.zeros(s.shape, dtype=torch.bfloat16 if n == "embed" else torch.float32)
            for n, s in manifest.tensors.items()
        },
        weight_version=1,
    )
    writes.plan(cast, 160)
    assert {p.get("dtype") for _, p in writes.pieces["embed"]} == {"torch.bfloat16"}
    assert all("dtype" not in p for _, p in writes.pieces["head"])


@pytest.fixture
def bucket_file() -> Any:
    _, path, fd = new_file(512)
    try:
        yield BucketFile(path, fd, 512)
    finally:
        import os

        os.close(fd)
        remove(path)


def _read(file: BucketFile, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    import math
    import os

    data = os.pread(file.fd, math.prod(shape) * 4, offset)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)


def test_pieces_land_where_the_whole_tensor_lies(bucket_file: BucketFile) -> None:
    whole = torch.arange(24.0).reshape(4, 6)
    bucket_file.write(whole[:3], 64, (4, 6), 0, 0)  # rows, from two writers
    bucket_file.write(whole[3:], 64, (4, 6), 0, 3)
    assert torch.equal(_read(bucket_file, 64, (4, 6)), whole)
    cols = whole + 100
    bucket_file.write(cols[:, 4:], 256, (4, 6), 1, 4)  # columns (a strided slice of a non-contiguous source)
    bucket_file.write(cols[:, :4], 256, (4, 6), 1, 0)
    assert torch.equal(_read(bucket_file, 256, (4, 6)), cols)
    expert = torch.arange(8.0).reshape(2, 4).t()  # a view, not contiguous: written whole
    bucket_file.write(expert, 384, (4, 2))
    assert torch.equal(_read(bucket_file, 384, (4, 2)), expert)


@pytest.mark.parametrize(
    ("data", "offset", "shape", "dim", "start", "match"),
    [
        (torch.ones(3, 6), 0, (4, 6), 0, 2, "does not fit a tensor of shape"),  # rows past the end
        (torch.ones(2, 5), 0, (4, 6), 0, 0, "does not fit a tensor of shape"),  # the wrong row length
        (torch.ones(4, 2), 0, (4, 6), 1, 5, "does not fit a tensor of shape"),
        (torch.ones(4, 6), 448, (4, 6), 0, 0, r"bytes \[448, 544\) lie outside the bucket file \(512 bytes\)"),
    ],
)
def test_a_piece_that_does_not_fit_writes_nothing(
    bucket_file: BucketFile, data: torch.Tensor, offset: int, shape: Any, dim: int, start: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        bucket_file.write(data, offset, shape, dim, start)
    assert not any(_read(bucket_file, 0, (128,)).tolist())


def test_only_a_hotweights_segment_is_opened_for_writes(tmp_path: Any, bucket_file: BucketFile) -> None:
    with opened_for_writes(bucket_file.path) as file:
        file.write(torch.ones(2), 0, (2,))
    assert _read(bucket_file, 0, (2,)).tolist() == [1.0, 1.0]
    other = tmp_path / f"hotweights-1-{'0' * 32}"  # the name of a segment, outside SHM_DIR
    for path in (str(other), "/dev/shm/not-ours", "/etc/passwd"):
        with pytest.raises(ValueError, match="not a hotweights segment"), opened_for_writes(path):
            pass
