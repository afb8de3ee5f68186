"""hotweights as a backend of vLLM's own weight-transfer API (``weight_transfer_config={"backend": "hotweights"}``),
registered through the ``vllm.general_plugins`` entry point, on one real multiprocess engine."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hotweights import InstallError, WeightUpdateManifest
from hotweights.adapters import VLLMWeightTransferAdapter
from hotweights.core.buckets import plan_buckets
from hotweights.transports import make_transport

from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine
from .test_multiprocess import SMALL_BUCKET, CountingTransport

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


class Native:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.llm, self.a, self.b, self.version = llm, a, b, 0

    def adapter(self, transport: Any) -> VLLMWeightTransferAdapter:
        adapter = VLLMWeightTransferAdapter(self.llm, transport=transport, bucket_bytes=SMALL_BUCKET)
        adapter.active_weight_version = self.version
        return adapter

    def install(self, adapter: VLLMWeightTransferAdapter, ckpt: TinyCheckpoint) -> None:
        self.version += 1
        sd = ckpt.state_dict()
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version, digests=True), sd)


@pytest.fixture(scope="module")
def native(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Native]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, weight_transfer_config={"backend": "hotweights"})
    yield Native(llm, a, b)
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_raw_native_flow(native: Native) -> None:
    """What a user of vLLM's API writes by hand: start, update_weights per bucket (JSON + shm path), finish."""
    llm = native.llm
    for ckpt in (native.b, native.a):
        sd = ckpt.state_dict()
        manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=0)
        llm.collective_rpc("start_weight_update")
        with make_transport("shm") as shm:
            for bucket in plan_buckets(manifest, SMALL_BUCKET):
                info = {"update_id": manifest.update_id, "bucket_json": bucket.model_dump_json()}
                if bucket.index == 0:
                    info["manifest_json"] = manifest.to_json()

                def stage(d: dict[str, Any], i: dict[str, Any] = info) -> None:
                    llm.collective_rpc("update_weights", kwargs={"update_info": {**i, "descriptor": d}})

                shm.send(bucket, sd, stage)
        llm.collective_rpc("finish_weight_update")
        llm.reset_prefix_cache()
        assert greedy_vllm(llm) == ckpt.fresh
    assert our_shm() == []


@pytest.mark.parametrize("transport", ["shm", "bytes", "collective"])
def test_adapter_a_to_b_to_a(native: Native, transport: str) -> None:
    adapter = native.adapter(transport)
    for ckpt in (native.b, native.a, native.b):
        native.install(adapter, ckpt)
        assert greedy_vllm(native.llm) == ckpt.fresh
    assert native.llm.llm_engine.get_weight_version() == str(native.version)
    adapter.close()


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_vllm_nccl_engine_under_the_backend(native: Native) -> None:
    """The ``hotweights`` backend joins through vLLM's own NCCL engine (gloo on this CPU): its receive loop stages
    every bucket, the session commits it, A -> B -> A equal to fresh engines."""
    with make_transport("vllm_nccl", backend="gloo", buffer_bytes=16 << 10) as transport:
        adapter = native.adapter(transport)
        for ckpt in (native.b, native.a, native.b):
            native.install(adapter, ckpt)
            assert greedy_vllm(native.llm) == ckpt.fresh
        adapter.close()
    native.install(native.adapter("shm"), native.a)
    assert greedy_vllm(native.llm) == native.a.fresh


def test_collective_reinit_after_trainer_restart(native: Native) -> None:
    first = native.adapter("collective")
    native.install(first, native.a)
    second = native.adapter("collective")  # a restarted trainer: new rendezvous, the stale group is closed first
    native.install(second, native.b)
    assert greedy_vllm(native.llm) == native.b.fresh
    second.close()


def test_interrupted_update_keeps_previous_weights(native: Native) -> None:
    native.install(native.adapter("shm"), native.a)
    dying = CountingTransport("shm", fail_after=4)
    with pytest.raises(InstallError):
        native.install(native.adapter(dying), native.b)
    native.version -= 1
    assert greedy_vllm(native.llm) == native.a.fresh
    assert native.llm.llm_engine.get_weight_version() == str(native.version)
    native.install(native.adapter("shm"), native.b)  # vLLM's session was closed cleanly: the next one works
    assert greedy_vllm(native.llm) == native.b.fresh


def test_kept_shm_segments_are_refused(native: Native) -> None:
    with pytest.raises(ValueError, match="kept shm segments are released through hotweights' worker extension"):
        VLLMWeightTransferAdapter(native.llm, transport=make_transport("shm", keep_segments=True))


class _LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an ``LLM`` in this process (vLLM ships HTTP and Ray ones), plus
    the prefix-cache reset that vLLM's own clients lack."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def test_vllms_trainer_side_api_selects_hotweights_by_its_init_info(native: Native) -> None:
    """A trainer written against vLLM's trainer API (``WeightTransferTrainerFactory.trainer_init`` +
    ``send_weights``) picks the hotweights backend by its init info alone: two rounds from one module whose weights
    change, each equal to a fresh engine, the version recorded; a refused round raises typed and writes nothing."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hotweights import NonFiniteWeightsError, WeightManifestValidationError
    from hotweights.vllm.trainer_backend import HotWeightsTrainerEngine, HotWeightsTrainerInitInfo

    assert native.a.fresh != native.b.fresh
    policy = copy.deepcopy(native.a.model)
    info = HotWeightsTrainerInitInfo(rank=0, bucket_bytes=SMALL_BUCKET, first_version=native.version + 1)
    sender = WeightTransferTrainerFactory.trainer_init(info, client=_LLMClient(native.llm), source=ModuleSource(policy))
    assert isinstance(sender, HotWeightsTrainerEngine)
    for ckpt in (native.b, native.a):
        policy.load_state_dict(ckpt.state_dict())  # the optimizer's step
        sender.send_weights()
        native.version += 1
        assert greedy_vllm(native.llm) == ckpt.fresh
        assert native.llm.llm_engine.get_weight_version() == str(native.version)
    with torch.no_grad():
        policy.model.norm.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteWeightsError, match=r"model\.norm\.weight"):
        sender.send_weights(weight_version=native.version + 1)
    with torch.no_grad():
        policy.model.norm.weight.copy_(native.b.state_dict()["model.norm.weight"])
        policy.model.embed_tokens.weight = torch.nn.Parameter(policy.model.embed_tokens.weight[:-1].clone())
    with pytest.raises(WeightManifestValidationError, match=r"model\.embed_tokens\.weight"):
        sender.send_weights(weight_version=native.version + 1)
    assert greedy_vllm(native.llm) == native.a.fresh  # refused twice: A serves, at its version
    assert native.llm.llm_engine.get_weight_version() == str(native.version)
    sender.shutdown()
    assert our_shm() == []
