"""VLLMMultiprocessAdapter and its transports against one real multiprocess tiny vLLM engine (shared by the module)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import hotweights
import hotweights.adapters
from hotweights import (
    DeltaBaseMismatchError,
    ExpectedWeights,
    InstallError,
    NonFiniteWeightsError,
    PartialUpdateError,
    WeightManifestValidationError,
    WeightUpdateManifest,
)
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.core import envelope
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.delta import DeltaBase
from hotweights.testing import build_tiny_model, save_tiny_model
from hotweights.transports import EngineLink, Stage, WeightTransport, make_transport
from hotweights.transports.shm_files import SHM_DIR, sweep_stale
from hotweights.vllm.worker.session import SessionOptions

from ..conftest import poisoned, refused_as
from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
TRANSPORTS = ["shm", "bytes", "collective"]
# q (64 KiB), k and v (32 KiB each) of one layer land in three different buckets.
SMALL_BUCKET = 40_000


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
    stop_engine(llm, wait=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the files hotweights.install's adapter kept for its next install go with the engine, not with this process
    left = sorted(p.name for p in SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))
    assert left == [], f"files outlived their engine: {left}"


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
    assert our_shm() == []


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_vllm_nccl_engine_receives_into_the_session(engine: Engine) -> None:
    """vLLM's own NCCL weight transfer (its packed broadcast and ``NCCLWeightTransferEngine.receive_weights``, over
    gloo on this CPU) delivers each bucket into the session's staging: A -> B -> A equal to fresh engines, every
    bucket received by vLLM's engine class, and a bucket split across vLLM's packed buffers (geometry from the
    trainer) arrives whole."""
    transport = make_transport("vllm_nccl", backend="gloo", buffer_bytes=16 << 10)
    manifest = WeightUpdateManifest.from_state_dict(engine.b.state_dict(), weight_version=0)
    buckets = len(plan_buckets(manifest, SMALL_BUCKET))
    try:
        for ckpt in (engine.b, engine.a, engine.b):
            report = engine.install(ckpt, transport)
            assert report.adapter == "multiprocess-vllm_nccl"
            assert greedy_vllm(engine.llm) == ckpt.fresh
        (status,) = engine.llm.collective_rpc("hotweights_engine", args=("status",))
        # each install's adapter connects anew: the count is the last install's
        assert status["vllm_nccl"] == {"engine": "NCCLWeightTransferEngine", "backend": "gloo", "buckets": buckets}
    finally:
        transport.close()
    (status,) = engine.llm.collective_rpc("hotweights_engine", args=("status",))
    assert status["vllm_nccl"] == {}
    engine.install(engine.a)
    assert greedy_vllm(engine.llm) == engine.a.fresh


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """B in bf16 (the trainer's tensors), and what a fresh fp32 engine on B's bf16 checkpoint serves."""
    model = build_tiny_model("qwen2", 2, dtype=torch.bfloat16)
    path = save_tiny_model(model, tmp_path_factory.mktemp("qwen2-bf16-B"))
    reference = start_engine(path, dtype="float32", multiprocess=False)
    try:
        return dict(model.state_dict()), greedy_vllm(reference)
    finally:
        stop_engine(reference)


@pytest.mark.parametrize("path", ["extension", "zero-config"])
def test_cast_engine_through_the_transport_and_the_zero_config_path(
    engine: Engine, half: tuple[dict[str, torch.Tensor], list[list[int]]], path: str
) -> None:
    """bf16 trainer tensors into this fp32 engine with cast="engine": cast bucket by bucket on the way in, the
    engine then serves what a fresh fp32 engine on the bf16 checkpoint serves."""
    sd, expected = half
    assert expected != engine.a.fresh
    adapter = engine.adapter("shm") if path == "extension" else hotweights.adapters.VLLMWeightsPathAdapter(engine.llm)
    adapter.active_weight_version = engine._version
    engine.install(engine.a)
    with pytest.raises(WeightManifestValidationError, match='cast="engine"'):
        hotweights.install(engine.llm, sd, weight_version=engine.version(), adapter=adapter)
    report = hotweights.install(engine.llm, sd, weight_version=engine.version(), adapter=adapter, cast="engine")
    assert report.cast_tensors == len(sd)
    assert report.num_bytes == 2 * sum(t.nbytes for t in sd.values())  # counted as installed: fp32
    assert greedy_vllm(engine.llm) == expected
    engine.install(engine.a)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert our_shm() == []


@pytest.mark.parametrize("buckets", ["one-call", "split"])
def test_the_worker_checks_what_the_trainer_could_not(engine: Engine, buckets: str) -> None:
    """An engine whose checkpoint the trainer cannot read (a Hub id elsewhere, a remote server): every worker checks
    the manifest against the checkpoint it serves at begin; the refusal comes back typed, nothing was written."""
    engine.install(engine.a)
    adapter = engine.adapter("shm", bucket_bytes=64 << 20 if buckets == "one-call" else SMALL_BUCKET)
    adapter.expected = None  # what the trainer knows of such an engine
    sd = engine.b.state_dict()
    q, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    bad = {n: t for n, t in sd.items() if n != norm} | {q: sd[q][:-1]}
    version = engine.llm.llm_engine.get_weight_version()
    with pytest.raises(WeightManifestValidationError, match="checked by the engine's worker") as info:
        adapter.install(WeightUpdateManifest.from_state_dict(bad, weight_version=engine.version()), bad)
    assert {(m.kind, m.name) for m in info.value.mismatches} == {("shape", q), ("missing", norm)}
    assert engine.llm.llm_engine.get_weight_version() == version
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert our_shm() == []
    report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
    assert report.num_tensors == len(sd)
    assert greedy_vllm(engine.llm) == engine.b.fresh


def _truncated(d: dict[str, Any]) -> dict[str, Any]:
    """A descriptor's wire form with its payload 8 bytes short (where it carries one)."""
    return {**d, "data": d["data"][:-8]} if "data" in d else d


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
            self.inner.send(bucket, tensors, lambda d: stage(_truncated(d.to_wire())))
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
    assert our_shm() == []
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
    kept = sorted(p.name for p in SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))
    assert kept, "the engine's adapter keeps its bucket file for the next install (released with the engine)"


# ---------------------------------------------------------------------------------------------- faults
class RemoteSenderTransport(WeightTransport):
    """Buckets packed by another process (a separate trainer process), which the test may kill at any time."""

    name = "shm"  # type: ignore[assignment]

    def __init__(self, weights_file: Path, delay: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("remote_sender.py")), str(weights_file), str(delay)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(bucket.model_dump_json() + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            raise ConnectionError("sender process died") from exc
        if not line:
            raise ConnectionError("sender process died")
        stage(json.loads(line))
        self.proc.stdin.write("ack\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@contextlib.contextmanager
def _sender_killed_at_random(weights: Path, rng: random.Random) -> Iterator[RemoteSenderTransport]:
    """A remote sender that a timer SIGKILLs within 0.1 s; afterwards: reaped, and its shm segments swept."""
    transport = RemoteSenderTransport(weights, delay=0.004)
    killer = threading.Timer(rng.uniform(0.0, 0.1), transport.proc.kill)
    killer.start()
    try:
        yield transport
    finally:
        killer.join()
        transport.close()
    sweep_stale()  # what the next shm transport does: segments of dead senders go
    assert not list(Path(SHM_DIR).glob(f"hotweights-{transport.proc.pid}-*"))
    assert transport.proc.poll() is not None  # reaped, not leaked


def test_sender_killed_at_random_points(engine: Engine, tmp_path: Path) -> None:
    """>= 20 kills of the sending process mid-install (kills that land after it finished do not count): previous
    weights serve, the version is unchanged, nothing is left in /dev/shm, no process leaks, the next install works."""
    weights_b = tmp_path / "b.safetensors"
    save_file(engine.b.state_dict(), str(weights_b))
    engine.install(engine.a)
    rng = random.Random(0)
    outcomes = {"refused": 0, "installed": 0}
    kills = attempts = 0
    while outcomes["refused"] < 20 and attempts < 60:
        attempts += 1
        sd = engine.b.state_dict()
        with _sender_killed_at_random(weights_b, rng) as transport:
            adapter = engine.adapter(transport, bucket_bytes=SMALL_BUCKET)
            try:
                adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
                outcomes["installed"] += 1
                assert greedy_vllm(engine.llm) == engine.b.fresh
                engine.install(engine.a)  # back to A for the next round
            except InstallError as exc:
                assert isinstance(exc.__cause__, ConnectionError)
                outcomes["refused"] += 1
                assert greedy_vllm(engine.llm) == engine.a.fresh
                assert engine.llm.llm_engine.get_weight_version() == str(engine._version - 1)
                engine._version -= 1  # the refused version was never installed
        kills += transport.proc.returncode == -signal.SIGKILL
    assert outcomes["refused"] >= 20, outcomes
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.fresh
    print(f"\nsender kills: {kills}; outcomes: {outcomes}")


@pytest.mark.parametrize("method", ["reload", "direct"])
def test_sender_killed_mid_streaming_install(engine: Engine, tmp_path: Path, method: str) -> None:
    """Streaming: a sender killed after some buckets went in leaves a partial update. Generation is then refused
    (fail closed) until a full install, which serves exactly the installed weights again; nothing leaks."""
    weights_b = tmp_path / "b.safetensors"
    save_file(engine.b.state_dict(), str(weights_b))
    engine.install(engine.a)
    rng = random.Random(1)
    outcomes = {"partial": 0, "untouched": 0, "installed": 0}
    attempts = 0
    while outcomes["partial"] < 5 and attempts < 30:
        attempts += 1
        sd = engine.b.state_dict()
        with _sender_killed_at_random(weights_b, rng) as transport:
            adapter = _streaming(engine, transport, method)
            try:
                adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
                outcomes["installed"] += 1
                assert greedy_vllm(engine.llm) == engine.b.fresh
            except InstallError as exc:
                assert isinstance(exc.__cause__, ConnectionError)
                engine._version -= 1  # never installed
                assert engine.llm.llm_engine.get_weight_version() == str(engine._version)
                if "Some layers may hold new weights" in str(exc):
                    outcomes["partial"] += 1
                    with pytest.raises(PartialUpdateError):
                        greedy_vllm(engine.llm)
                else:
                    outcomes["untouched"] += 1
                    assert greedy_vllm(engine.llm) == engine.a.fresh
        engine.install(engine.a)  # a full install heals whatever happened
        assert greedy_vllm(engine.llm) == engine.a.fresh
    assert outcomes["partial"] >= 5, outcomes
    print(f"\nstreaming {method} outcomes: {outcomes}")


def test_no_pickle_anywhere(engine: Engine) -> None:
    """Installs above ran with insecure serialization off; a callable RPC (pickle) is indeed refused here."""
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
    with pytest.raises(Exception, match=r"(?i)serializ|pickle"):
        engine.llm.collective_rpc(len)
    engine.install(engine.a, "bytes")
    assert greedy_vllm(engine.llm) == engine.a.fresh


class FlipByteTransport(WeightTransport):
    """The bytes transport, with one byte of the first bucket flipped on the wire."""

    name = "bytes"  # type: ignore[assignment]

    def __init__(self) -> None:
        self.inner = make_transport("bytes")
        self.flipped = False

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        def corrupt(typed: Any) -> None:
            d = typed.to_wire()  # as it crosses the RPC
            data = bytearray(d["data"])
            if not self.flipped and data:
                data[len(data) // 2] ^= 0x10
                self.flipped = True
            stage({**d, "data": bytes(data)})

        self.inner.send(bucket, tensors, corrupt)


def test_digests_verified_after_transit_and_flipped_byte_refused(engine: Engine) -> None:
    engine.install(engine.a)
    version = engine._version
    sd = engine.b.state_dict()
    flip = FlipByteTransport()
    with pytest.raises(InstallError, match="digest mismatch"):
        engine.adapter(flip).install(
            WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1, digests=True), sd
        )
    assert flip.flipped
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert engine.llm.llm_engine.get_weight_version() == str(version)
    # A clean transfer of the same update: every digest checked by the workers, then installed.
    report = engine.adapter("shm").install(
        WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version(), digests=True), sd
    )
    assert report.digests_verified == len(sd)
    assert greedy_vllm(engine.llm) == engine.b.fresh


def test_direct_setter_through_the_worker_extension(engine: Engine) -> None:
    """Staged buckets (q/k/v split across them) installed by the direct setter inside the worker."""
    for ckpt in (engine.b, engine.a):
        sd = ckpt.state_dict()
        adapter = VLLMMultiprocessAdapter(
            engine.llm, transport="shm", bucket_bytes=SMALL_BUCKET, install_method="direct"
        )
        adapter.active_weight_version = engine._version
        report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
        assert report.adapter == "multiprocess-shm-direct"
        assert greedy_vllm(engine.llm) == ckpt.fresh


# ---------------------------------------------------------------------------------------------- streaming commit
def _streaming(
    engine: Engine,
    transport: str | WeightTransport,
    method: str = "reload",
    bucket_bytes: int = SMALL_BUCKET,
    commit: str = "streaming",
) -> VLLMMultiprocessAdapter:
    adapter = VLLMMultiprocessAdapter(
        engine.llm, transport=transport, bucket_bytes=bucket_bytes, install_method=method, commit=commit
    )
    adapter.active_weight_version = engine._version
    return adapter


@pytest.mark.parametrize(
    ("transport", "method", "bucket_bytes"),
    [
        ("shm", "reload", SMALL_BUCKET),  # q, k, v of one layer in different buckets: vLLM buffers the layer
        ("shm", "reload", 1 << 20),  # whole layers per bucket
        ("shm", "direct", SMALL_BUCKET),  # the direct stream holds q and k until v arrives
        ("bytes", "direct", 1 << 20),
        ("collective", "reload", 1 << 20),
    ],
)
def test_streaming_a_to_b_to_a(engine: Engine, transport: str, method: str, bucket_bytes: int) -> None:
    for ckpt in (engine.b, engine.a, engine.b):
        sd = ckpt.state_dict()
        adapter = _streaming(engine, transport, method, bucket_bytes)
        report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
        direct = "-direct" if method == "direct" else ""
        assert report.adapter == f"multiprocess-{transport}{direct}-streaming"
        assert engine.llm.llm_engine.get_weight_version() == str(report.weight_version)
        assert greedy_vllm(engine.llm) == ckpt.fresh
    assert engine.b.fresh == engine.b.hf
    assert our_shm() == []


def test_streaming_buckets_end_between_layers(engine: Engine) -> None:
    manifest = WeightUpdateManifest.from_state_dict(engine.b.state_dict(), weight_version=1)
    buckets = plan_buckets(manifest, 1 << 20, whole_layers=True)
    layers = [{e.name.split(".")[2] for e in b.entries if e.name.startswith("model.layers.")} for b in buckets]
    assert len(buckets) > 1
    for i, a in enumerate(layers):  # no layer index appears in two buckets
        for b in layers[i + 1 :]:
            assert not a & b


@pytest.mark.parametrize("method", ["reload", "direct"])
def test_streaming_interrupted_is_reported_and_a_full_install_recovers(engine: Engine, method: str) -> None:
    engine.install(engine.a, "shm")
    version = engine._version
    sd = engine.b.state_dict()
    dying = CountingTransport("shm", fail_after=5)  # the embedding and part of layer 0 went in; the rest never
    adapter = _streaming(engine, dying, method)
    with pytest.raises(InstallError, match="Some layers may hold new weights") as info:
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "Install a full update again" in str(info.value)
    assert adapter.active_weight_version == version
    assert engine.llm.llm_engine.get_weight_version() == str(version)
    assert our_shm() == []
    # Fail closed: no generation on a mix of old and new layers until a full install (or an explicit reopen).
    with pytest.raises(PartialUpdateError, match="failed while writing"):
        greedy_vllm(engine.llm)
    adapter.reopen_serving()
    # The half-fed layer was put back, not left on vLLM's meta tensors: the engine still generates.
    assert len(greedy_vllm(engine.llm)) == len(engine.a.fresh)
    report = _streaming(engine, "shm", method).install(
        WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd
    )
    engine._version = report.weight_version
    assert greedy_vllm(engine.llm) == engine.b.fresh


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_direct_plan_refused_before_anything_moves(engine: Engine, commit: str) -> None:
    engine.install(engine.a, "shm")
    version = engine._version
    q = "model.layers.0.self_attn.q_proj.weight"
    sd = {q: engine.b.state_dict()[q]}  # q without its k and v: the fused qkv_proj cannot be written
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1)
    counting = CountingTransport("shm")
    adapter = _streaming(engine, counting, "direct", commit=commit)
    adapter.expected = ExpectedWeights(manifest.tensors)  # a partial update passes the trainer-side checks...
    with pytest.raises(WeightManifestValidationError, match="checked by the engine's worker") as info:
        adapter.install(manifest, sd)  # ... not the workers': every tensor of the checkpoint they serve, at begin
    assert {m.kind for m in info.value.mismatches} == {"missing"}
    assert ("missing", "model.layers.0.self_attn.k_proj.weight") in {(m.kind, m.name) for m in info.value.mismatches}
    # streaming: refused at begin, before any byte moves; an atomic one-bucket update into one worker goes in one
    # RPC (begin + stage + finish), so its bucket was written to shared memory, but the model was not touched
    assert counting.sends == (0 if commit == "streaming" else 1)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert engine.llm.llm_engine.get_weight_version() == str(version)


def test_worker_errors_cross_vllms_rpc_typed(engine: Engine) -> None:
    """What a worker raises comes back through vLLM's RPC as text (a plain Exception); its envelope makes it the
    typed error again: a delta whose base the workers do not hold carries the real versions, and a worker error that
    is not hotweights' own arrives as an InstallError naming its type."""
    base = DeltaBase.capture(list(engine.a.state_dict().items()), 5000)
    delta = base.encode(dict(engine.b.state_dict()), weight_version=5001)
    wire = delta.manifest.wire_manifest()
    options = SessionOptions(
        manifest=wire.to_json() if wire is not None else "", delta=delta.manifest.to_json(), method="reload"
    )
    adapter = engine.adapter("shm")
    try:
        with pytest.raises(DeltaBaseMismatchError) as info:
            adapter.wire.begin(options)
        assert (info.value.requested, info.value.base) == (5001, 5000)
        assert not isinstance(info.value.__cause__, hotweights.HotWeightsError)  # it crossed as vLLM's text
        assert f"[{envelope.MARKER}" in str(info.value.__cause__) and envelope.MARKER not in str(info.value)
        with pytest.raises(InstallError) as refused:
            adapter.wire.prepare("no-such-update")
        assert refused.value.origin == "RuntimeError"
        assert str(refused.value).startswith("RuntimeError: no open install session 'no-such-update' on this worker")
    finally:
        adapter.close()
    engine.install(engine.a)  # the engine still installs
    assert greedy_vllm(engine.llm) == engine.a.fresh


# ---------------------------------------------------------------------------------------------- shm kept segments
def test_kept_shm_segments_are_reused_and_released(engine: Engine) -> None:
    transport = make_transport("shm", keep_segments=True)
    adapter = engine.adapter(transport)
    try:
        for ckpt in (engine.b, engine.a, engine.b):
            sd = ckpt.state_dict()
            adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
            assert greedy_vllm(engine.llm) == ckpt.fresh
            assert our_shm() == []  # mapped on both sides, no file left
        kept = len(plan_buckets(WeightUpdateManifest.from_state_dict(sd, weight_version=1), SMALL_BUCKET))
        assert len(transport._kept) == kept  # type: ignore[attr-defined]
    finally:
        adapter.close()
    assert engine.llm.collective_rpc("hotweights_engine", args=("release_segments",)) == [
        0
    ]  # close() released the workers' maps


def test_kept_segments_do_not_combine_with_streaming(engine: Engine) -> None:
    with pytest.raises(ValueError, match="defeats commit='streaming'"):
        VLLMMultiprocessAdapter(engine.llm, transport=make_transport("shm", keep_segments=True), commit="streaming")


def test_streaming_direct_carries_every_bucket_in_one_kept_segment(engine: Engine) -> None:
    """q, k, v split across buckets: the worker copies out the waiting parts, so one segment serves every bucket."""
    transport = make_transport("shm", keep_segments=True)
    adapter = _streaming(engine, transport, "direct")
    try:
        for ckpt in (engine.b, engine.a, engine.b):
            sd = ckpt.state_dict()
            adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
            assert greedy_vllm(engine.llm) == ckpt.fresh
        assert len(transport._kept) == 1  # type: ignore[attr-defined]
        assert our_shm() == []
    finally:
        adapter.close()
    assert engine.llm.collective_rpc("hotweights_engine", args=("release_segments",)) == [0]


class OverlappingShm(WeightTransport):
    """shm whose sends overlap (the installer pipelines them): records how many were alive at once and whether a
    bucket was packed while the one before it was being staged; can fail the stage of bucket ``fail_at``."""

    name = "shm"

    def __init__(self, fail_at: int | None = None) -> None:
        self.inner = make_transport("shm")
        self.lock = threading.Lock()
        self.alive = self.most_alive = 0
        self.staging: set[int] = set()
        self.packed_during_stage = 0
        self.fail_at = fail_at

    @property
    def overlaps(self) -> bool:
        return True

    def connect(self, engine: EngineLink) -> None:
        self.inner.connect(engine)

    def close(self) -> None:
        self.inner.close()

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        with self.lock:
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
            self.packed_during_stage += bucket.index - 1 in self.staging

        def staged(descriptor: dict[str, Any]) -> None:
            with self.lock:
                self.staging.add(bucket.index)
            try:
                if bucket.index == self.fail_at:
                    raise ConnectionError(f"stage of bucket {bucket.index} lost")
                stage(descriptor)
            finally:
                with self.lock:
                    self.staging.discard(bucket.index)

        try:
            self.inner.send(bucket, tensors, staged)
        finally:
            with self.lock:
                self.alive -= 1


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_pipelined_sends_overlap_and_install_exactly(engine: Engine, commit: str) -> None:
    """Buckets are packed while the one before is staged (or, streaming, installed), and the engine then equals a
    fresh one on each checkpoint."""
    for ckpt in (engine.b, engine.a):
        sd = ckpt.state_dict()
        transport = OverlappingShm()
        adapter = VLLMMultiprocessAdapter(
            engine.llm, transport=transport, bucket_bytes=SMALL_BUCKET, commit=commit, buckets_in_flight=3
        )
        adapter.active_weight_version = engine._version
        report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
        assert report.weight_version == engine._version
        assert transport.most_alive >= 2, "no two buckets were in flight at once"
        assert transport.packed_during_stage > 0, "no bucket was packed while the one before it was staged"
        assert greedy_vllm(engine.llm) == ckpt.fresh
    assert our_shm() == []


def test_a_pipelined_install_failing_mid_way_writes_nothing(engine: Engine) -> None:
    engine.install(engine.a, "shm")
    version = engine._version
    sd = engine.b.state_dict()
    transport = OverlappingShm(fail_at=4)
    adapter = VLLMMultiprocessAdapter(engine.llm, transport=transport, bucket_bytes=SMALL_BUCKET, buckets_in_flight=3)
    adapter.active_weight_version = version
    with pytest.raises(InstallError) as info:
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert transport.alive == 0  # every send returned (the waiting ones stopped and removed their files)
    assert engine.llm.llm_engine.get_weight_version() == str(version)
    assert greedy_vllm(engine.llm) == engine.a.fresh
    assert our_shm() == []
    engine.install(engine.b, "shm")
    assert greedy_vllm(engine.llm) == engine.b.fresh


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nan_and_inf_are_refused_by_the_worker_before_anything_is_written(engine: Engine, transport: str) -> None:
    engine.install(engine.a, transport)
    version = engine._version
    assert engine.a.fresh != engine.b.fresh
    sd, named = poisoned(engine.b.state_dict())
    with engine.adapter(transport) as adapter, pytest.raises(NonFiniteWeightsError) as info:
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version + 1), sd)
    found = refused_as(info.value)  # the tensors of the first bucket that holds any, with their counts
    assert found and found.items() <= named.items() and "checked by the engine's worker" in str(info.value)
    assert engine.llm.llm_engine.get_weight_version() == str(version)
    assert greedy_vllm(engine.llm) == engine.a.fresh  # still serving A, not fenced
    assert our_shm() == []


def test_a_nonfinite_delta_is_refused_and_the_next_delta_applies(engine: Engine) -> None:
    adapter = engine.adapter("shm")
    b = engine.b.state_dict()
    assert adapter.install(WeightUpdateManifest.from_state_dict(b, weight_version=engine.version()), b, delta=True)
    sd, named = poisoned(engine.a.state_dict())
    with pytest.raises(NonFiniteWeightsError) as info:
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine._version + 1), sd, delta=True)
    found = refused_as(info.value)
    del info  # its traceback holds the trainer's shared copy of the delta base (a file in /dev/shm)
    # named as they cross: the delta's wire tensors, <name>:values (a few elements) or <name>:full
    assert found and {n.rsplit(":", 1)[0] for n in found} <= set(named)
    assert greedy_vllm(engine.llm) == engine.b.fresh
    a = engine.a.state_dict()
    report = adapter.install(WeightUpdateManifest.from_state_dict(a, weight_version=engine.version()), a, delta=True)
    assert report.delta == "applied" and greedy_vllm(engine.llm) == engine.a.fresh
    adapter.forget_delta_base()
    adapter.close()
    assert our_shm() == []  # the trainer's shared copy went with the delta base


def test_a_nonfinite_bucket_streamed_fails_closed_until_a_full_install(engine: Engine) -> None:
    engine.install(engine.a)
    sd, _ = poisoned(engine.b.state_dict())
    adapter = VLLMMultiprocessAdapter(engine.llm, commit="streaming", bucket_bytes=SMALL_BUCKET)
    adapter.active_weight_version = engine._version
    with adapter, pytest.raises(InstallError, match="NaN") as info:  # earlier buckets went into the live model
        adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine._version + 1), sd)
    assert "nonfinite" in str(info.value) and "Some layers may hold new weights" in str(info.value)
    with pytest.raises(PartialUpdateError):
        greedy_vllm(engine.llm)
    engine.install(engine.b)  # a full install heals it
    assert greedy_vllm(engine.llm) == engine.b.fresh
