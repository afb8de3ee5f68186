"""``install(..., cast=...)``: lazy, bucket-by-bucket casting on the way in (pure logic, a recording adapter)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import pytest
import torch

from hotweights import ExpectedWeights, TensorSpec, WeightManifestValidationError, WeightUpdateManifest
from hotweights.adapters.contract import WeightInstallAdapter
from hotweights.core.buckets import pack_into, plan_buckets
from hotweights.core.cast import CastItems, cast_targets, item_names, lazy_mapping
from hotweights.core.report import PhaseTimer


class Recording(WeightInstallAdapter):
    """Receives what an engine would: packs each bucket as a transport does, keeps the bytes."""

    name = "recording"

    def __init__(self, bucket_bytes: int = 1 << 20, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.bucket_bytes = bucket_bytes
        self.manifest: WeightUpdateManifest | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.peak_live_casts = 0

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        self.manifest = manifest
        tensors = lazy_mapping(items)
        live: list[weakref.ref[torch.Tensor]] = []

        class Counting(dict[str, torch.Tensor]):
            def __getitem__(inner, name: str) -> torch.Tensor:
                t = tensors[name]
                live.append(weakref.ref(t))
                self.peak_live_casts = max(self.peak_live_casts, sum(r() is not None for r in live))
                return t

        for bucket in plan_buckets(manifest, self.bucket_bytes):
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
            pack_into(buffer, bucket, Counting())
            for e in bucket.entries:
                spec = manifest.tensors[e.name]
                view = buffer[e.offset : e.offset + e.nbytes].view(spec.torch_dtype).view(spec.shape)
                self.received[e.name] = view.clone()


def _fp32() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(64, 64, generator=g),
        "w2": torch.randn(64, 64, generator=g),
        "ids": torch.arange(8),
        "mask": torch.ones(4, dtype=torch.bool),
    }


def _engine(dtype: str = "bfloat16") -> ExpectedWeights:
    return ExpectedWeights(
        {
            "w1": TensorSpec(shape=(64, 64), dtype=dtype),
            "w2": TensorSpec(shape=(64, 64), dtype=dtype),
            "ids": TensorSpec(shape=(8,), dtype="int64"),
            "mask": TensorSpec(shape=(4,), dtype="bool"),
        }
    )


def test_without_cast_a_dtype_difference_is_refused_naming_the_opt_in() -> None:
    adapter = Recording(expected=_engine())
    tensors = _fp32()
    with pytest.raises(WeightManifestValidationError) as info:
        adapter.install(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), tensors)
    assert {(m.kind, m.name) for m in info.value.mismatches} == {("dtype", "w1"), ("dtype", "w2")}
    assert 'cast="engine"' in str(info.value)
    assert adapter.received == {} and adapter.active_weight_version is None


@pytest.mark.parametrize("cast", [torch.bfloat16, "engine"])
def test_cast_installs_the_engine_dtype_exactly_and_counts_it(cast: torch.dtype | str) -> None:
    adapter = Recording(expected=_engine())
    tensors = _fp32()
    report = adapter.install(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), tensors, cast=cast)  # type: ignore[arg-type]
    assert report.cast_tensors == 2
    assert "2 tensors cast on the way in" in str(report)
    assert report.to_dict()["hotweights/cast_tensors"] == 2
    assert report.num_bytes == 2 * 64 * 64 * 2 + 8 * 8 + 4  # counted after the cast
    for name in ("w1", "w2"):
        assert adapter.received[name].dtype == torch.bfloat16
        assert torch.equal(adapter.received[name], tensors[name].to(torch.bfloat16))
    assert torch.equal(adapter.received["ids"], tensors["ids"])  # integers and bools are never cast
    assert torch.equal(adapter.received["mask"], tensors["mask"])
    assert tensors["w1"].dtype == torch.float32  # the caller's tensors are untouched


def test_cast_runs_bucket_by_bucket() -> None:
    tensors = {f"layers.{i}.w": torch.randn(256, 256) for i in range(8)}  # 256 KiB fp32 each
    expected = ExpectedWeights({n: TensorSpec(shape=(256, 256), dtype="bfloat16") for n in tensors})
    adapter = Recording(bucket_bytes=256 * 256 * 2, expected=expected)  # one bf16 tensor per bucket
    adapter.install(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), tensors, cast="engine")
    assert len(adapter.received) == 8
    assert adapter.peak_live_casts == 1  # never more than one bucket of cast copies alive


def test_cast_with_digests_hashes_the_cast_bytes() -> None:
    adapter = Recording(expected=_engine())
    tensors = _fp32()
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1, digests=True)
    adapter.install(manifest, tensors, cast="engine")
    sent = adapter.manifest
    assert sent is not None and sent.tensors["w1"].dtype == "torch.bfloat16"
    assert sent.digest_mismatches({n: t for n, t in adapter.received.items()}) == []
    assert sent.tensors["w1"].digest != manifest.tensors["w1"].digest


def test_cast_still_checks_the_callers_tensors_against_the_callers_manifest() -> None:
    adapter = Recording(expected=_engine())
    tensors = _fp32()
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1, digests=True)
    tensors["w1"] = tensors["w1"] + 1  # bytes changed after the manifest was built
    with pytest.raises(WeightManifestValidationError) as info:
        adapter.install(manifest, tensors, cast="engine")
    assert [(m.kind, m.name) for m in info.value.mismatches] == [("digest", "w1")]
    assert adapter.received == {}


def test_cast_engine_without_engine_dtypes_and_bad_casts_are_refused() -> None:
    tensors = _fp32()
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    with pytest.raises(ValueError, match="pass the dtype"):
        Recording().install(manifest, tensors, cast="engine")
    with pytest.raises(ValueError, match="floating-point torch dtype"):
        Recording().install(manifest, tensors, cast=torch.int8)
    with pytest.raises(ValueError, match="floating-point torch dtype"):
        Recording().install(manifest, tensors, cast="bf16")  # type: ignore[arg-type]


def test_cast_targets_only_floating_tensors_of_another_dtype() -> None:
    tensors = {**_fp32(), "already": torch.zeros(2, dtype=torch.bfloat16)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    assert cast_targets(manifest, torch.bfloat16, None) == {"w1": torch.bfloat16, "w2": torch.bfloat16}
    fp16 = ExpectedWeights({"w1": TensorSpec(shape=(64, 64), dtype="float16")})
    assert cast_targets(manifest, "engine", fp16) == {"w1": torch.float16}


def test_cast_items_stay_lazy() -> None:
    tensors = _fp32()
    items = CastItems(list(tensors.items()), {"w1": torch.bfloat16})
    assert item_names(items) == list(tensors)
    assert items[0][1].dtype == torch.bfloat16 and items[1][1] is tensors["w2"]
    assert len(items.without({"w1": "tied"})) == 3
    assert isinstance(items[1:], CastItems) and len(items[1:]) == 3
    assert (items.cast_tensors, items.cast_bytes) == (1, 64 * 64 * 4)
