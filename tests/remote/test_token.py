"""A real ``python -m hotweights.serve`` process started with a token (``HOTWEIGHTS_TOKEN`` in its environment): one
server for the module, on loopback, with hotweights' worker extension and guard; the trainer in this process. It
serves a tiny Qwen3-MoE: the trainer installs a transformers 5 MoE model's own ``state_dict()`` (fused experts)
across the wire."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import hotweights
import hotweights.adapters
from hotweights.testing import PROMPTS, build_tiny_model, greedy_hf, save_tiny_model
from hotweights.vllm.worker.session import PROTOCOL
from tests.remote.server import CPU_FLAGS, Server, free_port, serving

pytestmark = pytest.mark.engine

TIMEOUT = 20.0
GUARD_ENV = ("HOTWEIGHTS_TOKEN", "HOTWEIGHTS_NO_TOKEN", "HOTWEIGHTS_COMMUNICATOR_HOSTS", "HOTWEIGHTS_MAX_RPC_TIMEOUT")


@dataclass
class GuardedServer(Server):
    """A server whose every route needs ``token``: :meth:`client` sends it, :meth:`anonymous` does not."""

    token: str = ""

    def client(self, timeout: float = 60.0) -> httpx.Client:
        client = super().client(timeout)
        client.headers["X-HotWeights-Token"] = self.token
        return client

    def anonymous(self, timeout: float = 60.0) -> httpx.Client:
        return super().client(timeout)

    def version(self) -> str | None:
        with self.client() as client:
            answer = client.get("/weight_info")
            answer.raise_for_status()
            return answer.json().get("weight_version")


def start_guarded_server(
    model: Path, log: Path, token: str, extra: Sequence[str] = (), env_extra: Mapping[str, str] | None = None
) -> GuardedServer:
    """``python -m hotweights.serve`` on an ephemeral loopback port, the token in its environment (not its argv);
    ``extra``: more server flags, ``env_extra``: more of its environment."""
    port = free_port()
    cmd = [sys.executable, "-m", "hotweights.serve", "--model", str(model), "--port", str(port), *CPU_FLAGS, *extra]
    env = {k: v for k, v in os.environ.items() if k not in GUARD_ENV and k != "VLLM_ALLOW_INSECURE_SERIALIZATION"}
    env.update({"HOTWEIGHTS_TOKEN": token, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env_extra or {})})
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return serving(GuardedServer(proc, f"http://127.0.0.1:{port}", str(model), log, token), "hotweights.serve")


def next_version(server: GuardedServer) -> int:
    version = server.version()
    return int(version) + 1 if version and version.isdigit() else 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two tiny fp32 Qwen3-MoE policies (A served at start, B installed), A's directory and HF's greedy outputs."""
    a, b = build_tiny_model("qwen3_moe", 0), build_tiny_model("qwen3_moe", 1)
    path = save_tiny_model(a, tmp_path_factory.mktemp("remote-moe-A"))
    hf = {"A": greedy_hf(a), "B": greedy_hf(b)}
    assert hf["A"] != hf["B"], "seeds must give different outputs, or the tests below prove nothing"
    assert any(".experts.gate_up_proj" in n for n in a.state_dict()), "the trainer's own fused experts"
    return {"A": a, "B": b, "path": path, "hf": hf}


@pytest.fixture(scope="module")
def server(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedServer]:
    token = secrets.token_urlsafe(32)
    srv = start_guarded_server(models["path"], tmp_path_factory.mktemp("token-log") / "server.log", token)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)


def completion_body(server: GuardedServer, **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def test_requests_without_the_token_get_401(server: GuardedServer) -> None:
    ping = {"method": "hotweights_engine", "args": ["status", "{}"], "kwargs": {}, "timeout": 10.0}
    requests: list[tuple[str, str, Any]] = [
        ("POST", "/collective_rpc", ping),
        ("POST", "/v1/completions", completion_body(server)),
        ("POST", "/v1/completions", completion_body(server, stream=True)),
        ("GET", "/v1/models", None),
        ("POST", "/pause", None),
        ("GET", "/is_sleeping", None),
        ("GET", "/server_info", None),
        ("GET", "/health", None),
        ("GET", "/metrics", None),
    ]
    wrong = {"Authorization": "Bearer not-the-token-but-long-enough", "X-HotWeights-Token": "not-the-token-either"}
    with server.anonymous() as anonymous:
        for method, path, body in requests:
            for headers in ({}, wrong):
                answer = anonymous.request(method, path, json=body, headers=headers)
                assert answer.status_code == 401, (method, path, headers, answer.text)
                assert "HOTWEIGHTS_TOKEN" in answer.json()["error"]["message"]
    with server.client() as client:  # the anonymous pause did not run; the token passes, as either header
        assert client.get("/is_paused").json() == {"is_paused": False}
        assert client.post("/collective_rpc", json=ping).json()["results"][0]["hotweights"] == "hotweights"
    with server.anonymous() as bearer:
        assert bearer.get("/v1/models", headers={"Authorization": f"Bearer {server.token}"}).is_success


def test_connect_with_the_token_installs(server: GuardedServer, models: dict[str, Any], no_env_token: None) -> None:
    with hotweights.connect(server.url, token=server.token, timeout=TIMEOUT) as engine:
        assert engine.facts.worker_extension == hotweights.WORKER_EXTENSION
        assert engine.workers.same_host and engine.workers.default_transport == "shm"
        assert server.completions(PROMPTS) == models["hf"]["A"]
        version = next_version(server)
        for offset, name in enumerate(("B", "A")):
            report = hotweights.install(engine, models[name].state_dict(), weight_version=version + offset)
            assert report.adapter == "multiprocess-shm"
            assert report.engine_weight_version == str(version + offset) == server.version()
            assert server.completions(PROMPTS) == models["hf"][name], name


def test_connect_reads_hotweights_token_and_the_collective_rendezvous_passes(
    server: GuardedServer, models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendezvous names loopback (allowed) with no call timeout (the guard caps it and re-encodes the body)."""
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", server.token)
    version = next_version(server)
    with (
        hotweights.connect(server.url, timeout=TIMEOUT) as engine,
        hotweights.adapters.VLLMMultiprocessAdapter(engine, transport="collective") as adapter,
    ):
        for offset, name in enumerate(("B", "A")):
            state = models[name].state_dict()  # fused experts: hotweights.install maps them to checkpoint names
            report = hotweights.install(engine, state, weight_version=version + offset, adapter=adapter)
            assert report.adapter == "multiprocess-collective"
            assert server.completions(PROMPTS) == models["hf"][name], name


@pytest.mark.parametrize("token", [None, "", "wrong-token-but-long-enough-0123456789"], ids=["unset", "empty", "wrong"])
def test_connect_without_the_token_raises_and_writes_nothing(
    server: GuardedServer, models: dict[str, Any], no_env_token: None, token: str | None
) -> None:
    before, outputs = server.version(), server.completions(PROMPTS)
    with pytest.raises(hotweights.EngineNotSupportedError, match=r"HTTP 401.*token=.*HOTWEIGHTS_TOKEN"):
        hotweights.connect(server.url, token=token, timeout=TIMEOUT)
    assert server.version() == before
    assert server.completions(PROMPTS) == outputs


def test_a_streamed_completion_passes_the_guard(server: GuardedServer) -> None:
    streamed: list[int] = []
    body = completion_body(server, stream=True)
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        events = [line.removeprefix("data: ") for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            streamed += choice.get("token_ids") or []
    assert streamed == server.completions([PROMPTS[0]])[0]


def test_the_guard_bounds_collective_rpc(server: GuardedServer) -> None:
    outputs = server.completions(PROMPTS)
    with server.client() as client:
        join = json.dumps({"host": "10.255.255.1", "port": 29500, "world_size": 2, "backend": "gloo", "timeout": 1.0})
        far = {"method": "hotweights_engine", "args": ["join_group", join], "kwargs": {}, "timeout": 5.0}
        refused = client.post("/collective_rpc", json=far)
        assert refused.status_code == 403
        assert "--communicator-hosts" in refused.json()["error"]["message"]
        not_seconds = {"method": "hotweights_engine", "args": ["status", "{}"], "kwargs": {}, "timeout": "forever"}
        assert client.post("/collective_rpc", json=not_seconds).status_code == 400
        assert client.post("/collective_rpc", content=b"{not json").status_code == 400
        capped = {"method": "hotweights_engine", "args": ["status", "{}"], "kwargs": {}, "timeout": 1e9}
        assert client.post("/collective_rpc", json=capped).json()["results"][0]["protocol"] == PROTOCOL
    with hotweights.connect(server.url, token=server.token, timeout=TIMEOUT) as engine:
        assert (
            engine.workers.call("hotweights_engine", "status", "{}")[0]["hotweights"] == "hotweights"
        )  # timeout None: capped
    assert server.completions(PROMPTS) == outputs
