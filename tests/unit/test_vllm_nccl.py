"""The staging target vLLM's NCCL engine loads into (:mod:`hotweights.vllm.nccl`), and the CPU stand-in for NCCL."""

from __future__ import annotations

import pytest
import torch

from hotweights.core.buckets import plan_buckets, unpack
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.vllm import nccl
from hotweights.vllm.nccl_gloo import nccl_transfer_as


def _bucket() -> tuple[dict[str, torch.Tensor], WeightUpdateManifest, nccl.BucketTarget]:
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(7)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    (bucket,) = plan_buckets(manifest, 1 << 20)
    return tensors, manifest, nccl.BucketTarget(bucket, manifest, torch.device("cpu"))


def test_target_lays_out_the_bucket_as_staging_reads_it() -> None:
    tensors, manifest, target = _bucket()
    (bucket,) = plan_buckets(manifest, 1 << 20)
    assert target.load_weights([("b", tensors["b"])]) == {"b"}
    assert target.missing() == ["a", "c"]
    target.load_weights([("c", tensors["c"]), ("a", tensors["a"])])
    assert target.missing() == []
    got = dict(unpack(target.buffer, bucket, manifest))
    assert all(torch.equal(got[n], tensors[n]) for n in tensors)


@pytest.mark.parametrize(
    ("delivery", "match"),
    [
        ([("x", torch.zeros(1))], "'x' though the bucket does not list it"),
        ([("a", torch.zeros(3, 4)), ("a", torch.zeros(3, 4))], "'a' twice"),
        ([("a", torch.zeros(4, 3))], r"'a' as \(4, 3\) torch.float32, the manifest says \(3, 4\)"),
        ([("b", torch.zeros(5, dtype=torch.int32))], "torch.int32, the manifest says"),
    ],
)
def test_target_refuses_what_the_manifest_does_not_say(delivery: list[tuple[str, torch.Tensor]], match: str) -> None:
    _, _, target = _bucket()
    with pytest.raises(ValueError, match=match):
        target.load_weights(delivery)


@pytest.mark.parametrize(("size", "count"), [(1 << 31, 2), (16 << 10, 0), (16 << 10, 9), (True, 2), (1 << 20, 2.0)])
def test_a_trainer_cannot_make_a_worker_allocate_beyond_bounds(size: object, count: object) -> None:
    with pytest.raises(ValueError, match="must be an integer in"):
        nccl._check_geometry(size, count)


def test_the_gloo_stand_in_is_put_back() -> None:
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    def swapped() -> tuple[object, ...]:
        return (
            nccl_common.stateless_init_process_group,
            packed_tensor._get_streams,
            torch.accelerator.current_device_index,
        )

    before = swapped()
    with nccl_transfer_as("gloo"), nccl_transfer_as("gloo"):
        assert nccl_common.stateless_init_process_group is not before[0]
        assert torch.accelerator.current_device_index() == 0
    assert swapped() == before
    with pytest.raises(Exception, match="use backend='nccl'"), nccl_transfer_as("tcp"):
        pass


def test_nccl_without_a_gpu_is_refused_typed() -> None:
    from hotweights import EngineNotSupportedError
    from hotweights.transports import make_transport

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineNotSupportedError, match="needs a CUDA GPU"):
        make_transport("vllm_nccl")
