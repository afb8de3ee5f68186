"""What transports and tensor sources can do is declared on their contracts (the installer asks them, never
``getattr``): a transport's kept segments and rank-writable buckets, a bucket source's parts, order and rank writes."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping

import torch

from hotweights.adapters import installer, sending, session
from hotweights.core.buckets import Bucket, rows_of
from hotweights.core.cast import BucketSource, CastItems, items_of, uncast
from hotweights.transports import Stage, WeightTransport, make_transport


class _Plain(WeightTransport):
    name = "plain-test"

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        stage({"transport": self.name, "nbytes": bucket.nbytes})


def test_a_transport_declares_what_it_can() -> None:
    assert not _Plain().keeps_segments and _Plain().rank_writable() is None  # the contract's defaults
    with make_transport("shm") as shm:
        assert not shm.keeps_segments and shm.rank_writable() is not None  # ranks write into its bucket files
    with make_transport("shm", keep_segments=True) as kept:
        assert kept.keeps_segments and kept.rank_writable() is None  # it writes its one kept segment itself
    with make_transport("bytes") as raw:
        assert not raw.keeps_segments and raw.rank_writable() is None


def test_a_bucket_source_over_plain_tensors_declares_nothing_special() -> None:
    pairs = [("a", torch.arange(6.0).reshape(3, 2)), ("b", torch.ones(2))]
    source = BucketSource.of(dict(pairs))
    assert BucketSource.of(source) is source
    assert source.split is None and not source.reads_in_order and source.rank_writes() is None
    source.parts_at_most(1 << 20)  # nothing to tell a source that reads no parts
    assert torch.equal(source["a"], pairs[0][1]) and list(source) == ["a", "b"]
    assert torch.equal(rows_of(source, "a", 1, 3), pairs[0][1][1:3])
    assert [n for n, _ in items_of(source)] == ["a", "b"] and uncast(pairs) is pairs


def test_a_bucket_source_over_cast_items_casts_each_read() -> None:
    pairs = [("a", torch.arange(4.0))]
    cast = CastItems(pairs, {"a": torch.bfloat16})
    source = BucketSource.of(cast)
    assert source["a"].dtype == torch.bfloat16 and items_of(source) is cast and uncast(cast) == pairs
    assert source.split is None and not source.reads_in_order


def test_the_installer_asks_no_transport_or_source_by_getattr_or_name() -> None:
    tree = ast.parse("\n".join(inspect.getsource(m) for m in (installer, session, sending)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"]
    assert calls == []
    compared = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "shm" for c in n.comparators)
    ]
    assert compared == []
