"""RemoteHandle against a function-backed HTTP transport (``httpx.MockTransport``): request mapping, set-up
detection, the pause/resume gate and error translation, without a server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import hotweights
import hotweights.handles
from hotweights.handles.remote import RemoteHandle
from hotweights.transports.shm_files import SHM_DIR
from hotweights.vllm.plugin import BACKEND
from hotweights.vllm.worker.session import PROTOCOL

EXT = hotweights.WORKER_EXTENSION


class FakeServer:
    """A vLLM dev-mode server in a dict: records every request, answers from ``routes``."""

    def __init__(
        self, *, extension: str = EXT, backend: str | None = None, server_info: bool = True, sees: str | None = None
    ) -> None:
        self.sees = sees  # "here": its workers read this host's /dev/shm; "elsewhere": they do not; None: cannot say
        self.requests: list[httpx.Request] = []
        self.paused = False
        self.version = "0"
        config = {
            "model_config": {"model": "/nonexistent/model", "dtype": "torch.float32"},
            "parallel_config": {"worker_extension_cls": extension},
            "weight_transfer_config": {"backend": backend} if backend else None,
        }
        self.routes: dict[tuple[str, str], Callable[[httpx.Request], httpx.Response]] = {
            ("GET", "/get_world_size"): lambda r: httpx.Response(200, json={"world_size": 2}),
            ("GET", "/v1/models"): lambda r: httpx.Response(200, json={"data": [{"id": "m", "root": "/x/m"}]}),
            ("POST", "/collective_rpc"): self._rpc,
            ("POST", "/pause"): self._pause,
            ("POST", "/resume"): self._resume,
            ("POST", "/reset_prefix_cache"): lambda r: httpx.Response(200, json={"success": True}),
            ("POST", "/update_weight_version"): self._set_version,
            ("GET", "/weight_info"): lambda r: httpx.Response(200, json={"weight_version": self.version}),
            ("GET", "/is_sleeping"): lambda r: httpx.Response(200, json={"is_sleeping": self.paused}),
        }
        if server_info:
            self.routes["GET", "/server_info"] = lambda r: httpx.Response(200, json={"vllm_config": config})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        return route(request)

    def _rpc(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["method"] == "hotweights_engine" and body["args"][:1] == ["status"]:
            status = {"hotweights": "hotweights", "protocol": PROTOCOL, "weights_asleep": False, "pause_owner": ""}
            return httpx.Response(200, json={"results": [status, status]})
        if body["method"] == "hotweights_engine" and body["args"][:1] == ["sees_shm"] and self.sees is not None:
            name = json.loads(body["args"][1])["name"]
            seen = (SHM_DIR / name).read_text() if self.sees == "here" else ""
            return httpx.Response(200, json={"results": [seen, seen]})
        if body["method"] == "echo":
            return httpx.Response(200, json={"results": [body, body]})
        if body["method"] == "answers_nothing":
            return httpx.Response(200, json={"status": "ok"})
        message = f"Worker failed with error ''CPUWorker' object has no attribute '{body['method']}''"
        return httpx.Response(500, json={"error": {"message": message, "type": "InternalServerError", "code": 500}})

    def _pause(self, request: httpx.Request) -> httpx.Response:
        self.paused = True
        return httpx.Response(200, json={"status": "paused"})

    def _resume(self, request: httpx.Request) -> httpx.Response:
        self.paused = False
        return httpx.Response(200, json={"status": "resumed"})

    def _set_version(self, request: httpx.Request) -> httpx.Response:
        self.version = json.loads(request.content)["new_version"]
        return httpx.Response(200, json={"success": True})

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" + (f"?{r.url.query.decode()}" if r.url.query else "") for r in self.requests]


def connect(server: FakeServer, url: str = "http://127.0.0.1:8000", **kwargs: Any) -> RemoteHandle:
    return hotweights.connect(url, transport=httpx.MockTransport(server), timeout=5.0, **kwargs)


def test_connect_reads_world_size_set_up_and_model() -> None:
    engine = connect(FakeServer())
    facts = engine.facts
    assert (engine.kind, facts.num_workers, facts.worker_extension, facts.weight_transfer_backend) == (
        "remote", 2, EXT, ""
    )  # fmt: skip
    assert engine.served_model == "/nonexistent/model"
    assert engine.expected_weights() is None  # not readable from here
    assert hotweights.handles.as_engine(engine) is engine
    assert "2 worker(s), worker extension" in engine.describe()


def test_backend_set_up_is_detected() -> None:
    engine = connect(FakeServer(extension="", backend=BACKEND))
    assert (engine.facts.worker_extension, engine.facts.weight_transfer_backend) == ("", BACKEND)


def test_without_server_info_the_extension_is_probed() -> None:
    server = FakeServer(server_info=False)
    engine = connect(server)
    assert engine.facts.worker_extension == EXT
    assert engine.served_model == "/x/m"
    assert any("/collective_rpc" in p for p in server.paths())


@pytest.mark.parametrize("server_info", [True, False])
def test_a_server_without_extension_or_backend_is_refused_naming_the_flags(server_info: bool) -> None:
    server = FakeServer(extension="", server_info=server_info)
    if not server_info:
        server.routes["POST", "/collective_rpc"] = lambda r: httpx.Response(500, json={"error": "no attribute"})
    with pytest.raises(hotweights.EngineNotSupportedError) as info:
        connect(server)
    for flag in ("VLLM_SERVER_DEV_MODE=1", "--worker-extension-cls", EXT, "--weight-transfer-config"):
        assert flag in str(info.value)


def test_a_server_without_dev_mode_is_refused_naming_the_flags() -> None:
    server = FakeServer()
    del server.routes["GET", "/get_world_size"]
    with pytest.raises(hotweights.EngineNotSupportedError, match="VLLM_SERVER_DEV_MODE=1") as info:
        connect(server)
    assert "--worker-extension-cls" in str(info.value)


def test_call_posts_collective_rpc_and_returns_one_result_per_worker() -> None:
    engine = connect(FakeServer())
    results = engine.workers.call("echo", "a", 1, timeout=7.0, kwargs={"k": {"x": [1]}})
    assert results[0] == {"method": "echo", "args": ["a", 1], "kwargs": {"k": {"x": [1]}}, "timeout": 7.0}


def test_a_reply_without_results_is_an_error_not_a_guess() -> None:
    from hotweights import InstallError

    engine = connect(FakeServer())
    with pytest.raises(InstallError, match=r"'answers_nothing' without a list of results"):
        engine.workers.call("answers_nothing")


def test_a_server_error_carries_its_message() -> None:
    engine = connect(FakeServer())
    with pytest.raises(hotweights.InstallError, match=r"HTTP 500.*no attribute 'hotweights_nope'"):
        engine.workers.call("hotweights_nope", timeout=5.0)


def test_bytes_cannot_travel_as_json() -> None:
    server = FakeServer()
    engine = connect(server)
    before = len(server.requests)
    with pytest.raises(hotweights.EngineNotSupportedError, match="'shm' transport"):
        engine.workers.call("hotweights_stage", "id", "{}", {"transport": "bytes", "data": bytearray(4), "nbytes": 4})
    assert len(server.requests) == before  # refused before any I/O


def test_api_key_is_sent_as_bearer() -> None:
    server = FakeServer()
    connect(server, api_key="sekrit")
    assert all(r.headers["authorization"] == "Bearer sekrit" for r in server.requests)
    server2 = FakeServer()
    connect(server2)
    assert all("authorization" not in r.headers for r in server2.requests)


def test_unauthorized_names_the_api_key() -> None:
    server = FakeServer()
    server.routes["GET", "/get_world_size"] = lambda r: httpx.Response(401, json={"error": "Unauthorized"})
    with pytest.raises(hotweights.EngineNotSupportedError, match="api_key"):
        connect(server)


@pytest.mark.parametrize(
    ("url", "same_host", "transport"),
    [
        ("http://127.0.0.1:8000", True, "shm"),
        ("http://localhost:8000/", True, "shm"),
        ("http://[::1]:8000", True, "shm"),
        ("unix:///tmp/vllm.sock", True, "shm"),
        ("http://10.1.2.3:8000", False, "collective"),
        ("https://policy.example.com", False, "collective"),
    ],
)
def test_same_host_and_default_transport(url: str, same_host: bool, transport: str) -> None:
    engine = connect(FakeServer(), url=url)
    assert (engine.workers.same_host, engine.workers.default_transport) == (same_host, transport)


@pytest.mark.parametrize(
    ("url", "sees", "same_host"),
    [
        ("http://127.0.0.1:8000", "elsewhere", False),  # a port-forward to another host: loopback proves nothing
        ("http://10.1.2.3:8000", "here", True),  # this host's own address: its workers read the proof file
        ("https://policy.example.com", "elsewhere", False),
    ],
)
def test_same_host_is_what_the_workers_prove_not_what_the_url_says(url: str, sees: str, same_host: bool) -> None:
    engine = connect(FakeServer(sees=sees), url=url)
    assert engine.workers.same_host is same_host
    assert engine.workers.default_transport == ("shm" if same_host else "collective")
    assert not list(SHM_DIR.glob("hotweights-proof-*"))  # the proof file is gone


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://x", "unix://", "http://"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="unix:///"):
        connect(FakeServer(), url=url)


def test_versions_prefix_cache_and_sleep_go_to_their_routes() -> None:
    server = FakeServer()
    engine = connect(server)
    assert engine.set_weight_version("7") == "7" == engine.get_weight_version()
    assert engine.reset_prefix_cache() is True
    assert engine.pausing.weights_asleep() is False
    assert "POST /reset_prefix_cache?reset_running_requests=false" in server.paths()


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_gate_pauses_with_the_mode_and_always_resumes(mode: str) -> None:
    server = FakeServer()
    engine = connect(server)
    engine.set_pause_mode(mode)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="boom"), engine.gate.installing(timeout=5.0):
        assert server.paused
        raise RuntimeError("boom")
    assert not server.paused
    clear = "false" if mode == "keep" else "true"
    assert f"POST /pause?mode={mode}&clear_cache={clear}" in server.paths()


def test_gate_fails_closed_by_staying_paused_until_reopened() -> None:
    server = FakeServer()
    engine = connect(server)
    with engine.gate.installing(timeout=5.0):
        engine.gate.refuse("partial update")
    assert server.paused  # nothing is served from a mix of old and new layers
    assert (
        not engine.pausing.weights_asleep()
    )  # vLLM says a paused server sleeps; this one is paused by hotweights itself
    # another trainer asks the workers: their weights are awake (a paused scheduler is not sleep), so its install may
    # go on under the pause and take it over (the pause record says a failed install left it)
    assert not connect(server).pausing.weights_asleep()
    engine.gate.reopen()
    assert not server.paused
    assert engine.gate.refusal is None


def test_a_successful_install_inside_the_gate_resumes_only_at_its_end() -> None:
    server = FakeServer()
    engine = connect(server)
    engine.gate.refuse("earlier failure")
    with engine.gate.installing(timeout=5.0):
        engine.gate.reopen()  # what a successful install does before resetting the prefix cache
        assert server.paused
    assert not server.paused


def test_an_unreachable_server_raises_a_timeout_error_at_once() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    start = time.monotonic()
    with pytest.raises(hotweights.HotWeightsTimeoutError, match="cannot reach the server"):
        hotweights.connect(f"http://127.0.0.1:{port}", timeout=5.0)
    assert time.monotonic() - start < 5.0


def test_a_server_that_does_not_answer_raises_a_timeout_error_within_the_timeout() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(hotweights.HotWeightsTimeoutError, match=r"did not answer GET /get_world_size within 0.5 s"):
        hotweights.connect("http://127.0.0.1:1", transport=httpx.MockTransport(slow), timeout=0.5)
