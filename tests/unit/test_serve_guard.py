"""hotweights.serve_guard against a tiny Starlette app standing in for vLLM's server: the token on every route, the
rendezvous host rule, the timeout cap, malformed bodies; connect()'s token and serve.main's policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

import hotweights
from hotweights import serve, serve_guard
from hotweights.serve_guard import GuardConfig, HotWeightsGuard

TOKEN = "t0ken-of-the-test-suite-0123456789"
CALLER = ("10.0.0.7", 40000)
ROUTES = [
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/update_weights"),
    ("POST", "/weight_checker"),
    ("POST", "/init_weight_transfer_engine"),
    ("GET", "/is_sleeping"),
    ("GET", "/get_world_size"),
    ("GET", "/server_info"),
    ("GET", "/no/such/route"),
    ("OPTIONS", "/v1/models"),  # not a CORS preflight
]


class FakeVLLM:
    """The routes of vLLM's server that matter here; records what reached them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bytes, dict[str, str]]] = []
        self.status: dict[str, int] = {}
        """An answer's status by path (default 200)."""
        paths = {path for _, path in ROUTES if path != "/no/such/route"}
        routes: list[Any] = [Route(p, self.handle, methods=["GET", "POST"]) for p in sorted(paths)]
        routes.append(WebSocketRoute("/v1/realtime", self.websocket))
        app = Starlette(routes=routes)
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
        self.app = app

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        self.calls.append((request.method, request.url.path, body, dict(request.headers)))
        path = request.url.path
        if path == "/v1/completions" and body and json.loads(body).get("stream"):
            return StreamingResponse(self.chunks(), media_type="text/event-stream")
        if path == "/get_world_size":
            return JSONResponse({"world_size": 1})
        if path == "/server_info":
            config = {"parallel_config": {"worker_extension_cls": hotweights.WORKER_EXTENSION}}
            return JSONResponse({"vllm_config": {**config, "model_config": {"model": "tiny", "dtype": "float32"}}})
        if path == "/collective_rpc":
            return JSONResponse({"results": [STATUS_ANSWER]})
        return JSONResponse({"ok": True}, status_code=self.status.get(path, 200))

    async def chunks(self) -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    async def websocket(self, ws: WebSocket) -> None:
        self.calls.append(("WS", ws.url.path, b"", dict(ws.headers)))
        await ws.accept()
        await ws.send_text(await ws.receive_text())
        await ws.close()

    def last_body(self) -> Any:
        return json.loads(self.calls[-1][2])

    def last_join(self, where: str = "args") -> Any:
        """The arguments of the last join_group call that reached vLLM (from its args, or its kwargs)."""
        body = self.last_body()
        assert body["method"] == serve_guard.ENGINE_OP
        if where == "args":
            assert body["args"][0] == serve_guard.RENDEZVOUS
            return json.loads(body["args"][1])
        assert body["kwargs"]["op"] == serve_guard.RENDEZVOUS
        return json.loads(body["kwargs"]["args_json"])


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM()


def guarded(fake: FakeVLLM, **config: Any) -> HotWeightsGuard:
    return HotWeightsGuard(fake.app, GuardConfig(**{"token": TOKEN, **config}))


def client(app: Any, caller: tuple[str, int] = CALLER, token: str | None = TOKEN) -> TestClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(app, client=caller, headers=headers, base_url="http://server")


def rpc(method: str, *args: Any, timeout: Any = 30.0, **kwargs: Any) -> dict[str, Any]:
    return {"method": method, "args": list(args), "kwargs": kwargs, "timeout": timeout}


#: The fields of a join_group's JSON object, in the order :func:`join` takes them positionally.
JOIN_FIELDS = ("host", "port", "world_size", "backend", "timeout")


def join(*values: Any, **fields: Any) -> dict[str, Any]:
    """The rendezvous: ``hotweights_engine("join_group", <JSON object>)``, its fields given in the order of
    JOIN_FIELDS and/or by name (the call itself has the default timeout)."""
    args = {**dict(zip(JOIN_FIELDS, values, strict=False)), **fields}
    return rpc(serve_guard.ENGINE_OP, serve_guard.RENDEZVOUS, json.dumps(args))


def join_kwargs(**fields: Any) -> dict[str, Any]:
    """The rendezvous with ``op`` and ``args_json`` as collective_rpc kwargs."""
    return rpc(serve_guard.ENGINE_OP, op=serve_guard.RENDEZVOUS, args_json=json.dumps(fields))


def engine_status(*extra: Any, timeout: Any = 30.0) -> dict[str, Any]:
    """A call that is not a rendezvous: ``hotweights_engine("status", "{}")``."""
    return rpc(serve_guard.ENGINE_OP, "status", "{}", *extra, timeout=timeout)


#: What the fake workers answer every /collective_rpc with (a worker's ``status``).
STATUS_ANSWER = {"hotweights": "hotweights", "protocol": 2, "weights_asleep": False, "pause_owner": ""}


# ------------------------------------------------------------------------------------------------ token
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-of-the-right-length"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"X-HotWeights-Token": TOKEN[:-1]},
        {"X-Api-Key": TOKEN},
    ],
    ids=["none", "wrong", "basic-scheme", "no-scheme", "truncated", "other-header"],
)
@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_no_valid_token_is_401_and_reaches_nothing(
    fake: FakeVLLM, headers: dict[str, str], method: str, path: str
) -> None:
    with client(guarded(fake), token=None) as c:
        answer = c.request(method, path, headers=headers, json=engine_status())
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"].startswith("Bearer")
    message = answer.json()["error"]["message"]
    assert "HOTWEIGHTS_TOKEN" in message and "token=" in message
    assert TOKEN not in answer.text
    assert fake.calls == []


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"bearer {TOKEN}"}, {"X-HotWeights-Token": TOKEN}],
    ids=["bearer", "bearer-lowercase", "x-hotweights-token"],
)
@pytest.mark.parametrize(("method", "path"), [r for r in ROUTES if r[0] != "OPTIONS" and r[1] != "/no/such/route"])
def test_the_token_lets_every_route_through(fake: FakeVLLM, headers: dict[str, str], method: str, path: str) -> None:
    with client(guarded(fake), token=None) as c:
        answer = c.request(method, path, headers=headers, json=engine_status())
    assert answer.status_code == 200, answer.text
    assert [(m, p) for m, p, _, _ in fake.calls] == [(method, path)]


def test_a_wrong_bearer_next_to_the_right_header_passes(fake: FakeVLLM) -> None:
    """vLLM's --api-key clients send their key as Bearer; the token then travels as X-HotWeights-Token."""
    with client(guarded(fake), token="the-api-key-of-vllm") as c:
        assert c.get("/v1/models", headers={"X-HotWeights-Token": TOKEN}).status_code == 200


def test_streaming_passes_through(fake: FakeVLLM) -> None:
    with client(guarded(fake)) as c, c.stream("POST", "/v1/completions", json={"stream": True}) as answer:
        assert answer.status_code == 200
        assert b"".join(answer.iter_bytes()) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


def test_streaming_chunks_are_not_buffered(fake: FakeVLLM) -> None:
    """At the ASGI level: each chunk the app sends is sent on at once, as its own message."""
    sent: list[dict[str, Any]] = []
    body = json.dumps({"stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
        "headers": [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-length", str(len(body)).encode())],
        "client": CALLER, "server": ("server", 80),
    }  # fmt: skip
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        try:
            return next(messages)
        except StopIteration:
            await asyncio.sleep(3600)  # the client stays connected
            raise

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guarded(fake)(scope, receive, send))
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert [m["body"] for m in chunks] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert all(m.get("more_body") for m in chunks)


def test_websocket_needs_the_token(fake: FakeVLLM) -> None:
    with client(guarded(fake), token=None) as c:
        with pytest.raises(WebSocketDisconnect) as refused, c.websocket_connect("/v1/realtime"):
            pass
        assert refused.value.code == 1008
        assert fake.calls == []
        with c.websocket_connect("/v1/realtime", headers={"X-HotWeights-Token": TOKEN}) as ws:
            ws.send_text("hello")
            assert ws.receive_text() == "hello"


def test_a_cors_preflight_passes_to_the_cors_middleware(fake: FakeVLLM) -> None:
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    with client(guarded(fake), token=None) as c:
        answer = c.options("/v1/completions", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] in ("*", "http://ui.example")
    assert fake.calls == []  # answered by CORSMiddleware, no route ran


def test_without_a_token_only_the_body_checks_apply(fake: FakeVLLM) -> None:
    app = HotWeightsGuard(fake.app, GuardConfig(None))
    with client(app, token=None) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.post("/collective_rpc", json=join("10.9.9.9", 1, 2)).status_code == 403


# ------------------------------------------------------------------------------------------------ rendezvous hosts
@pytest.mark.parametrize(
    ("host", "allow", "status"),
    [
        ("10.0.0.7", (), 200),  # the caller's own address
        ("::ffff:10.0.0.7", (), 200),
        ("127.0.0.1", (), 200),
        ("127.0.0.2", (), 200),
        ("::1", (), 200),
        ("[::1]", (), 200),
        ("localhost", (), 200),
        ("10.0.0.8", (), 403),
        ("0.0.0.0", (), 403),
        ("trainer-0", (), 403),
        ("10.0.0.7 ", (), 403),
        (123, (), 403),
        (None, (), 403),
        ("10.0.0.8", ("10.0.0.8",), 200),
        ("10.0.0.9", ("10.0.0.0/24",), 200),
        ("10.0.1.9", ("10.0.0.0/24",), 403),
        ("Trainer-0", ("trainer-0", "trainer-1"), 200),
        ("trainer-2", ("trainer-0", "trainer-1"), 403),
    ],
)
def test_rendezvous_host_rule(fake: FakeVLLM, host: Any, allow: tuple[str, ...], status: int) -> None:
    with client(guarded(fake, communicator_hosts=allow)) as c:
        answer = c.post("/collective_rpc", json=join(host, 29500, 2, "gloo", 60.0))
    assert answer.status_code == status, answer.text
    if status == 403:
        assert "--communicator-hosts" in answer.json()["error"]["message"]
        assert fake.calls == []
    else:
        assert fake.last_join() == {"host": host, "port": 29500, "world_size": 2, "backend": "gloo", "timeout": 60.0}


@pytest.mark.parametrize(
    "body",
    [
        join_kwargs(host="10.0.0.8", port=1, world_size=2),
        rpc(serve_guard.ENGINE_OP, serve_guard.RENDEZVOUS, args_json=json.dumps({"host": "10.0.0.8", "port": 1})),
        join(port=1, world_size=2, host="10.0.0.8"),
        rpc(serve_guard.TRANSFER_INIT, init_info={"host": "10.0.0.8", "port": 1, "world_size": 2}),
        rpc(serve_guard.TRANSFER_INIT, {"master_address": "10.0.0.8", "master_port": 1}),
    ],
    ids=[
        "rendezvous-kwargs",
        "rendezvous-op-args-json-kwarg",
        "rendezvous-args-host-last",
        "transfer-init-kwargs",
        "transfer-init-nccl-args",
    ],
)
def test_rendezvous_host_rule_in_every_form(fake: FakeVLLM, body: dict[str, Any]) -> None:
    with client(guarded(fake)) as c:
        assert c.post("/collective_rpc", json=body).status_code == 403
        body = json.loads(json.dumps(body).replace("10.0.0.8", "10.0.0.7"))
        assert c.post("/collective_rpc", json=body).status_code == 200
    assert len(fake.calls) == 1


def test_a_rendezvous_without_its_arguments_names_no_host_and_is_refused(fake: FakeVLLM) -> None:
    with client(guarded(fake)) as c:
        for body in (
            rpc(serve_guard.ENGINE_OP, serve_guard.RENDEZVOUS),  # args_json defaults to "{}" at the worker
            rpc(serve_guard.ENGINE_OP, op=serve_guard.RENDEZVOUS),
            rpc(serve_guard.ENGINE_OP, serve_guard.RENDEZVOUS, "{}"),
            join(port=1, world_size=2),
        ):
            answer = c.post("/collective_rpc", json=body)
            assert answer.status_code == 403, body
            assert "--communicator-hosts" in answer.json()["error"]["message"]
    assert fake.calls == []


def test_other_engine_operations_are_not_read_as_a_rendezvous(fake: FakeVLLM) -> None:
    """Only join_group connects a worker to a host: the arguments of another operation pass on unread."""
    with client(guarded(fake)) as c:
        for body in (
            rpc(serve_guard.ENGINE_OP, "status", json.dumps({"host": "10.9.9.9"})),
            rpc(serve_guard.ENGINE_OP, "leave_group", "{not json"),
            rpc(serve_guard.ENGINE_OP, op="release_segments", args_json=json.dumps({"ids": None})),
            rpc("hotweights_stage", serve_guard.RENDEZVOUS, json.dumps({"host": "10.9.9.9"})),
        ):
            sent = json.dumps(body).encode()
            assert c.post("/collective_rpc", content=sent).status_code == 200, body
            assert fake.calls[-1][2] == sent
    assert len(fake.calls) == 4


def test_the_transfer_init_route_is_checked(fake: FakeVLLM) -> None:
    with client(guarded(fake)) as c:
        refused = c.post("/init_weight_transfer_engine", json={"init_info": {"host": "192.168.1.1", "port": 1}})
        assert refused.status_code == 403
        sent = b'{"init_info": {"host": "127.0.0.1", "port": 1, "world_size": 2}}'
        assert c.post("/init_weight_transfer_engine", content=sent).status_code == 200
    assert fake.calls[-1][2] == sent  # passed on byte for byte


def test_over_a_unix_socket_only_loopback_may_rendezvous(fake: FakeVLLM) -> None:
    config = GuardConfig(TOKEN)
    assert config.host_allowed("127.0.0.1", None)
    assert not config.host_allowed("10.0.0.7", None)
    app = guarded(fake)
    with client(app, caller=("", 0)) as c:
        assert c.post("/collective_rpc", json=join("10.0.0.7", 1, 2)).status_code == 403


# ------------------------------------------------------------------------------------------------ timeouts
@pytest.mark.parametrize(
    ("timeout", "seen"), [(30.0, 30.0), (600, 600), (1e9, 120.0), (None, 120.0), ("missing", 120.0), (0, 0)]
)
def test_the_call_timeout_is_capped(fake: FakeVLLM, timeout: Any, seen: float) -> None:
    body = engine_status(timeout=timeout)
    if timeout == "missing":
        del body["timeout"]
    with client(guarded(fake, max_rpc_timeout=120.0 if seen != 600 else 600.0)) as c:
        assert c.post("/collective_rpc", json=body).status_code == 200
    _, _, raw, headers = fake.calls[-1]
    assert json.loads(raw)["timeout"] == seen
    assert int(headers["content-length"]) == len(raw)


def test_an_unchanged_body_is_passed_on_byte_for_byte(fake: FakeVLLM) -> None:
    sent = b'{"method":"hotweights_engine","args":["status","{}"],"kwargs":{},"timeout":5,"x":"\\u00e9"}'
    with client(guarded(fake)) as c:
        assert c.post("/collective_rpc", content=sent).status_code == 200
    assert fake.calls[-1][2] == sent


def test_the_rendezvous_timeout_is_capped(fake: FakeVLLM) -> None:
    with client(guarded(fake, max_rpc_timeout=100.0)) as c:
        assert c.post("/collective_rpc", json=join("127.0.0.1", 1, 2, "gloo", 1e6)).is_success
        assert fake.last_join() == {
            "host": "127.0.0.1",
            "port": 1,
            "world_size": 2,
            "backend": "gloo",
            "timeout": 100.0,
        }
        body = join_kwargs(host="::1", port=1, world_size=2, timeout=1e6)
        assert c.post("/collective_rpc", json=body).is_success
        assert fake.last_join("kwargs") == {"host": "::1", "port": 1, "world_size": 2, "timeout": 100.0}
        assert fake.last_body()["timeout"] == 30.0  # the call's own timeout is not the rendezvous'
        sent = json.dumps(join("127.0.0.1", 1, 2, "gloo", 50.0)).encode()  # under the cap: passed on as it is
        assert c.post("/collective_rpc", content=sent).is_success
        assert fake.calls[-1][2] == sent
        info = {"host": "127.0.0.1", "port": 1, "world_size": 2, "timeout": 1e6}
        assert c.post("/init_weight_transfer_engine", json={"init_info": info}).is_success
        assert fake.last_body()["init_info"]["timeout"] == 100.0


@pytest.mark.parametrize("timeout", ["600", True, -1, [1], {"s": 1}], ids=["string", "bool", "negative", "list", "obj"])
def test_a_timeout_that_is_not_seconds_is_400(fake: FakeVLLM, timeout: Any) -> None:
    with client(guarded(fake)) as c:
        answer = c.post("/collective_rpc", json=engine_status(timeout=timeout))
        rendezvous = c.post("/collective_rpc", json=join("127.0.0.1", 1, 2, "gloo", timeout))
        by_name = c.post("/collective_rpc", json=join_kwargs(host="127.0.0.1", port=1, world_size=2, timeout=timeout))
    assert answer.status_code == rendezvous.status_code == by_name.status_code == 400
    assert "number of seconds" in rendezvous.json()["error"]["message"]
    assert "number of seconds" in answer.json()["error"]["message"]
    assert fake.calls == []


# ------------------------------------------------------------------------------------------------ malformed bodies
@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"\xff\xfe\x00garbage",
        b'["a", "list"]',
        b'{"method": "hotweights_engine", "timeout": NaN}',
        b'{"method": "hotweights_engine", "timeout": Infinity}',
        b'{"method": ["not", "a", "string"]}',
        b'{"method": "hotweights_engine", "args": {"10.9.9.9": 1}}',
        b'{"method": "hotweights_engine", "kwargs": ["x"]}',
        b'{"method": "init_weight_transfer_engine", "kwargs": {"init_info": "10.9.9.9"}}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"method": "hotweights_engine", "args": ["join_group", "{not json"]}',
        b'{"method": "hotweights_engine", "args": ["join_group", "[\\"10.9.9.9\\"]"]}',
        b'{"method": "hotweights_engine", "args": ["join_group", "\\"10.9.9.9\\""]}',
        b'{"method": "hotweights_engine", "args": ["join_group", {"host": "127.0.0.1"}]}',
        b'{"method": "hotweights_engine", "args": ["join_group", null]}',
        b'{"method": "hotweights_engine", "kwargs": {"op": "join_group", "args_json": 7}}',
        b'{"method": "hotweights_engine", "kwargs": {"op": "join_group", "args_json": "[1, 2]"}}',
        b'{"method": "hotweights_engine", "args": ["join_group", "' + b"[" * 100_000 + b"]" * 100_000 + b'"]}',
    ],
    ids=[
        "truncated", "empty", "not-utf8", "list", "nan", "infinity", "method-list", "args-dict", "kwargs-list",
        "init-info-string", "deep", "join-args-not-json", "join-args-list", "join-args-string",
        "join-args-not-a-string", "join-args-null", "join-args-json-kwarg-int", "join-args-json-kwarg-list",
        "join-args-deep",
    ],
)  # fmt: skip
def test_a_malformed_body_is_400_not_a_crash(fake: FakeVLLM, raw: bytes) -> None:
    with client(guarded(fake)) as c:
        answer = c.post("/collective_rpc", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"].startswith("hotweights guard:")
        assert c.get("/health").status_code == 200  # the server still serves
    assert [p for _, p, _, _ in fake.calls] == ["/health"]


def test_a_huge_body_is_413(fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_guard, "MAX_BODY_BYTES", 1000)
    with client(guarded(fake)) as c:
        assert c.post("/collective_rpc", json=engine_status("x" * 2000)).status_code == 413
        assert c.post("/collective_rpc", json=engine_status("x" * 100)).status_code == 200


def test_other_methods_and_paths_are_not_read(fake: FakeVLLM) -> None:
    with client(guarded(fake)) as c:
        assert c.post("/pause", content=b"{not json").status_code == 200
        assert c.get("/collective_rpc").status_code == 200  # only POST bodies are read
    assert [b for _, _, b, _ in fake.calls] == [b"{not json", b""]


def test_a_root_path_is_stripped() -> None:
    scope_paths: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope_paths.append(scope["path"])
        await Response("ok")(scope, receive, send)

    c = TestClient(HotWeightsGuard(app, GuardConfig(TOKEN)), root_path="/api", client=CALLER)  # no lifespan
    body = join("10.9.9.9", 1, 2)
    answer = c.post("/api/collective_rpc", json=body, headers={"X-HotWeights-Token": TOKEN})  # uvicorn's full path
    assert answer.status_code == 403
    assert c.get("/api/v1/models").status_code == 401
    assert scope_paths == []


# ------------------------------------------------------------------------------------------------ configuration
def test_config_from_env() -> None:
    config = GuardConfig.from_env(
        {"HOTWEIGHTS_TOKEN": f" {TOKEN}\n", "HOTWEIGHTS_COMMUNICATOR_HOSTS": "10.0.0.8, 10.1.0.0/16,,trainer-0"}
    )
    assert config.token == TOKEN
    assert config.communicator_hosts == ("10.0.0.8", "10.1.0.0/16", "trainer-0")
    assert config.max_rpc_timeout == serve_guard.DEFAULT_MAX_RPC_TIMEOUT
    assert config.host_allowed("10.1.2.3", None) and config.host_allowed("TRAINER-0", None)
    assert GuardConfig.from_env({"HOTWEIGHTS_NO_TOKEN": "1", "HOTWEIGHTS_MAX_RPC_TIMEOUT": "30"}) == GuardConfig(
        None, (), 30.0
    )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "set HOTWEIGHTS_TOKEN"),
        ({"HOTWEIGHTS_TOKEN": "   "}, "set HOTWEIGHTS_TOKEN"),
        ({"HOTWEIGHTS_TOKEN": "short"}, "16 at least"),
        ({"HOTWEIGHTS_TOKEN": "a token with spaces inside"}, "without spaces"),
        ({"HOTWEIGHTS_TOKEN": TOKEN, "HOTWEIGHTS_NO_TOKEN": "1"}, "unset one"),
        ({"HOTWEIGHTS_TOKEN": TOKEN, "HOTWEIGHTS_MAX_RPC_TIMEOUT": "ten"}, "number of seconds"),
        ({"HOTWEIGHTS_TOKEN": TOKEN, "HOTWEIGHTS_MAX_RPC_TIMEOUT": "0"}, "positive"),
        ({"HOTWEIGHTS_TOKEN": TOKEN, "HOTWEIGHTS_MAX_RPC_TIMEOUT": "inf"}, "positive"),
        ({"HOTWEIGHTS_TOKEN": TOKEN, "HOTWEIGHTS_COMMUNICATOR_HOSTS": "a b"}, "no address"),
    ],
)
def test_config_refusals(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuardConfig.from_env(env)


def test_an_unconfigured_guard_fails_closed(fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    monkeypatch.delenv("HOTWEIGHTS_NO_TOKEN", raising=False)
    app = HotWeightsGuard(fake.app)  # what vLLM's --middleware builds
    with client(app) as c:  # the lifespan passes (vLLM starts), every request is refused
        answer = c.get("/v1/models")
    assert answer.status_code == 500
    assert "HOTWEIGHTS_TOKEN" in answer.json()["error"]["message"]
    assert fake.calls == []


def test_the_guard_reads_the_environment(fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)
    monkeypatch.setenv("HOTWEIGHTS_COMMUNICATOR_HOSTS", "10.0.0.8")
    app = HotWeightsGuard(fake.app)
    with client(app, token=None) as c:
        assert c.get("/v1/models").status_code == 401
    with client(app) as c:
        assert c.post("/collective_rpc", json=join("10.0.0.8", 1, 2)).status_code == 200


# ------------------------------------------------------------------------------------------------ the launcher
@pytest.fixture
def execve(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[list[str], dict[str, str]]]]:
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(serve.os, "execve", lambda path, argv, env: calls.append((list(argv), dict(env))))
    for name in ("HOTWEIGHTS_TOKEN", "HOTWEIGHTS_NO_TOKEN", "HOTWEIGHTS_COMMUNICATOR_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    yield calls


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serve_refuses_to_start_without_a_token(
    execve: list[Any], host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        serve.main(["--model", "/ckpt", "--host", host])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "HOTWEIGHTS_TOKEN" in err and "--no-token" in err
    assert execve == []


def test_serve_passes_the_token_through_the_environment(execve: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)
    serve.main(["--model", "/ckpt", "--port", "8001", "--communicator-hosts", "10.0.0.8", "--dtype", "float32"])
    [(argv, env)] = execve
    assert argv[-2:] == ["--middleware", serve.GUARD]
    assert "--dtype" in argv and TOKEN not in " ".join(argv)
    assert env["HOTWEIGHTS_TOKEN"] == TOKEN and "HOTWEIGHTS_NO_TOKEN" not in env
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HOTWEIGHTS_COMMUNICATOR_HOSTS"] == "10.0.0.8"
    assert GuardConfig.from_env(env) == GuardConfig(TOKEN, ("10.0.0.8",), serve_guard.DEFAULT_MAX_RPC_TIMEOUT)


def test_serve_token_flag_and_opt_out(execve: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    serve.main(["--model", "/ckpt", "--token", TOKEN, "--max-rpc-timeout", "60"])
    serve.main(["--model", "/ckpt", "--no-token"])
    (argv, env), (_, open_env) = execve
    assert TOKEN not in " ".join(argv) and env["HOTWEIGHTS_TOKEN"] == TOKEN
    assert GuardConfig.from_env(env).max_rpc_timeout == 60.0
    assert "HOTWEIGHTS_TOKEN" not in open_env and GuardConfig.from_env(open_env).token is None
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)
    for argv in (["--no-token"], ["--token", "short"], ["--token", TOKEN, "--no-token"]):
        with pytest.raises(SystemExit):
            serve.main(["--model", "/ckpt", *argv])
    assert len(execve) == 2


def test_server_command_adds_the_guard_only_when_asked() -> None:
    assert "--middleware" not in serve.server_command("/ckpt")
    assert serve.server_command("/ckpt", extra=["--middleware", "x.Y"], guard=True)[-4:] == [
        "--middleware", "x.Y", "--middleware", serve.GUARD,
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ connect()
class Bridge(httpx.BaseTransport):
    """A synchronous httpx transport into an ASGI app (what connect's ``transport=`` takes)."""

    def __init__(self, app: Any) -> None:
        self.asgi = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def go() -> httpx.Response:
            answer = await self.asgi.handle_async_request(request)
            return httpx.Response(answer.status_code, headers=answer.headers, content=await answer.aread())

        return asyncio.run(go())


def test_connect_sends_the_token_on_every_request(fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    with hotweights.connect("https://server:8000", token=TOKEN, transport=Bridge(guarded(fake))) as engine:
        assert engine.workers.call(serve_guard.ENGINE_OP, "status", "{}") == [STATUS_ANSWER]
    assert len(fake.calls) >= 3  # world size, server info, the call
    assert all(h["x-hotweights-token"] == TOKEN and "authorization" not in h for *_, h in fake.calls)


def test_connect_reads_hotweights_token(fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTWEIGHTS_TOKEN", TOKEN)
    with hotweights.connect("http://127.0.0.1:8000", api_key="key", transport=Bridge(guarded(fake))) as engine:
        assert engine.facts.num_workers == 1
    assert all(h["x-hotweights-token"] == TOKEN and h["authorization"] == "Bearer key" for *_, h in fake.calls)


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-the-right-length"])
def test_connect_without_the_token_is_a_typed_error(
    fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch, token: str | None
) -> None:
    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    with pytest.raises(hotweights.EngineNotSupportedError, match=r"token=.*HOTWEIGHTS_TOKEN"):
        hotweights.connect("https://server:8000", token=token, transport=Bridge(guarded(fake)))
    assert fake.calls == []


@pytest.mark.parametrize("url", ["http://server:8000", "http://10.0.0.7:8000", "http://[2001:db8::1]:8000"])
def test_a_token_never_crosses_plain_http_to_another_host(fake: FakeVLLM, url: str) -> None:
    """Issue 26: connect() sent $HOTWEIGHTS_TOKEN to any URL. Now nothing is sent unless told otherwise."""
    with pytest.raises(hotweights.EngineNotSupportedError, match="plain HTTP"):
        hotweights.connect(url, token=TOKEN, transport=Bridge(guarded(fake)))
    assert fake.calls == []
    with hotweights.connect(url, token=TOKEN, insecure_token=True, transport=Bridge(guarded(fake))) as engine:
        assert engine.facts.num_workers == 1


@pytest.mark.parametrize("method", ["save_sharded_state", "execute_model", "check_health", "sleep", "", "x" * 500])
def test_the_token_opens_only_the_worker_methods_an_install_needs(fake: FakeVLLM, method: str) -> None:
    """Issue 26: with the token, /collective_rpc used to run any worker method."""
    with client(guarded(fake)) as c:
        answer = c.post("/collective_rpc", json={"method": method, "args": [], "kwargs": {}})
    assert answer.status_code == 403 and "only the methods an install needs" in answer.json()["error"]["message"]
    assert fake.calls == []


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"weights_path": "/dev/shm/hotweights-1-ckpt-x", "is_checkpoint_format": True}, 200),
        ({"weights_path": "/etc/passwd"}, 403),
        ({"weights_path": "/dev/shm/other-ckpt"}, 403),
        ({"weights_path": "/dev/shm/hotweights-1/../../etc"}, 403),
        ({"weights_iterator": []}, 403),
        ({}, 403),
    ],
)
def test_reload_weights_only_of_a_hotweights_checkpoint_in_shared_memory(
    fake: FakeVLLM, kwargs: dict[str, Any], status: int
) -> None:
    with client(guarded(fake)) as c:
        answer = c.post("/collective_rpc", json={"method": "reload_weights", "args": [], "kwargs": kwargs})
    assert answer.status_code == status, kwargs


# ------------------------------------------------------------------------------------------------ pause hold
def _hold_scenario(fake: FakeVLLM, mode: str, pause_status: int = 200) -> tuple[HotWeightsGuard, list[str], int]:
    """Pause with ``mode``, send a completion, then resume: the paths in the order they reached vLLM, and how many
    completions had reached it before the resume."""
    guard = guarded(fake)
    fake.status["/pause"] = pause_status

    async def scenario() -> int:
        transport = httpx.ASGITransport(app=guard, client=CALLER)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://server", headers=headers) as http:
            await http.post("/pause", params={"mode": mode})
            completion = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x"}))
            for _ in range(50):
                await asyncio.sleep(0)
            before = sum(path == "/v1/completions" for _, path, _, _ in fake.calls)
            assert (await http.post("/resume")).status_code == 200
            assert (await completion).status_code == 200
            return before

    before = asyncio.run(scenario())
    return guard, [path for _, path, _, _ in fake.calls], before


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_generation_request_during_a_pause_is_held_until_the_resume(fake: FakeVLLM, mode: str) -> None:
    """vLLM 0.33 and later answer it 503 while paused with wait or abort; the guard keeps 0.31-0.32's queueing."""
    guard, order, before = _hold_scenario(fake, mode)
    assert before == 0 and guard.held == 1
    assert order == ["/pause", "/resume", "/v1/completions"]


def test_keep_mode_holds_nothing(fake: FakeVLLM) -> None:
    guard, order, before = _hold_scenario(fake, "keep")
    assert before == 1 and guard.held == 0
    assert order == ["/pause", "/v1/completions", "/resume"]


def test_a_failed_pause_holds_nothing(fake: FakeVLLM) -> None:
    guard, order, before = _hold_scenario(fake, "wait", pause_status=500)
    assert before == 1 and guard.held == 0
    assert order == ["/pause", "/v1/completions", "/resume"]


def test_a_failed_second_pause_keeps_the_first_ones_hold(fake: FakeVLLM) -> None:
    guard = guarded(fake)

    async def scenario() -> int:
        transport = httpx.ASGITransport(app=guard, client=CALLER)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://server", headers=headers) as http:
            await http.post("/pause", params={"mode": "wait"})
            fake.status["/pause"] = 500
            assert (await http.post("/pause", params={"mode": "abort"})).status_code == 500
            completion = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x"}))
            for _ in range(50):
                await asyncio.sleep(0)
            before = sum(path == "/v1/completions" for _, path, _, _ in fake.calls)
            await http.post("/resume")
            await completion
            return before

    assert asyncio.run(scenario()) == 0 and guard.held == 1
