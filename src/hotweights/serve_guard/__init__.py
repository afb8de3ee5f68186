"""An ASGI middleware that guards every route of a ``vllm serve`` process with a token, and bounds what a caller
may make the engine do through ``/collective_rpc``.

``python -m hotweights.serve`` installs it; on a server started otherwise, add it the same way::

    HOTWEIGHTS_TOKEN=... VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls hotweights.vllm.worker.extension.HotWeightsWorkerExtension \\
        --middleware hotweights.serve_guard.HotWeightsGuard

What it does, before vLLM sees the request:

- **Token** (every path, every method, websockets too): a request must carry ``Authorization: Bearer <token>`` or
  ``X-HotWeights-Token: <token>``, else it is answered 401 and reaches nothing. Only CORS preflights (``OPTIONS``
  with ``Origin`` and ``Access-Control-Request-Method``, answered by vLLM's CORS middleware) pass without one.
- **Rendezvous hosts**: a ``hotweights_engine("join_group", ...)`` or ``init_weight_transfer_engine`` call (through
  ``POST /collective_rpc``, or ``POST /init_weight_transfer_engine``) naming a host other than the caller's own
  address or loopback is refused (403), unless the host is on the allow-list.
- **Requests queue during a pause**: while the engine is paused with ``mode=wait`` or ``abort`` (``POST /pause``,
  what an install does), a request to a generation route (:data:`GENERATION_ROUTES`) is held and handed to vLLM
  after ``POST /resume``, as vLLM 0.31 and 0.32 queue it; from 0.33 vLLM itself would answer it 503 (retry) until
  the resume. A request is held at most ``HOTWEIGHTS_MAX_RPC_TIMEOUT`` seconds, then handed over as it is.
- **KV epochs** (``pause="keep"`` and ``"recompute"``, see :mod:`hotweights.handles.pause`): it wraps the server's
  ``AsyncLLM`` (``app.state.engine_client``) so that every request carries the engine's KV epoch in its
  ``cache_salt`` (after the request's own salt), and answers ``GET /hotweights/kv_epoch`` (read it) and ``POST
  /hotweights/kv_epoch`` (start a new one: what a ``keep`` install does once the engine is paused) itself. A
  ``POST /reset_prefix_cache?reset_running_requests=true`` (a ``recompute`` install) holds generation routes, and
  the ``POST /resume`` that follows is answered once every request it preempted produced a token on the new weights
  (so the install's stall counts the re-prefill); the hold ends then. One API server process (vLLM's default): each
  process would keep an epoch of its own.
- **Timeouts**: the ``timeout`` of a ``/collective_rpc`` body (and a rendezvous' own ``timeout``) is capped at
  ``HOTWEIGHTS_MAX_RPC_TIMEOUT`` seconds (a missing or null one, which vLLM reads as "no limit", too); one that is
  not a number of seconds is refused (400), as is a body that is not a JSON object.

Only those two POST bodies are read (then handed to vLLM unchanged, or re-encoded where a timeout was capped);
every other request and every response, streamed ones included, passes through untouched.

Configuration, from the environment (vLLM's ``--middleware`` passes no arguments):

- ``HOTWEIGHTS_TOKEN``: the token (16 characters at least);
- ``HOTWEIGHTS_NO_TOKEN=1``: serve without a token (the explicit opt-out; the other checks stay);
- ``HOTWEIGHTS_COMMUNICATOR_HOSTS``: comma-separated addresses, networks (``10.0.0.0/24``) or host names a
  rendezvous may also name;
- ``HOTWEIGHTS_MAX_RPC_TIMEOUT``: seconds (default 600).

Without a token and without the opt-out, the guard fails closed: every request is answered 500 naming the fix.

The middleware is here; what it enforces is :mod:`~hotweights.serve_guard.config`, what it reads of a worker call's
or a probe's body :mod:`~hotweights.serve_guard.bodies`, and the ASGI helpers :mod:`~hotweights.serve_guard.asgi`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import Any

from hotweights.handles.pause import KvEpoch, decoding, recomputed
from hotweights.serve_guard.asgi import (
    ASGIApp,
    Message,
    Receive,
    Refusal,
    Scope,
    Send,
    answer,
    caller_of,
    is_preflight,
    path_of,
    query_of,
    read_body,
    refuse,
)
from hotweights.serve_guard.bodies import (
    COLLECTIVE_RPC,
    ENGINE_OP,
    INIT_TRANSFER,
    RENDEZVOUS,
    RPC_METHODS,
    TRANSFER_INIT,
    check_body,
    engine_facts,
    probe_ids,
    probe_label,
)
from hotweights.serve_guard.config import DEFAULT_MAX_RPC_TIMEOUT, MIN_TOKEN_LENGTH, TOKEN_ENV, GuardConfig

__all__ = [
    "COLLECTIVE_RPC",
    "DEFAULT_MAX_RPC_TIMEOUT",
    "ENGINE_OP",
    "GENERATION_ROUTES",
    "MAX_BODY_BYTES",
    "MIN_TOKEN_LENGTH",
    "RENDEZVOUS",
    "RPC_METHODS",
    "TRANSFER_INIT",
    "GuardConfig",
    "HotWeightsGuard",
    "Refusal",
    "check_body",
]

#: Largest ``/collective_rpc`` body read (worker calls carry JSON descriptors and manifests, not tensors).
MAX_BODY_BYTES = 64 << 20
TOKEN_HEADER = b"x-hotweights-token"
PAUSE, RESUME = "/pause", "/resume"
RESET = "/reset_prefix_cache"
#: The guard's own route: GET reads the server's KV epoch, POST starts a new one (a ``keep`` install, once paused).
KV_EPOCH = "/hotweights/kv_epoch"
#: The guard's own route for the family probe: GET reads the engine's config, POST scores the probe during an install.
PROBE = "/hotweights/probe"
#: Largest probe body read.
MAX_PROBE_BODY = 4096
#: Seconds a resume after a ``recompute`` reset waits at most for the requests it preempted.
RECOMPUTE_TIMEOUT = 50.0
#: The routes that start generation: held (POST) while the engine is paused with ``mode=wait`` or ``abort``.
GENERATION_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/inference/v1/generate",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
    }
)

logger = logging.getLogger(__name__)


class HotWeightsGuard:
    """Pure ASGI middleware: token on every request, bounds on rendezvous hosts and worker-call timeouts.

    vLLM adds it with ``--middleware hotweights.serve_guard.HotWeightsGuard`` (configured from the environment:
    see the module docstring); elsewhere ``HotWeightsGuard(app, GuardConfig(token))``.
    """

    def __init__(self, app: ASGIApp, config: GuardConfig | None = None) -> None:
        self.app = app
        self._broken: str | None = None
        try:
            self.config: GuardConfig | None = config if config is not None else GuardConfig.from_env()
        except ValueError as exc:
            self.config, self._broken = None, f"hotweights guard: {exc}; every request is refused until it is set"
            logger.error(self._broken)
        token = self.config.token if self.config is not None else None
        self._digest = hashlib.sha256(token.encode()).digest() if token is not None else None
        self._paused: asyncio.Event | None = None
        """Set while a pause with ``mode=wait`` or ``abort`` (or a ``recompute`` reset) holds generation; None
        otherwise."""
        self.held = 0
        """Requests held until a resume (for tests, metrics)."""
        self._engine: Any = None
        """The server's ``AsyncLLM`` (``app.state.engine_client``), once found."""
        self.epoch: KvEpoch | None = None
        """The engine's KV epoch, folded into the salt of every request (None until the engine was found)."""
        self._preempted: frozenset[str] = frozenset()
        """Requests a ``recompute`` reset preempted: the next resume is answered once they decode again."""
        self.recompute_s: float | None = None
        """Seconds the last resume after a ``recompute`` reset waited for the requests it preempted."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        if self.config is None:
            await refuse(scope, receive, send, 500, self._broken or "hotweights guard is not configured")
            return
        if self._digest is not None and not self._authorized(scope) and not is_preflight(scope):
            logger.warning(
                "hotweights guard: 401 for %s %s from %s", scope.get("method", "WS"), path_of(scope), caller_of(scope)
            )
            await refuse(
                scope,
                receive,
                send,
                401,
                "missing or wrong hotweights token: send `Authorization: Bearer <token>` or `X-HotWeights-Token: "
                f"<token>` (hotweights.connect(url, token=...) or {TOKEN_ENV} sends it)",
            )
            return
        if self.epoch is None:
            self._attach(scope)
        path = path_of(scope)
        post = kind == "http" and scope.get("method") == "POST"
        if kind == "http" and path == KV_EPOCH:
            await self._kv_epoch(scope, receive, send)
            return
        if kind == "http" and path == PROBE:
            await self._probe(scope, receive, send)
            return
        if post and path == RESET and query_of(scope).get("reset_running_requests", "").lower() == "true":
            await self._recompute_reset(scope, receive, send)
            return
        if post and path in (COLLECTIVE_RPC, INIT_TRANSFER):
            await self._checked(scope, receive, send, path)
            return
        if post and path in (PAUSE, RESUME):
            await self._pausing(scope, receive, send, path)
            return
        if post and path in GENERATION_ROUTES and self._paused is not None:
            await self._held(path)
        await self.app(scope, receive, send)

    def _attach(self, scope: Scope) -> None:
        """Find the server's ``AsyncLLM`` and salt every request it admits with its KV epoch (once)."""
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is None or not callable(getattr(engine, "generate", None)):
            return
        from hotweights.core import attach

        epoch: KvEpoch = attach.value(engine, "kv_epoch", KvEpoch)
        for name in ("generate", "encode"):
            attach.patch(engine, engine, name, epoch.wrap)
        self._engine, self.epoch = engine, epoch

    async def _kv_epoch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET``: the engine's KV epoch; ``POST``: start a new one (every request admitted from now on is salted
        with it). 501 where the guard cannot reach the engine."""
        if self.epoch is None:
            await refuse(scope, receive, send, 501, "hotweights guard: the server's engine cannot be reached here")
            return
        if scope.get("method") == "POST":
            self.epoch.bump()
        await answer(send, 200, {"epoch": self.epoch.epoch})

    async def _probe(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET``: the engine's family, transformers config and dtype (what the trainer builds the family probe's
        reference from); ``POST {"token_ids": [...]}`` (at most :data:`~hotweights.vllm.scoring.MAX_PROBE_TOKENS`
        ids of the vocabulary): the engine's scores of them, run inside an install with generation routes held (see
        :func:`~hotweights.vllm.scoring.score_during_install`); ``DELETE``: abort the requests in flight (they decoded
        during a probe that then failed, under ``keep`` or ``recompute``). 501 where the guard cannot reach the
        engine."""
        from hotweights.vllm import scoring

        assert self.config is not None
        engine = self._engine
        if engine is None:
            await refuse(scope, receive, send, 501, "hotweights guard: the server's engine cannot be reached here")
            return
        if scope.get("method") == "DELETE":
            running = list(self._in_flight())
            if running:
                await engine.abort(running, internal=True)  # the output processor's own ids
            await answer(send, 200, {"aborted": len(running)})
            return
        if scope.get("method") != "POST":
            await answer(send, 200, engine_facts(engine))
            return
        try:
            body = await read_body(receive, MAX_PROBE_BODY, PROBE)
            if body is None:
                return
            ids = probe_ids(body, int(engine.model_config.get_vocab_size()))
            label = probe_label(body)
        except Refusal as refusal:
            await refuse(scope, receive, send, refusal.status, str(refusal))
            return
        holds = self._paused is None  # under keep nothing is held: hold generation routes while the probe runs
        if holds:
            self._paused = asyncio.Event()
        try:
            scored = scoring.score_during_install(engine, ids, label)
            scores = await asyncio.wait_for(scored, self.config.max_rpc_timeout)
        finally:
            if holds:
                self._release()
        await answer(send, 200, {"logprobs": scores})

    def _in_flight(self) -> dict[str, tuple[int, str | None]]:
        from hotweights.vllm.introspect import requests_in_flight

        return requests_in_flight(self._engine) if self._engine is not None else {}

    async def _recompute_reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward a reset that preempts the requests in flight; hold generation routes until the resume after it
        finds them decoding again (see :meth:`_pausing`)."""
        preempted = decoding(self._in_flight())
        holds = self._paused is None
        if holds:
            self._paused = asyncio.Event()
        status: list[int] = []

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            if status and status[0] < 300:
                self._preempted = self._preempted | preempted
            elif holds:  # a failed reset: only its own hold
                self._release()

    async def _pausing(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Forward a pause or resume; a pause that rejects new requests holds generation routes until the resume
        (or until the pause fails). A resume after a ``recompute`` reset is answered once the requests it preempted
        decode again on the new weights."""
        holds = path == PAUSE and query_of(scope).get("mode", "abort") in ("wait", "abort") and self._paused is None
        if holds:
            self._paused = asyncio.Event()
        status: list[int] = []
        preempted = self._preempted if path == RESUME else frozenset()
        answer: list[Message] = []

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            if preempted:
                answer.append(message)  # answered once they were prefilled again
            else:
                await send(message)

        try:
            await self.app(scope, receive, sent)
            if preempted and status and status[0] < 300 and self._engine is not None:
                self._preempted = frozenset()
                label = str(await self._engine.get_weight_version())
                self.recompute_s = await recomputed(self._in_flight, preempted, label, RECOMPUTE_TIMEOUT)
        finally:
            if path == RESUME or (holds and (not status or status[0] >= 300)):  # a failed pause: only its own hold
                self._release()
            for message in answer:
                await send(message)

    def _release(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None:
            paused.set()

    async def _held(self, path: str) -> None:
        assert self.config is not None
        paused = self._paused
        if paused is None:
            return
        self.held += 1
        try:
            await asyncio.wait_for(paused.wait(), self.config.max_rpc_timeout)
        except asyncio.TimeoutError:
            logger.warning(
                "hotweights guard: POST %s held %g s by a pause without a resume; handed to vLLM as it is",
                path,
                self.config.max_rpc_timeout,
            )

    def _authorized(self, scope: Scope) -> bool:
        assert self._digest is not None
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, presented = bytes(value).partition(b" ")
                if scheme.lower() != b"bearer":
                    continue
            elif name == TOKEN_HEADER:
                presented = bytes(value)
            else:
                continue
            ok |= hmac.compare_digest(hashlib.sha256(presented.strip()).digest(), self._digest)
        return ok

    async def _checked(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Read the body, check (and maybe rewrite) it, then hand it to the app."""
        assert self.config is not None
        try:
            body = await read_body(receive, MAX_BODY_BYTES, path)
            if body is None:
                return
            checked = check_body(path, body, caller_of(scope), self.config)
        except Refusal as refusal:
            logger.warning(
                "hotweights guard: %d for POST %s from %s: %s", refusal.status, path, caller_of(scope), refusal
            )
            await refuse(scope, receive, send, refusal.status, str(refusal))
            return
        if checked is not None:
            body = checked
            headers = [
                (k, v) for k, v in scope.get("headers", ()) if k not in (b"content-length", b"transfer-encoding")
            ]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
