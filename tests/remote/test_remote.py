"""A real ``vllm serve`` process on loopback, driven through ``hotweights.connect``: one server for the module
(started with hotweights' worker extension), the trainer in this process; the server is SIGKILLed last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

import hotweights
import hotweights.adapters
import hotweights.handles
from hotweights.handles.pause import PauseOwner
from hotweights.handles.remote import RemoteHandle
from hotweights.testing import PROMPTS
from hotweights.transports import shm
from tests.conftest import poisoned, refused_as
from tests.remote.server import Server, start_server

pytestmark = pytest.mark.engine

TIMEOUT = 20.0
LONG = 480  # tokens: a request still decoding when the install pauses the server


def next_version(engine: RemoteHandle) -> int:
    """One more than the server's version (vLLM starts at "default")."""
    version = engine.get_weight_version()
    return int(version) + 1 if version and version.isdigit() else 1


@pytest.fixture(scope="module")
def server(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # --enable-scale-out: vLLM's token-in/token-out route, whose answers carry the weight versions of their tokens
    log = tmp_path_factory.mktemp("remote-log") / "server.log"
    srv = start_server(models["path"], log, extra=["--enable-scale-out"])
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
    assert engine.facts.num_workers == 1
    assert engine.facts.worker_extension == hotweights.WORKER_EXTENSION
    assert engine.facts.weight_transfer_backend == ""
    assert engine.workers.same_host and engine.workers.default_transport == "shm"
    assert engine.served_model == str(models["path"])
    expected = engine.expected_weights()
    assert expected is not None and set(expected.tensors) == set(models["A"].state_dict())
    assert hotweights.handles.as_engine(engine) is engine
    assert server.completions(PROMPTS) == models["hf"]["A"]
    answer = server.generate(list(PROMPTS[0]))  # before any install: the engine's initial weights
    assert answer["choices"][0]["token_ids"] == models["hf"]["A"][0]
    assert hotweights.weight_version_of(answer) is None


def test_install_a_b_a_matches_hf(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    for version, name in ((1, "B"), (2, "A"), (3, "B")):
        report = hotweights.install(engine, models[name].state_dict(), weight_version=version)
        assert report.adapter == "multiprocess-shm"
        assert report.prefix_cache_reset
        assert report.engine_weight_version == str(version) == engine.get_weight_version()
        assert server.completions(PROMPTS) == models["hf"][name], f"v{version} ({name})"


def test_a_servers_answers_name_the_version_that_produced_them(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """Through ``connect()``: the JSON answer of vLLM's token-in/token-out route carries its tokens' versions, read
    by the same ``weight_version_of`` / ``weight_versions_of`` as an ``LLM``'s outputs."""
    version = next_version(engine)
    hotweights.install(engine, models["B"].state_dict(), weight_version=version)
    answer = server.generate(list(PROMPTS[0]))
    assert answer["choices"][0]["token_ids"] == models["hf"]["B"][0]
    assert hotweights.weight_version_of(answer) == version
    spans = hotweights.weight_versions_of(answer["choices"][0]).spans
    assert [(s.version, s.start, s.end) for s in spans] == [(version, 0, 8)]


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


def test_nan_and_inf_are_refused_by_the_server_with_nothing_written(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    before, outputs = engine.get_weight_version(), server.completions(PROMPTS)
    sd, named = poisoned(dict(models["B"].state_dict()))
    with pytest.raises(hotweights.NonFiniteWeightsError) as info:
        hotweights.install(engine, sd, weight_version=next_version(engine))
    found, text = refused_as(info.value), str(info.value)
    del info
    assert found and found.items() <= named.items() and "checked by the engine's worker" in text
    assert engine.get_weight_version() == before
    assert server.completions(PROMPTS) == outputs


def test_server_error_carries_its_message(engine: RemoteHandle) -> None:
    with pytest.raises(hotweights.InstallError, match="hotweights_no_such_method"):
        engine.workers.call("hotweights_no_such_method", timeout=TIMEOUT)


def test_bytes_transport_is_refused(engine: RemoteHandle, models: dict[str, Any]) -> None:
    adapter = hotweights.adapters.VLLMMultiprocessAdapter(engine, transport="bytes")
    manifest = hotweights.WeightUpdateManifest.from_state_dict(models["A"].state_dict(), weight_version=1)
    with pytest.raises(hotweights.EngineNotSupportedError, match="'shm' transport"):
        adapter.install(manifest, models["A"].state_dict(), force=True)  # whatever the server's version


def test_collective_transport_on_loopback(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    """What a trainer on another host would use (forced here: the server is on loopback)."""
    with hotweights.adapters.VLLMMultiprocessAdapter(engine, transport="collective") as adapter:
        for version, name in ((11, "A"), (12, "B")):
            manifest = hotweights.WeightUpdateManifest.from_state_dict(
                models[name].state_dict(), weight_version=version
            )
            report = adapter.install(manifest, models[name].state_dict())
            assert report.adapter == "multiprocess-collective"
            assert server.completions(PROMPTS) == models["hf"][name]


def _running(server: Server) -> float:
    """Requests the server is decoding now (its Prometheus gauge)."""
    text = httpx.get(f"{server.url}/metrics/", trust_env=False, timeout=10.0, follow_redirects=True).text
    values = [line.split()[-1] for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
    return sum(float(v) for v in values)


def _install_during_a_long_request(
    engine: RemoteHandle, server: Server, tensors: dict[str, torch.Tensor], pause: str
) -> tuple[dict[str, Any], Any]:
    """Start a long completion and install as soon as the server runs it; the request's outcome and the report."""
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0, trust_env=False)
        result.update(answer.json()["choices"][0])

    version = next_version(engine)
    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 10
    while _running(server) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    report = hotweights.install(engine, tensors, weight_version=version, pause=pause)  # type: ignore[arg-type]
    thread.join(60)
    assert report.engine_weight_version == str(version)
    return result, report


# Flaky (it found the request already over in 2 of 4 full-module runs here: the server's running gauge it waits on
# lags, so the install can start before the request is admitted). Kept out of `make test` until it has a fresh
# signal; run it with `pytest -m slow tests/remote/test_remote.py`. The pause modes themselves are covered
# deterministically on an AsyncLLM (tests/engine/test_async_llm.py), the engine behind the server's /pause route.
@pytest.mark.slow
@pytest.mark.parametrize("pause", ["wait", "abort"])
def test_request_in_flight(pause: str, engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    """``wait``: requests never end early, and the install waits for one that is decoding; ``abort``: it ends.

    A 480-token request takes ~1 s here; on two busy cores it can be over before the install pauses the server.
    Such a try proves nothing, so there are up to three."""
    tries = []
    for _ in range(3):
        result, report = _install_during_a_long_request(engine, server, models["A"].state_dict(), pause)
        tries.append((result["finish_reason"], len(result["token_ids"]), round(report.phases["wait_generation"], 3)))
        if pause == "wait":
            assert tries[-1][:2] == ("length", LONG), tries
            if report.phases["wait_generation"] > 0.05:  # it waited for the request to finish
                break
        elif tries[-1][0] == "abort":
            assert tries[-1][1] < LONG, tries
            break
    else:
        pytest.fail(f"the request was never still running when the install paused the server: {tries}")
    assert server.completions(PROMPTS) == models["hf"]["A"]  # resumed, on the new weights


def test_a_trainer_killed_mid_transfer_leaves_the_old_weights_serving(
    engine: RemoteHandle, server: Server, models: dict[str, Any], tmp_path: Path
) -> None:
    """A trainer process SIGKILLed after a few buckets: nothing was installed, the server is not paused, and the
    next install (from another trainer) works."""
    weights = tmp_path / "B.safetensors"
    save_file({k: v.contiguous() for k, v in models["B"].state_dict().items()}, weights)
    hotweights.install(engine, models["A"].state_dict(), weight_version=next_version(engine))
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
    report = hotweights.install(engine, models["B"].state_dict(), weight_version=next_version(engine))
    assert report.engine_weight_version == str(int(before or 0) + 1)
    assert server.completions(PROMPTS) == models["hf"]["B"]


def test_closing_a_handle_releases_the_files_kept_for_the_server(server: Server, models: dict[str, Any]) -> None:
    """The bucket file an install keeps for the next one goes when the trainer closes its handle (before: at exit)."""
    ours = f"hotweights-{os.getpid()}-*"
    before = set(shm.SHM_DIR.glob(ours))
    with hotweights.connect(server.url, timeout=TIMEOUT) as handle:
        hotweights.install(handle, models["A"].state_dict(), weight_version=next_version(handle))
        assert set(shm.SHM_DIR.glob(ours)) - before, "the install keeps its bucket file for the next one"
    assert set(shm.SHM_DIR.glob(ours)) - before == set()
    assert server.completions(PROMPTS) == models["hf"]["A"]


def _paused(server: Server) -> bool:
    return bool(httpx.get(f"{server.url}/is_paused", trust_env=False).json()["is_paused"])


def test_a_server_someone_else_paused_is_installed_into_and_left_paused(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """vLLM reports a paused server as sleeping; the workers say their weights are awake, so the install goes on
    under that pause (no EngineSleepingError) and leaves the server as it found it."""
    httpx.post(f"{server.url}/pause", params={"mode": "wait"}, trust_env=False).raise_for_status()
    try:
        assert httpx.get(f"{server.url}/is_sleeping", trust_env=False).json() == {"is_sleeping": True}
        version = next_version(engine)
        report = hotweights.install(engine, models["A"].state_dict(), weight_version=version)
        assert report.engine_weight_version == str(version)
        assert _paused(server)  # someone else's pause: kept
    finally:
        httpx.post(f"{server.url}/resume", trust_env=False).raise_for_status()
    assert server.completions(PROMPTS) == models["hf"]["A"]


def test_a_pause_left_by_a_killed_trainer_is_lifted_by_the_next_install(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """A trainer SIGKILLed while it held the pause leaves it recorded on the workers: the next trainer's install
    takes it over and resumes the server (before: EngineSleepingError, and only a hand-made POST /resume)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = replace(PauseOwner.mine(), pid=int(dead.stdout), started="1")
    engine.pausing.owner("claim", gone)
    httpx.post(f"{server.url}/pause", params={"mode": "wait"}, trust_env=False).raise_for_status()
    report = hotweights.install(engine, models["B"].state_dict(), weight_version=next_version(engine))
    assert not _paused(server)
    assert engine.pausing.owner() is None  # the record went with the pause
    assert report.engine_weight_version == engine.get_weight_version()
    assert server.completions(PROMPTS) == models["hf"]["B"]


class _DiesAfter(shm.Transport):
    """The shm transport, failing after ``n`` buckets (a trainer that dies mid-transfer)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def send(self, bucket: Any, tensors: Any, stage: Any) -> None:
        if self.left == 0:
            raise RuntimeError("the trainer died mid-transfer")
        self.left -= 1
        super().send(bucket, tensors, stage)


def test_a_failed_write_leaves_the_server_paused_until_an_install_heals_it(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """A streaming install that dies after two buckets (some layers new, some old): the KV cache is zeroed and the
    server stays paused (fails closed); the next install, from another trainer's handle, takes the pause over,
    installs in full and resumes the server."""
    sd = models["A"].state_dict()
    with hotweights.connect(server.url, timeout=TIMEOUT) as first:
        adapter = hotweights.adapters.VLLMMultiprocessAdapter(
            first, transport=_DiesAfter(2), commit="streaming", install_method="direct", bucket_bytes=100_000
        )
        manifest = hotweights.WeightUpdateManifest.from_state_dict(sd, weight_version=next_version(engine))
        with pytest.raises(hotweights.InstallError, match="KV-cache tensors zeroed"):
            adapter.install(manifest, sd)
        assert _paused(server)
        owner = engine.pausing.owner()
        assert owner is not None and owner.failed
    report = hotweights.install(engine, models["B"].state_dict(), weight_version=next_version(engine))
    assert not _paused(server) and engine.pausing.owner() is None
    assert report.engine_weight_version == engine.get_weight_version()
    assert server.completions(PROMPTS) == models["hf"]["B"]


def test_dead_server_raises_a_timeout_error_in_time(
    engine: RemoteHandle, server: Server, models: dict[str, Any]
) -> None:
    """Last: the server is SIGKILLed; installing and connecting fail fast with HotWeightsTimeoutError."""
    server.kill(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(hotweights.HotWeightsTimeoutError, match="cannot reach the server"):
        hotweights.install(engine, models["B"].state_dict(), weight_version=1000)
    with pytest.raises(hotweights.HotWeightsTimeoutError):
        hotweights.connect(server.url, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT
