"""VLLMMultiprocessAdapter and its transports against one real multiprocess tiny vLLM engine (shared by the module)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import (
    InstallError,
    VLLMMultiprocessAdapter,
    WeightManifestValidationError,
    WeightTransport,
    WeightUpdateManifest,
)
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.transports import EngineLink, Stage, make_transport
from hotweights.transports.shm import SHM_DIR

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
TRANSPORTS = ["shm", "bytes", "collective"]
# q (64 KiB), k and v (32 KiB each) of one layer land in three different buckets.
SMALL_BUCKET = 40_000


def _our_segments() -> list[str]:
    """Segments this test process created and left behind (other processes may be installing too)."""
    return sorted(p.name for p in Path(SHM_DIR).glob(f"hotweights-{os.getpid()}-*"))


class Engine:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.llm, self.a, self.b = llm, a, b
        self._version = 0

    def version(self) -> int:
        self._version += 1
        return self._version

    def adapter(self, transport: str | WeightTransport, bucket_bytes: int = SMALL_BUCKET) -> VLLMMultiprocessAdapter:
        adapter = VLLMMultiprocessAdapter(self.llm, transport=transport, bucket_bytes=bucket_bytes)
        adapter.active_weight_version = self._version  # one engine, several adapters: share the version line
        return adapter

    def install(self, ckpt: TinyCheckpoint, transport: str | WeightTransport = "shm") -> hotweights.InstallReport:
        sd = ckpt.state_dict()
        adapter = self.adapter(transport)
        return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version()), sd)


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Engine]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
    yield Engine(llm, a, b)
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_split_qkv_plan_is_really_split(engine: Engine) -> None:
    manifest = WeightUpdateManifest.from_state_dict(engine.b.state_dict(), weight_version=1)
    where = {e.name: b.index for b in plan_buckets(manifest, SMALL_BUCKET) for e in b.entries}
    layer = "model.layers.0.self_attn."
    assert len({where[layer + p + "_proj.weight"] for p in "qkv"}) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_to_b_to_a_with_split_buckets(engine: Engine, transport: str) -> None:
    report = engine.install(engine.b, transport)
    assert report.adapter == f"multiprocess-{transport}"
    assert engine.llm.llm_engine.get_weight_version() == str(report.weight_version)
    assert greedy_vllm(engine.llm) == engine.b.fresh == engine.b.hf
    engine.install(engine.a, transport)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    engine.install(engine.b, transport)
    assert greedy_vllm(engine.llm) == engine.b.fresh
    assert _our_segments() == []


class CountingTransport(WeightTransport):
    """A real transport that counts sends and can fail after ``fail_after`` of them (simulating a crash)."""

    def __init__(self, inner: str, fail_after: int | None = None, corrupt: bool = False) -> None:
        self.inner = make_transport(inner)
        self.name = inner  # type: ignore[misc]
        self.sends = 0
        self.fail_after = fail_after
        self.corrupt = corrupt

    def connect(self, engine: EngineLink) -> None:
        self.inner.connect(engine)

    def close(self) -> None:
        self.inner.close()

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self.fail_after is not None and self.sends >= self.fail_after:
            raise ConnectionError(f"transport died after {self.sends} buckets")
        self.sends += 1
        if self.corrupt:  # truncate the payload: the worker must refuse it against the manifest
            self.inner.send(bucket, tensors, lambda d: stage({**d, "data": d["data"][:-8]} if "data" in d else d))
        else:
            self.inner.send(bucket, tensors, stage)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_update_refused_before_anything_moves(engine: Engine, transport: str) -> None:
    engine.install(engine.a, transport)
    version = engine._version
    sd = engine.b.state_dict()
    sd.pop("model.norm.weight")
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:10]
    counting = CountingTransport(transport)
    with pytest.raises(WeightManifestValidationError) as info:
        engine.adapter(counting).install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd)
    assert {m.kind for m in info.value.mismatches} == {"missing", "shape"}
    assert counting.sends == 0
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert engine.llm.llm_engine.get_weight_version() == str(version)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_interrupted_session_keeps_previous_weights(engine: Engine, transport: str) -> None:
    engine.install(engine.a, transport)
    version = engine._version
    sd = engine.b.state_dict()
    dying = CountingTransport(transport, fail_after=5)  # q of layer 0 arrived, k/v never do
    adapter = engine.adapter(dying)
    with pytest.raises(InstallError) as info:
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert dying.sends == 5
    assert adapter.active_weight_version == version
    assert engine.llm.llm_engine.get_weight_version() == str(version)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert _our_segments() == []
    engine.install(engine.b, transport)  # the next install succeeds
    assert greedy_vllm(engine.llm) == engine.b.fresh


def test_truncated_bytes_payload_refused_by_worker(engine: Engine) -> None:
    engine.install(engine.a, "bytes")
    version = engine._version
    sd = engine.b.state_dict()
    with pytest.raises(InstallError, match="bytes"):
        engine.adapter(CountingTransport("bytes", corrupt=True)).install(
            WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd
        )
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert engine.llm.llm_engine.get_weight_version() == str(version)


def test_one_call_install_picks_shared_memory(engine: Engine) -> None:
    v = engine.version() + 1000
    report = hotweights.install(engine.llm, engine.a.state_dict(), weight_version=v)
    assert report.adapter == "multiprocess-shm"
    assert greedy_vllm(engine.llm) == engine.a.fresh
    engine._version = v


def test_native_vllm_weight_transfer_backend(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    """vLLM's own init/start/update/finish flow with hotweights' registered backend and shm buckets."""
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, weight_transfer_config={"backend": "hotweights"})
    try:
        llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        for ckpt, version in ((b, 1), (a, 2)):
            sd = ckpt.state_dict()
            manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=version)
            llm.collective_rpc("start_weight_update")
            with make_transport("shm") as shm:
                for bucket in plan_buckets(manifest, SMALL_BUCKET):
                    info = {"update_id": manifest.update_id, "bucket_json": bucket.model_dump_json()}
                    if bucket.index == 0:
                        info["manifest_json"] = manifest.to_json()
                    shm.send(
                        bucket,
                        sd,
                        lambda d, i=info: llm.collective_rpc(
                            "update_weights", kwargs={"update_info": {**i, "descriptor": d}}
                        ),
                    )
            llm.collective_rpc("finish_weight_update")
            llm.reset_prefix_cache()
            assert greedy_vllm(llm) == ckpt.fresh
        assert _our_segments() == []
    finally:
        stop_engine(llm)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
