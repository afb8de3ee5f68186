"""CUDA IPC transport: refused clearly without a GPU; a two-process round trip where one is present."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hotweights import HotWeightsError, WeightUpdateManifest
from hotweights.core.buckets import plan_buckets, unpack
from hotweights.transports import available_transports, make_transport


def test_registered() -> None:
    assert "cuda_ipc" in available_transports()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refused_without_cuda_with_what_to_do() -> None:
    with pytest.raises(HotWeightsError, match="needs a CUDA GPU; use 'shm'"):
        make_transport("cuda_ipc")


def _receive(conn: object, manifest_json: str) -> None:  # pragma: no cover - runs in the child
    from hotweights.core.buckets import Bucket
    from hotweights.transports.cuda_ipc import Receiver

    manifest = WeightUpdateManifest.from_json(manifest_json)
    bucket_json, descriptor = conn.recv()  # type: ignore[attr-defined]
    buffer, _ = Receiver.open(Receiver.parse(descriptor))
    got = dict(unpack(buffer, Bucket.model_validate_json(bucket_json), manifest))
    conn.send({k: v.cpu() for k, v in got.items()})  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_process_round_trip_on_gpu() -> None:
    sd = {"w": torch.randn(64, 32, device="cuda"), "b": torch.randn(32, device="cuda").to(torch.bfloat16)}
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(child, manifest.to_json()))
    proc.start()
    (bucket,) = plan_buckets(manifest)
    received: dict[str, torch.Tensor] = {}

    def stage(descriptor: dict[str, object]) -> None:
        parent.send((bucket.model_dump_json(), descriptor))
        received.update(parent.recv())

    make_transport("cuda_ipc").send(bucket, sd, stage)
    proc.join(60)
    assert all(torch.equal(received[k], sd[k].cpu()) for k in sd)
