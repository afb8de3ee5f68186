"""plan_buckets, pack_into and unpack: the bucket plan, the aligned packing and the engine-side checks."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hotweights.core import buckets as buckets_module
from hotweights.core.buckets import (
    ALIGNMENT,
    Bucket,
    BucketEntry,
    bucket_problems,
    default_bucket_bytes,
    layer_key,
    pack_into,
    plan_buckets,
    unpack,
)
from hotweights.core.manifest import WeightUpdateManifest

MiB = 1 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16)


# ---------------------------------------------------------------------------------------------- helpers
def _manifest(tensors: dict[str, torch.Tensor]) -> WeightUpdateManifest:
    return WeightUpdateManifest.from_state_dict(tensors, weight_version=1)


def _names(plan: list[Bucket]) -> list[list[str]]:
    return [[e.name for e in b.entries] for b in plan]


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic non-trivial contents (no NaN, so ``torch.equal`` is a bit-exact check)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=dtype)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_plan(plan: list[Bucket], manifest: WeightUpdateManifest, limit: int) -> None:
    """Every invariant of a plan, against the manifest it came from."""
    # order preserved, every tensor exactly once
    assert [e.name for b in plan for e in b.entries] == list(manifest.tensors)
    assert [b.index for b in plan] == list(range(len(plan)))
    for b in plan:
        assert b.entries, f"bucket {b.index} is empty"
        end = 0
        for e in b.entries:
            assert e.offset % ALIGNMENT == 0, (b.index, e)
            assert e.offset >= end, f"{e.name} overlaps the previous entry in bucket {b.index}"
            assert e.nbytes == manifest.tensors[e.name].expected_nbytes
            end = e.offset + e.nbytes
        assert b.nbytes == b.entries[-1].offset + b.entries[-1].nbytes
        # only a tensor alone in its bucket may exceed the limit
        assert len(b.entries) == 1 or b.nbytes <= limit, (b.index, b.nbytes, limit)
        if len(b.entries) == 1 and b.entries[0].nbytes > limit:
            assert b.entries[0].offset == 0


def _round_trip(plan: list[Bucket], manifest: WeightUpdateManifest, tensors: dict[str, torch.Tensor]) -> None:
    seen: dict[str, torch.Tensor] = {}
    for b in plan:
        buffer = torch.full((b.nbytes,), 0xA5, dtype=torch.uint8)
        pack_into(buffer, b, tensors)
        # padding between entries is untouched
        covered = torch.zeros(b.nbytes, dtype=torch.bool)
        for e in b.entries:
            covered[e.offset : e.offset + e.nbytes] = True
        assert bool((buffer[~covered] == 0xA5).all())
        for name, view in unpack(buffer, b, manifest):
            assert name not in seen
            seen[name] = view.clone()
    assert list(seen) == list(tensors)
    for name, original in tensors.items():
        got = seen[name]
        assert got.dtype == original.dtype, name
        assert got.shape == original.shape, name
        assert torch.equal(got, original), name
        assert _raw(got) == _raw(original), name


# ---------------------------------------------------------------------------------------------- plan_buckets
class TestPlanBuckets:
    def test_docstring_example(self) -> None:
        m = _manifest({"a": torch.zeros(10), "b": torch.zeros(10)})
        assert _names(plan_buckets(m, bucket_bytes=64)) == [["a"], ["b"]]

    def test_two_tensors_share_a_bucket_exactly_when_they_fit_after_alignment(self) -> None:
        m = _manifest({"a": torch.zeros(10), "b": torch.zeros(10)})  # 40 bytes each; b would start at 64
        (only,) = plan_buckets(m, bucket_bytes=104)
        assert [(e.name, e.offset, e.nbytes) for e in only.entries] == [("a", 0, 40), ("b", 64, 40)]
        assert only.nbytes == 104
        split = plan_buckets(m, bucket_bytes=103)
        assert [(b.index, b.nbytes, [(e.name, e.offset) for e in b.entries]) for b in split] == [
            (0, 40, [("a", 0)]),
            (1, 40, [("b", 0)]),
        ]

    def test_order_is_preserved_and_each_tensor_appears_once(self) -> None:
        names = [f"layer.{i}.w" for i in (5, 1, 9, 0, 3, 7)]
        tensors = {n: torch.zeros(3 + i, dtype=torch.float16) for i, n in enumerate(names)}
        m = _manifest(tensors)
        plan = plan_buckets(m, bucket_bytes=128)
        assert [e.name for b in plan for e in b.entries] == names
        assert len(plan) > 1
        _check_plan(plan, m, 128)

    def test_oversized_tensor_gets_its_own_bucket(self) -> None:
        m = _manifest({"small": torch.zeros(4), "big": torch.zeros(100), "small2": torch.zeros(4)})
        plan = plan_buckets(m, bucket_bytes=100)
        assert _names(plan) == [["small"], ["big"], ["small2"]]
        assert [b.nbytes for b in plan] == [16, 400, 16]
        assert plan[1].entries == (BucketEntry(name="big", offset=0, nbytes=400),)

    def test_first_tensor_oversized(self) -> None:
        m = _manifest({"big": torch.zeros(1000, dtype=torch.uint8), "a": torch.zeros(8, dtype=torch.uint8)})
        plan = plan_buckets(m, bucket_bytes=16)
        assert _names(plan) == [["big"], ["a"]]
        assert [b.nbytes for b in plan] == [1000, 8]

    def test_everything_in_one_bucket_when_it_fits(self) -> None:
        tensors = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(2, 2), "c": torch.tensor(1)}
        (only,) = plan_buckets(_manifest(tensors), bucket_bytes=1 << 20)
        assert [(e.name, e.offset, e.nbytes) for e in only.entries] == [("a", 0, 3), ("b", 64, 16), ("c", 128, 8)]
        assert only.nbytes == 136

    def test_whole_layers_ends_buckets_between_blocks(self) -> None:
        names = ["model.embed.weight"] + [f"model.layers.{i}.{p}.weight" for i in range(3) for p in "qkv"]
        m = _manifest({n: torch.zeros(10) for n in names})  # 40 bytes each, 168 bytes per block of three
        greedy = plan_buckets(m, bucket_bytes=256)
        assert _names(greedy)[1] == names[4:8]  # layer 2's q lands next to layer 1, its k and v in the next bucket
        whole = plan_buckets(m, bucket_bytes=256, whole_layers=True)
        assert _names(whole) == [names[:4], names[4:7], names[7:]]
        _check_plan(whole, m, 256)

    def test_whole_layers_splits_a_block_larger_than_a_bucket(self) -> None:
        names = ["lm.weight"] + [f"model.layers.0.{p}.weight" for p in "qkv"]
        m = _manifest({n: torch.zeros(10) for n in names})
        plan = plan_buckets(m, bucket_bytes=104, whole_layers=True)  # the block needs 168 bytes
        assert _names(plan) == [["lm.weight"], names[1:3], names[3:]]

    @pytest.mark.parametrize(
        ("name", "key"),
        [
            ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
            ("transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
            ("model.embed_tokens.weight", "model.embed_tokens"),
            ("lm_head.weight", "lm_head"),
            ("transformer.ln_f.bias", "transformer.ln_f"),  # with transformer.ln_f.weight: one layer
            ("scale", "scale"),
        ],
    )
    def test_layer_key(self, name: str, key: str) -> None:
        assert layer_key(name) == key

    def test_default_bucket_size_is_used_when_none(self) -> None:
        m = _manifest({f"t{i}": torch.zeros(1000) for i in range(20)})  # 80 kB in all, far below 16 MiB
        (only,) = plan_buckets(m)
        assert len(only.entries) == 20

    @pytest.mark.parametrize("bad", [0, -1, -(1 << 30)])
    def test_non_positive_bucket_bytes_is_refused(self, bad: int) -> None:
        m = _manifest({"a": torch.zeros(1)})
        with pytest.raises(ValueError, match=rf"bucket_bytes must be positive, got {bad}"):
            plan_buckets(m, bucket_bytes=bad)

    def test_zero_element_and_scalar_tensors_are_planned(self) -> None:
        tensors = {
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 7),
            "w": torch.zeros(3, dtype=torch.int64),
            "empty2": torch.zeros(0, dtype=torch.bfloat16),
        }
        m = _manifest(tensors)
        (only,) = plan_buckets(m, bucket_bytes=4096)
        assert [(e.name, e.offset, e.nbytes) for e in only.entries] == [
            ("scalar", 0, 4),
            ("empty", 64, 0),
            ("w", 64, 24),
            ("empty2", 128, 0),
        ]
        assert only.nbytes == 128
        _round_trip([only], m, tensors)


class TestDefaultBucketBytes:
    def test_within_bounds(self) -> None:
        n = default_bucket_bytes()
        assert 16 * MiB <= n <= 512 * MiB

    @pytest.mark.parametrize(
        ("pages", "expected"),
        [(1, 16 * MiB), (8 * 1024, 16 * MiB), (64 * 1024, 32 * MiB), (1 << 40, 512 * MiB)],
    )
    def test_an_eighth_of_free_memory_clamped(self, monkeypatch: pytest.MonkeyPatch, pages: int, expected: int) -> None:
        sizes = {"SC_AVPHYS_PAGES": pages, "SC_PAGE_SIZE": 4096}
        monkeypatch.setattr(buckets_module.os, "sysconf", sizes.__getitem__)
        assert default_bucket_bytes() == expected

    def test_falls_back_to_the_cap_without_sysconf(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def unavailable(name: str) -> int:
            raise ValueError(name)

        monkeypatch.setattr(buckets_module.os, "sysconf", unavailable)
        assert default_bucket_bytes() == 512 * MiB
        assert os.sysconf is unavailable  # the patch really was in effect (restored after the test)


# ---------------------------------------------------------------------------------------------- property test
_shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
_specs = st.lists(st.tuples(_shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12)


@given(specs=_specs, bucket_bytes=st.integers(1, 700), seed=st.integers(0, 2**31 - 1))
def test_plan_pack_unpack_property(
    specs: list[tuple[tuple[int, ...], torch.dtype]], bucket_bytes: int, seed: int
) -> None:
    tensors = {f"t{i}": _filled(shape, dtype, seed + i) for i, (shape, dtype) in enumerate(specs)}
    m = _manifest(tensors)
    plan = plan_buckets(m, bucket_bytes=bucket_bytes)
    _check_plan(plan, m, bucket_bytes)
    _round_trip(plan, m, tensors)


@given(
    groups=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1, max_size=6),
    bucket_bytes=st.integers(1, 700),
)
def test_whole_layers_never_split_a_block_that_fits_property(groups: list[list[int]], bucket_bytes: int) -> None:
    tensors = {
        f"model.layers.{i}.p{j}": torch.zeros(n, dtype=torch.uint8)
        for i, sizes in enumerate(groups)
        for j, n in enumerate(sizes)
    }
    m = _manifest(tensors)
    plan = plan_buckets(m, bucket_bytes=bucket_bytes, whole_layers=True)
    _check_plan(plan, m, bucket_bytes)
    where = {e.name: b.index for b in plan for e in b.entries}
    for i, sizes in enumerate(groups):
        span = 0
        for n in sizes:  # the block's bytes packed from offset 0
            span = -(-span // ALIGNMENT) * ALIGNMENT + n
        if span <= bucket_bytes:
            assert len({where[f"model.layers.{i}.p{j}"] for j in range(len(sizes))}) == 1, (i, span)


def test_pack_into_accepts_non_contiguous_sources() -> None:
    base = _filled((4, 6), torch.float32, 7)
    tensors = {"t": base.t(), "s": base[:, ::2]}
    m = _manifest(tensors)
    _round_trip(plan_buckets(m, bucket_bytes=1024), m, tensors)


# ---------------------------------------------------------------------------------------------- unpack refusals
class TestUnpackRefuses:
    """Each bucket below has exactly one defect; the buffer is as large as the bucket declares unless stated."""

    manifest = _manifest({"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.int64)})  # 16 and 24 bytes

    def _consume(self, bucket: Bucket, size: int | None = None) -> tuple[list[str], str]:
        seen: list[str] = []
        buffer = torch.zeros(bucket.nbytes if size is None else size, dtype=torch.uint8)
        with pytest.raises(ValueError) as info:
            for name, _ in unpack(buffer, bucket, self.manifest):
                seen.append(name)
        return seen, str(info.value)

    @staticmethod
    def _bucket(nbytes: int, *entries: tuple[str, int, int], index: int = 0) -> Bucket:
        return Bucket(
            index=index, nbytes=nbytes, entries=tuple(BucketEntry(name=n, offset=o, nbytes=b) for n, o, b in entries)
        )

    def test_a_valid_bucket_unpacks(self) -> None:
        bucket = self._bucket(88, ("a", 0, 16), ("b", 64, 24))
        buffer = torch.zeros(88, dtype=torch.uint8)
        buffer[64:88] = torch.tensor([7, 8, 9], dtype=torch.int64).view(torch.uint8)
        got = dict(unpack(buffer, bucket, self.manifest))
        assert list(got) == ["a", "b"]
        assert got["a"].shape == (4,) and got["a"].dtype == torch.float32
        assert got["b"].shape == (3,) and got["b"].dtype == torch.int64
        assert got["b"].tolist() == [7, 8, 9]
        assert got["b"].data_ptr() == buffer.data_ptr() + 64  # a view, not a copy

    def test_entry_not_in_manifest(self) -> None:
        seen, msg = self._consume(self._bucket(72, ("a", 0, 16), ("ghost", 64, 8), index=3))
        assert seen == []
        assert "'ghost' is not in the manifest" in msg
        assert "bucket 3" in msg

    def test_wrong_nbytes(self) -> None:
        seen, msg = self._consume(self._bucket(84, ("a", 0, 16), ("b", 64, 20)))
        assert seen == []
        assert "'b' has 20 bytes, the manifest says 24" in msg

    def test_misaligned_offset(self) -> None:
        seen, msg = self._consume(self._bucket(56, ("a", 0, 16), ("b", 32, 24)))
        assert seen == []
        assert "'b' at [32, 56)" in msg

    def test_out_of_range_offset(self) -> None:
        seen, msg = self._consume(self._bucket(80, ("a", 0, 16), ("b", 64, 24)))
        assert seen == []
        assert "'b' at [64, 88) is outside the 80-byte" in msg

    def test_buffer_shorter_than_the_bucket(self) -> None:
        seen, msg = self._consume(self._bucket(88, ("a", 0, 16), ("b", 64, 24)), size=80)
        assert seen == []
        assert "80" in msg and "88" in msg

    def test_every_problem_is_named(self) -> None:
        bucket = self._bucket(200, ("x", 0, 4), ("a", 64, 15), ("b", 192, 24), index=1)
        seen, msg = self._consume(bucket)
        assert seen == []
        assert msg.startswith("bucket 1 ")
        assert "'x' is not in the manifest" in msg
        assert "'a' has 15 bytes, the manifest says 16" in msg
        assert "'b' at [192, 216) is outside the 200-byte" in msg


class TestParts:
    """A tensor larger than a bucket, from a source that reads rows alone, travels in parts the engine assembles."""

    @staticmethod
    def manifest() -> tuple[dict[str, torch.Tensor], WeightUpdateManifest]:
        tensors = {"small": torch.arange(4.0), "big": torch.randn(10, 8), "after": torch.randn(3, 2)}
        return tensors, WeightUpdateManifest.from_state_dict(tensors, weight_version=1)

    def test_split_cuts_rows_of_at_most_a_bucket(self) -> None:
        _, m = self.manifest()
        plan = plan_buckets(m, bucket_bytes=96, split=lambda name: name == "big")
        parts = [(e.rows, e.nbytes) for b in plan for e in b.entries if e.name == "big"]
        assert parts == [((0, 3), 96), ((3, 6), 96), ((6, 9), 96), ((9, 10), 32)]
        assert all(b.nbytes <= 96 for b in plan)
        assert all(e.rows is None for b in plan for e in b.entries if e.name != "big")
        whole = plan_buckets(m, bucket_bytes=96)  # without split: one bucket of its own
        assert [e.rows for b in whole for e in b.entries if e.name == "big"] == [None]

    def test_split_is_asked_only_for_tensors_over_a_bucket(self) -> None:
        _, m = self.manifest()
        asked: list[str] = []
        plan_buckets(m, bucket_bytes=96, split=lambda name: asked.append(name) or True)
        assert asked == ["big"]

    def test_parts_pack_from_rows_alone_and_stage_whole(self) -> None:
        from hotweights.vllm.worker.staging import StagingArea

        tensors, m = self.manifest()
        plan = plan_buckets(m, bucket_bytes=96, split=lambda name: name == "big")
        read: list[tuple[str, int, int]] = []

        class Rows(dict[str, torch.Tensor]):
            def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
                read.append((name, start, stop))
                return tensors[name][start:stop]

        source = Rows(tensors)
        staging = StagingArea(owner=None)
        staging.begin(m, check=False)
        for bucket in reversed(plan):  # any order
            buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            pack_into(buffer, bucket, source)
            staging.stage(
                m.update_id,
                bucket.model_dump_json(),
                {"transport": "bytes", "nbytes": bucket.nbytes, "data": buffer.numpy().tobytes()},
            )
        assert sorted(read) == [("big", 0, 3), ("big", 3, 6), ("big", 6, 9), ("big", 9, 10)]
        items, _ = staging.take(m.update_id)
        assert all(torch.equal(dict(items)[n], tensors[n]) for n in tensors)

    def test_staging_refuses_rows_twice_and_wrong_rows(self) -> None:
        from hotweights.vllm.worker.staging import StagingArea

        _, m = self.manifest()
        plan = plan_buckets(m, bucket_bytes=96, split=lambda name: name == "big")
        first = next(b for b in plan if any(e.rows == (0, 3) for e in b.entries))
        staging = StagingArea(owner=None)
        staging.begin(m, check=False)

        def stage(bucket: Bucket) -> None:
            buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            descriptor = {"transport": "bytes", "nbytes": bucket.nbytes, "data": buffer.numpy().tobytes()}
            staging.stage(m.update_id, bucket.model_dump_json(), descriptor)

        stage(first)
        with pytest.raises(ValueError, match=r"'big' rows \(0, 3\) were already staged"):
            stage(first)
        bad = first.model_copy(update={"entries": (first.entries[0].model_copy(update={"rows": (8, 12)}),)})
        with pytest.raises(ValueError, match=r"rows \(8, 12\) are not rows of its shape"):
            stage(bad)
        with pytest.raises(ValueError, match="incomplete"):
            staging.take(m.update_id)

    def test_a_whole_entry_is_written_as_before_parts(self) -> None:
        """An engine running the previous hotweights (its entries forbid unknown keys) reads every bucket without
        parts."""
        _, m = self.manifest()
        for bucket in plan_buckets(m, bucket_bytes=96):
            assert '"rows"' not in bucket.model_dump_json()
            assert Bucket.model_validate_json(bucket.model_dump_json()) == bucket


def test_a_bucket_with_a_gap_no_tensor_accounts_for_is_refused_before_anything_is_allocated() -> None:
    """Found by the RPC fuzzer: five tensors (448 bytes packed) declared into 464 bytes, 112 bytes left between the
    last two. The bound allowed one alignment of slack beyond the tensors' packing; packed back to back from byte 0
    a bucket never needs it, so the worker would have allocated bytes no tensor accounts for."""
    sd = {
        "a": torch.zeros(8, 4),  # 128 bytes
        "b": torch.zeros(4, 4),  # 64
        "c": torch.zeros(6, 4),  # 96 -> 128 aligned
        "d": torch.zeros(2, dtype=torch.int64),  # 16 -> 64
        "e": torch.zeros(4),  # 16
    }
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=1)
    offsets = {"a": 0, "b": 128, "c": 192, "d": 320, "e": 448}  # "e" would be at 384 packed
    entries = tuple(BucketEntry(name=n, offset=offsets[n], nbytes=t.nbytes) for n, t in sd.items())
    gapped = Bucket(index=0, nbytes=464, entries=entries)
    problems = bucket_problems(gapped, manifest, 464)
    assert any("more than its tensors packed need (448)" in p for p in problems), problems
    tight = {**offsets, "e": 384}
    packed = Bucket(
        index=0, nbytes=400, entries=tuple(BucketEntry(name=n, offset=o, nbytes=sd[n].nbytes) for n, o in tight.items())
    )
    assert bucket_problems(packed, manifest, 400) == []
