"""The KV epoch of ``pause="keep"`` and the re-prefill wait of ``pause="recompute"`` without an engine: salts (the
user's kept), the server guard's epoch route, salting and resume, a server without the guard, and
``weight_versions_of(...).kv``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

import hotweights
from hotweights.handles.pause import KvEpoch, combined_salt, decoding, recomputed, salted
from hotweights.serve_guard import GuardConfig, HotWeightsGuard
from hotweights.versions import record_kv
from tests.remote.test_client import FakeServer, connect


def test_salts_fold_the_epoch_after_the_users_own() -> None:
    assert combined_salt(None, 0) is None and combined_salt("mine", 0) == "mine"
    assert combined_salt("mine", 3) == "mine|hotweights-kv-epoch-3"
    prompt = {"prompt_token_ids": [1, 2], "cache_salt": "mine"}
    assert salted(prompt, 2) == {"prompt_token_ids": [1, 2], "cache_salt": "mine|hotweights-kv-epoch-2"}
    assert prompt["cache_salt"] == "mine"  # the caller's dict is not changed
    assert salted({"type": "token", "prompt_token_ids": [1]}, 1)["cache_salt"] == "hotweights-kv-epoch-1"
    assert salted("text", 1) == {"prompt": "text", "cache_salt": "hotweights-kv-epoch-1"}
    request = NS(request_id="r", cache_salt=None)  # an EngineCoreRequest
    assert salted(request, 4) is request and request.cache_salt == "hotweights-kv-epoch-4"
    assert salted({"prompt_token_ids": [1]}, 0) == {"prompt_token_ids": [1]}  # epoch 0: sent as it is
    epoch = KvEpoch()
    assert epoch.call(({"prompt_token_ids": [1]},), {}) == (({"prompt_token_ids": [1]},), {})
    epoch.bump()
    _, kwargs = epoch.call((), {"prompt": {"prompt_token_ids": [1]}, "request_id": "x"})
    assert kwargs == {"prompt": {"prompt_token_ids": [1], "cache_salt": "hotweights-kv-epoch-1"}, "request_id": "x"}


class FakeEngine:
    """An ``AsyncLLM`` as the guard sees it: ``generate``, ``get_weight_version`` and the output processor's state
    of two requests, one decoding and one still waiting."""

    def __init__(self) -> None:
        self.prompts: list[Any] = []
        self.version = "1"
        self.states = {
            "decoding": NS(detokenizer=NS(num_output_tokens=lambda: 5), weight_version_starts=[("1", 0)]),
            "waiting": NS(detokenizer=NS(num_output_tokens=lambda: 0), weight_version_starts=[]),
        }
        self.output_processor = NS(request_states=self.states)

    async def generate(self, prompt: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.prompts.append(prompt)
        yield prompt

    async def get_weight_version(self) -> str:
        return self.version

    def decode_later(self, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            self.states["decoding"].weight_version_starts.append((self.version, 5))

        asyncio.get_running_loop().create_task(later())


def _server() -> tuple[TestClient, FakeEngine, HotWeightsGuard]:
    engine = FakeEngine()

    async def completions(request: Request) -> Response:
        async for prompt in engine.generate(await request.json()):
            return JSONResponse({"prompt": prompt})
        return JSONResponse({})

    async def resume(request: Request) -> Response:
        engine.decode_later(0.05)  # the preempted request decodes again a little after the resume
        return JSONResponse({"ok": True})

    async def ok(request: Request) -> Response:
        return JSONResponse({"success": True})

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/pause", ok, methods=["POST"]),
        Route("/reset_prefix_cache", ok, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.engine_client = engine
    app.add_middleware(HotWeightsGuard, config=GuardConfig(None))
    client = TestClient(app)
    client.get("/hotweights/kv_epoch")  # the first request builds the middleware stack
    layer: Any = app.middleware_stack
    while not isinstance(layer, HotWeightsGuard):
        layer = layer.app
    return client, engine, layer


def test_the_guard_salts_every_request_with_the_epoch_a_keep_install_starts() -> None:
    client, engine, guard = _server()
    assert client.get("/hotweights/kv_epoch").json() == {"epoch": 0}
    client.post("/v1/completions", json={"prompt_token_ids": [1], "cache_salt": "mine"})
    assert engine.prompts[-1] == {"prompt_token_ids": [1], "cache_salt": "mine"}  # epoch 0: as it is
    assert client.post("/hotweights/kv_epoch").json() == {"epoch": 1}
    client.post("/v1/completions", json={"prompt_token_ids": [1], "cache_salt": "mine"})
    assert engine.prompts[-1]["cache_salt"] == "mine|hotweights-kv-epoch-1"
    assert guard.epoch is not None and guard.epoch.epoch == 1
    hotweights.detach(engine)  # the wrapper goes with everything else hotweights put there
    assert "generate" not in vars(engine)


def test_the_guard_answers_a_resume_after_a_recompute_reset_once_the_preempted_requests_decode() -> None:
    client, engine, guard = _server()
    client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert guard._paused is not None  # generation routes are held from the reset on
    engine.version = "2"
    client.post("/resume")
    assert guard.recompute_s is not None and guard.recompute_s >= 0.04
    assert guard._paused is None
    client.post("/resume")  # a plain resume: answered at once
    assert guard.recompute_s >= 0.04


def test_recomputed_waits_for_a_token_on_the_new_weights_or_the_end() -> None:
    states = {"a": (3, "1"), "b": (1, "1"), "c": (0, None)}
    assert decoding(states) == {"a", "b"}

    async def scenario() -> float | None:
        async def progress() -> None:
            await asyncio.sleep(0.02)
            states["a"] = (4, "2")
            await asyncio.sleep(0.02)
            del states["b"]  # finished

        task = asyncio.create_task(progress())
        waited = await recomputed(lambda: states, {"a", "b"}, "2", 5.0)
        await task
        return waited

    waited = asyncio.run(scenario())
    assert waited is not None and waited >= 0.03
    assert asyncio.run(recomputed(lambda: {"a": (3, "1")}, {"a"}, "2", 0.02)) is None  # timed out: goes on


def test_keep_on_a_server_without_the_guard_recomputes_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer()
    engine = connect(server)
    engine.set_pause_mode("keep")
    with caplog.at_level(logging.WARNING, "hotweights"), engine.gate.installing(timeout=5.0):
        assert engine.reset_prefix_cache() is True
        engine.set_weight_version("41")
    assert "does not run hotweights' guard" in caplog.text
    assert "POST /reset_prefix_cache?reset_running_requests=true" in server.paths()
    done = NS(index=0, finish_reason="length", weight_versions=[NS(version="40", start=0, end=3),
                                                                 NS(version="41", start=3, end=8)])  # fmt: skip
    assert hotweights.weight_versions_of(NS(outputs=[done])).kv == "recomputed"


def test_recompute_on_a_server_preempts_after_the_write() -> None:
    server = FakeServer()
    engine = connect(server)
    engine.set_pause_mode("recompute")
    with engine.gate.installing(timeout=5.0):
        engine.reset_prefix_cache()
    paths = server.paths()
    assert "POST /pause?mode=keep&clear_cache=false" in paths
    assert "POST /reset_prefix_cache?reset_running_requests=true" in paths


def test_weight_versions_of_says_how_each_crossing_treated_the_kv_cache() -> None:
    def out(*labels: str) -> Any:
        spans = [NS(version=v, start=i, end=i + 1) for i, v in enumerate(labels)]
        return NS(outputs=[NS(index=0, finish_reason="length", weight_versions=spans)])

    record_kv("51", "keep")
    record_kv("52", "recompute")
    assert hotweights.weight_versions_of(out("51")).kv is None  # one version: crossed nothing
    assert hotweights.weight_versions_of(out("50", "51")).kv == "kept"
    assert hotweights.weight_versions_of(out("51", "52")).kv == "recomputed"
    assert hotweights.weight_versions_of(out("50", "51", "52")).kv == "mixed"
    assert hotweights.weight_versions_of(out("default", "1053")).kv == "unknown"  # installed elsewhere
    record_kv("52", "wait")  # the same version installed again without anything in flight
    assert hotweights.weight_versions_of(out("51", "52")).kv == "unknown"
