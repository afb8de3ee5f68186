"""NaN and Inf refused where the bytes already pass: the core check, the worker's staging area (each bucket as it is
staged, by reference in-process) and the whole trainer side against the public fake engine."""

from __future__ import annotations

import pytest
import torch

import hotweights
from hotweights import NonFiniteWeightsError, WeightManifestValidationError
from hotweights.core.buckets import pack_into, plan_buckets
from hotweights.core.finite import nonfinite
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.fake import FakeEngine
from hotweights.vllm.worker.staging import StagingArea

NAN, INF = float("nan"), float("inf")


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.full((8, 4), value), "norm.weight": torch.full((4,), value)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_bad_tensor_is_named_with_its_counts(dtype: torch.dtype) -> None:
    a = torch.zeros(100, dtype=dtype)
    a[3], a[7], a[9] = NAN, INF, -INF
    found = nonfinite([("a", a), ("b", torch.ones(4, dtype=dtype)), ("c", torch.full((2,), NAN, dtype=dtype))])
    assert [(m.kind, m.name, m.actual) for m in found] == [
        ("nonfinite", "a", "1 NaN and 2 Inf among 100 values"),
        ("nonfinite", "c", "2 NaN and 0 Inf among 2 values"),
    ]


def test_a_sum_that_overflows_is_not_a_bad_value() -> None:
    big = torch.full((64,), 60000.0, dtype=torch.float16)  # every value finite, their fp16 sum is not
    assert not torch.isfinite(big.sum())
    assert nonfinite([("big", big)]) == []


def test_integers_empty_and_meta_tensors_are_skipped() -> None:
    items = [("i", torch.arange(4)), ("e", torch.empty(0)), ("m", torch.empty(3, device="meta"))]
    assert nonfinite(items) == []


def test_the_error_is_a_validation_error_that_says_what_to_do() -> None:
    with pytest.raises(NonFiniteWeightsError) as caught:
        hotweights.install(
            FakeEngine(_weights(0.0)), {**_weights(1.0), "norm.weight": torch.full((4,), NAN)}, weight_version=1
        )
    assert isinstance(caught.value, WeightManifestValidationError)
    text = str(caught.value)
    assert "nothing was written" in text and "'norm.weight'" in text and "4 NaN" in text
    assert "allow_nonfinite=True" in text


@pytest.mark.parametrize("transport", ["bytes", "shm"])
def test_a_bad_bucket_is_refused_before_the_commit(transport: str) -> None:
    fake = FakeEngine(_weights(0.0), transport=transport, bucket_bytes=64)
    hotweights.install(fake, _weights(1.0), weight_version=1)
    fake.calls.clear()
    bad = {**_weights(2.0), "norm.weight": torch.tensor([1.0, INF, 2.0, 3.0])}
    with pytest.raises(NonFiniteWeightsError, match=r"'norm\.weight'.*0 NaN and 1 Inf among 4 values"):
        hotweights.install(fake, bad, weight_version=2)
    assert "commit" not in fake.calls and fake.calls[-1] == "abort"
    assert fake.version == 1 and torch.equal(fake.weights["embed.weight"], torch.ones(8, 4))
    with fake.generating():  # still serving, not fenced
        pass


def test_allow_nonfinite_installs_them() -> None:
    fake = FakeEngine(_weights(0.0))
    hotweights.install(fake, _weights(NAN), weight_version=1, allow_nonfinite=True)
    assert fake.version == 1 and torch.isnan(fake.weights["norm.weight"]).all()


def test_the_staging_area_checks_each_bucket_and_tensors_by_reference() -> None:
    tensors = {"a": torch.ones(8), "b": torch.tensor([0.0, NAN, 0.0, 0.0])}
    m = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    staging = StagingArea(owner=None)
    staging.begin(m, check=False)
    for bucket in plan_buckets(m, bucket_bytes=32):  # checked beside the transfer, joined before anything is taken
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_into(buffer, bucket, tensors)
        descriptor = {"transport": "bytes", "nbytes": bucket.nbytes, "data": buffer.numpy().tobytes()}
        staging.stage(m.update_id, bucket.model_dump_json(), descriptor)
    with pytest.raises(NonFiniteWeightsError, match=r"(?s)bucket 1 checked by the engine's worker.*'b'"):
        staging.check_complete(m.update_id)
    staging.check_complete(m.update_id)  # reported once; the caller aborts
    staging.begin(m, check=False)
    with pytest.raises(NonFiniteWeightsError, match=r"'b'"):
        staging.stage_by_reference(m.update_id, list(tensors.items()))
    staging.begin(m, check=False, finite=False)
    staging.stage_by_reference(m.update_id, list(tensors.items()))


@pytest.mark.parametrize("flush", [True, False])
def test_a_deferred_check_is_late_at_worst_never_skipped(flush: bool) -> None:
    """Buckets staged with ``defer_check`` (an in-process stager grouping many small buckets) are checked together
    when flushed, else when the session is taken: a NaN in any of them still refuses the update, naming it."""
    tensors = {"a": torch.ones(8), "b": torch.tensor([0.0, NAN, 0.0, 0.0]), "c": torch.full((4,), INF)}
    m = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    staging = StagingArea(owner=None)
    staging.begin(m, check=False)
    buckets = plan_buckets(m, bucket_bytes=32)
    assert len(buckets) == 3
    for bucket in buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_into(buffer, bucket, tensors)
        descriptor = {"transport": "bytes", "nbytes": bucket.nbytes, "data": buffer.numpy().tobytes()}
        staging.stage(m.update_id, bucket, descriptor, defer_check=True)  # a Bucket: no JSON in-process
    assert staging.current(m.update_id).checks == []  # nothing checked yet
    if flush:
        staging.flush_checks(m.update_id)
        assert len(staging.current(m.update_id).checks) == 1  # one hand-over for the three buckets
    with pytest.raises(NonFiniteWeightsError, match=r"buckets 0-2 checked by the engine's worker") as caught:
        staging.take(m.update_id)
    assert {mm.name: mm.actual for mm in caught.value.mismatches} == {
        "b": "1 NaN and 0 Inf among 4 values",
        "c": "0 NaN and 4 Inf among 4 values",
    }
