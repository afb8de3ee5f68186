"""A real ``vllm serve`` process on loopback, driven through ``hotweights.connect``: one server for the module
(started with hotweights' worker extension), the trainer in this process; the server is SIGKILLed last."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

import hotweights
from hotweights.handles.remote import RemoteHandle
from hotweights.testing import PROMPTS, build_tiny_model, greedy_hf, save_tiny_model
from hotweights.transports import shm
from tests.remote.server import Server, start_server

pytestmark = pytest.mark.engine

TIMEOUT = 20.0
LONG = 480  # tokens: a request still decoding when the install pauses the server


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    a, b = build_tiny_model("qwen2", 0), build_tiny_model("qwen2", 1)
    path = save_tiny_model(a, tmp_path_factory.mktemp("remote-A"))
    return {"A": a, "B": b, "path": path, "hf": {"A": greedy_hf(a), "B": greedy_hf(b)}}


@pytest.fixture(scope="module")
def server(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(models["path"], tmp_path_factory.mktemp("remote-log") / "server.log")
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def engine(server: Server) -> Iterator[RemoteHandle]:
    handle = hotweights.connect(server.url, timeout=TIMEOUT)
    yield handle
    handle.close()


def test_connect_reads_the_server(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    assert engine.kind == "remote"
    assert engine.num_workers == 1
    assert engine.worker_extension == hotweights.WORKER_EXTENSION
    assert engine.weight_transfer_backend == ""
    assert engine.same_host and engine.default_transport == "shm"
    assert engine.served_model == str(models["path"])
    expected = engine.expected_weights()
    assert expected is not None and set(expected.tensors) == set(models["A"].state_dict())
    assert hotweights.as_engine(engine) is engine
    assert server.completions(PROMPTS) == models["hf"]["A"]


def test_install_a_b_a_matches_hf(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    for version, name in ((1, "B"), (2, "A"), (3, "B")):
        report = hotweights.install(engine, models[name].state_dict(), weight_version=version)
        assert report.adapter == "multiprocess-shm"
        assert report.prefix_cache_reset
        assert report.engine_weight_version == str(version) == engine.get_weight_version()
        assert server.completions(PROMPTS) == models["hf"][name], f"v{version} ({name})"


def test_bad_update_is_refused_with_nothing_written(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    before, outputs = engine.get_weight_version(), server.completions(PROMPTS)
    bad = dict(models["A"].state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(hotweights.WeightManifestValidationError, match=r"model\.norm\.weight"):
        hotweights.install(engine, bad, weight_version=100)
    with pytest.raises(hotweights.StaleWeightVersionError):
        hotweights.install(engine, models["A"].state_dict(), weight_version=1)
    assert engine.get_weight_version() == before
    assert server.completions(PROMPTS) == outputs


def test_server_error_carries_its_message(engine: RemoteHandle) -> None:
    with pytest.raises(hotweights.InstallError, match="hotweights_no_such_method"):
        engine.call("hotweights_no_such_method", timeout=TIMEOUT)


def test_bytes_transport_is_refused(engine: RemoteHandle, models: dict[str, Any]) -> None:
    adapter = hotweights.VLLMMultiprocessAdapter(engine, transport="bytes")
    manifest = hotweights.WeightUpdateManifest.from_state_dict(models["A"].state_dict(), weight_version=1)
    with pytest.raises(hotweights.EngineNotSupportedError, match="'shm' transport"):
        adapter.install(manifest, models["A"].state_dict())


def test_collective_transport_on_loopback(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    """What a trainer on another host would use (forced here: the server is on loopback)."""
    with hotweights.VLLMMultiprocessAdapter(engine, transport="collective") as adapter:
        for version, name in ((11, "A"), (12, "B")):
            manifest = hotweights.WeightUpdateManifest.from_state_dict(
                models[name].state_dict(), weight_version=version
            )
            report = adapter.install(manifest, models[name].state_dict())
            assert report.adapter == "multiprocess-collective"
            assert server.completions(PROMPTS) == models["hf"][name]


@pytest.mark.parametrize("pause", ["wait"])
def test_request_in_flight(pause: str, engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    """``wait``: a request decoding when the install starts finishes first; ``abort``: it ends at once."""
    started, result = threading.Event(), {"tokens": 0, "finish_reason": None}

    def streaming_request() -> None:
        body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60.0, trust_env=False) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                result["tokens"] += len(choice.get("token_ids") or [])
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
                started.set()

    thread = threading.Thread(target=streaming_request)
    thread.start()
    assert started.wait(60)
    version = int(engine.get_weight_version() or 0) + 1
    report = hotweights.install(engine, models["A"].state_dict(), weight_version=version, pause=pause)  # type: ignore[arg-type]
    thread.join(60)
    assert result["finish_reason"] == ("length" if pause == "wait" else "abort")
    assert (result["tokens"] == LONG) == (pause == "wait")
    assert report.engine_weight_version == str(version)
    assert server.completions(PROMPTS) == models["hf"]["A"]  # resumed, on the new weights


def test_a_trainer_killed_mid_transfer_leaves_the_old_weights_serving(
    engine: RemoteHandle, server: Server, models: dict[str, Any], tmp_path: Path
) -> None:
    """A trainer process SIGKILLed after a few buckets: nothing was installed, the server is not paused, and the
    next install (from another trainer) works."""
    weights = tmp_path / "B.safetensors"
    save_file({k: v.contiguous() for k, v in models["B"].state_dict().items()}, weights)
    hotweights.install(engine, models["A"].state_dict(), weight_version=int(engine.get_weight_version() or 0) + 1)
    before = engine.get_weight_version()
    cmd = [sys.executable, str(Path(__file__).with_name("trainer.py")), server.url, str(weights), "999999"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "connected"
        for _ in range(3):
            assert proc.stdout.readline().startswith("bucket ")
    finally:
        proc.kill()
        proc.wait(30)
    shm.sweep_stale()  # what the next Transport() does (after 60 s) for a dead trainer's bucket files
    assert not list(Path("/dev/shm").glob(f"hotweights-{proc.pid}-*"))
    assert engine.get_weight_version() == before
    assert httpx.get(f"{server.url}/is_paused", trust_env=False).json() == {"is_paused": False}
    assert server.completions(PROMPTS) == models["hf"]["A"]
    report = hotweights.install(engine, models["B"].state_dict(), weight_version=int(before or 0) + 1)
    assert report.engine_weight_version == str(int(before or 0) + 1)
    assert server.completions(PROMPTS) == models["hf"]["B"]


def test_dead_server_raises_a_timeout_error_in_time(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """Last: the server is SIGKILLed; installing and connecting fail fast with HotWeightsTimeoutError."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    start = time.monotonic()
    with pytest.raises(hotweights.HotWeightsTimeoutError, match="cannot reach the server"):
        hotweights.install(engine, models["B"].state_dict(), weight_version=1000)
    with pytest.raises(hotweights.HotWeightsTimeoutError):
        hotweights.connect(server.url, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT
