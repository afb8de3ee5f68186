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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from hotweights.handles.pause import KvEpoch, decoding, recomputed

__all__ = [
    "DEFAULT_MAX_RPC_TIMEOUT",
    "MIN_TOKEN_LENGTH",
    "GuardConfig",
    "HotWeightsGuard",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

TOKEN_ENV = "HOTWEIGHTS_TOKEN"
NO_TOKEN_ENV = "HOTWEIGHTS_NO_TOKEN"
HOSTS_ENV = "HOTWEIGHTS_COMMUNICATOR_HOSTS"
TIMEOUT_ENV = "HOTWEIGHTS_MAX_RPC_TIMEOUT"
#: Seconds a ``/collective_rpc`` call may ask the workers to take, by default.
DEFAULT_MAX_RPC_TIMEOUT = 600.0
#: Shortest token accepted.
MIN_TOKEN_LENGTH = 16
#: Largest ``/collective_rpc`` body read (worker calls carry JSON descriptors and manifests, not tensors).
MAX_BODY_BYTES = 64 << 20
TOKEN_HEADER = b"x-hotweights-token"
COLLECTIVE_RPC = "/collective_rpc"
INIT_TRANSFER = "/init_weight_transfer_engine"
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
ENGINE_OP = "hotweights_engine"
#: The ``hotweights_engine`` operation that makes the workers connect to a host (the collective rendezvous).
RENDEZVOUS = "join_group"
TRANSFER_INIT = "init_weight_transfer_engine"
#: The worker methods ``/collective_rpc`` runs for a caller: hotweights' session and engine operations, and the vLLM
#: calls an install makes (its weight-transfer API, and ``reload_weights`` of a checkpoint hotweights wrote). Any
#: other method is 403: the token opens installs, not every method of the workers.
RPC_METHODS = frozenset(
    {
        "hotweights_begin",
        "hotweights_stage",
        "hotweights_prepare",
        "hotweights_commit",
        "hotweights_abort",
        ENGINE_OP,
        TRANSFER_INIT,
        "shutdown_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reload_weights",
    }
)
#: Keys of an ``init_info`` that name the host a worker connects to (hotweights' backend; vLLM's NCCL backend).
INIT_INFO_HOSTS = ("host", "master_address")
NEW_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardConfig:
    """What :class:`HotWeightsGuard` enforces.

    Args:
        token: the token every request must carry; None serves without one (the explicit opt-out).
        communicator_hosts: addresses, networks or host names a rendezvous may name besides the caller's own
            address and loopback.
        max_rpc_timeout: seconds a worker call (and a rendezvous) may be given at most.
    """

    token: str | None
    communicator_hosts: tuple[str, ...] = ()
    max_rpc_timeout: float = DEFAULT_MAX_RPC_TIMEOUT
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the hotweights token is {len(self.token)} characters long; use {MIN_TOKEN_LENGTH} at least, e.g. "
                f"export {TOKEN_ENV}=$({NEW_TOKEN})"
            )
        if self.token is not None and not all("!" <= c <= "~" for c in self.token):
            raise ValueError("the hotweights token must be printable ASCII without spaces (it travels in a header)")
        timeout = self.max_rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"the largest RPC timeout must be a positive number of seconds, not {timeout!r}")
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for entry in self.communicator_hosts:
            try:
                networks.append(_mapped_network(ipaddress.ip_network(entry, strict=False)))
            except ValueError:
                if not entry or any(c.isspace() or c in "/,[]" for c in entry):
                    raise ValueError(
                        f"{entry!r} in the communicator hosts is no address, network or host name"
                    ) from None
                names.add(entry.lower())
        object.__setattr__(self, "_networks", tuple(networks))
        object.__setattr__(self, "_names", frozenset(names))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GuardConfig:
        """Read ``HOTWEIGHTS_TOKEN``, ``HOTWEIGHTS_NO_TOKEN``, ``HOTWEIGHTS_COMMUNICATOR_HOSTS`` and
        ``HOTWEIGHTS_MAX_RPC_TIMEOUT``.

        Raises:
            ValueError: no token and no opt-out (or both), or a value that does not parse; the message says what
                to set.
        """
        env = os.environ if environ is None else environ
        token = env.get(TOKEN_ENV, "").strip() or None
        no_token = env.get(NO_TOKEN_ENV, "").strip().lower() in ("1", "true", "yes")
        if token is None and not no_token:
            raise ValueError(
                f"no hotweights token: set {TOKEN_ENV} in the server's environment (e.g. export "
                f"{TOKEN_ENV}=$({NEW_TOKEN})), or {NO_TOKEN_ENV}=1 to serve without one"
            )
        if token is not None and no_token:
            raise ValueError(f"both {TOKEN_ENV} and {NO_TOKEN_ENV}=1 are set: unset one")
        raw = env.get(TIMEOUT_ENV, "").strip()
        try:
            timeout = float(raw) if raw else DEFAULT_MAX_RPC_TIMEOUT
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        return cls(token, split_hosts(env.get(HOSTS_ENV, "")), timeout)

    def host_allowed(self, host: object, caller: str | None) -> bool:
        """True if a rendezvous may name ``host``: loopback, the caller's own address, or an allowed one."""
        if not isinstance(host, str):
            return False
        if host.lower() == "localhost":
            return True
        address = _address(host.removeprefix("[").removesuffix("]") if host.startswith("[") else host)
        if address is None:
            return host.lower() in self._names
        return (
            address.is_loopback
            or (caller is not None and address == _address(caller))
            or any(address in network for network in self._networks)
        )


def split_hosts(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"a, b"`` (or an iterable of such strings) as ``("a", "b")``."""
    parts = [value] if isinstance(value, str) else list(value)
    return tuple(h.strip() for part in parts for h in part.split(",") if h.strip())


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
            await _refuse(scope, receive, send, 500, self._broken or "hotweights guard is not configured")
            return
        if self._digest is not None and not self._authorized(scope) and not _preflight(scope):
            logger.warning(
                "hotweights guard: 401 for %s %s from %s", scope.get("method", "WS"), _path(scope), _caller(scope)
            )
            await _refuse(
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
        path = _path(scope)
        post = kind == "http" and scope.get("method") == "POST"
        if kind == "http" and path == KV_EPOCH:
            await self._kv_epoch(scope, receive, send)
            return
        if kind == "http" and path == PROBE:
            await self._probe(scope, receive, send)
            return
        if post and path == RESET and _query(scope).get("reset_running_requests", "").lower() == "true":
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
            await _refuse(scope, receive, send, 501, "hotweights guard: the server's engine cannot be reached here")
            return
        if scope.get("method") == "POST":
            self.epoch.bump()
        await _answer(send, 200, {"epoch": self.epoch.epoch})

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
            await _refuse(scope, receive, send, 501, "hotweights guard: the server's engine cannot be reached here")
            return
        if scope.get("method") == "DELETE":
            running = list(self._in_flight())
            if running:
                await engine.abort(running, internal=True)  # the output processor's own ids
            await _answer(send, 200, {"aborted": len(running)})
            return
        if scope.get("method") != "POST":
            await _answer(send, 200, _engine_facts(engine))
            return
        try:
            body = await _body(receive, MAX_PROBE_BODY, PROBE)
            if body is None:
                return
            ids = _probe_ids(body, int(engine.model_config.get_vocab_size()))
            label = _probe_label(body)
        except Refusal as refusal:
            await _refuse(scope, receive, send, refusal.status, str(refusal))
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
        await _answer(send, 200, {"logprobs": scores})

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
        holds = path == PAUSE and _query(scope).get("mode", "abort") in ("wait", "abort") and self._paused is None
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
            body = await _body(receive, MAX_BODY_BYTES, path)
            if body is None:
                return
            checked = check_body(path, body, _caller(scope), self.config)
        except Refusal as refusal:
            logger.warning(
                "hotweights guard: %d for POST %s from %s: %s", refusal.status, path, _caller(scope), refusal
            )
            await _refuse(scope, receive, send, refusal.status, str(refusal))
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


class Refusal(Exception):
    """A request the guard answers itself (``status``: 400 malformed, 403 not allowed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _body(receive: Receive, limit: int, path: str) -> bytes | None:
    """A request's body, at most ``limit`` bytes (else 413); None when the caller disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise Refusal(413, f"hotweights guard: a {path} body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _probe_ids(body: bytes, vocab: int) -> list[int]:
    """The token ids of a probe body, checked: 2 to ``MAX_PROBE_TOKENS`` ids, each in ``[0, vocab)`` (else 400)."""
    from hotweights.vllm.scoring import MAX_PROBE_TOKENS

    try:
        ids = json.loads(body or b"{}").get("token_ids")
    except (ValueError, AttributeError):
        ids = None
    if (
        not isinstance(ids, list)
        or not 2 <= len(ids) <= MAX_PROBE_TOKENS
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)
    ):
        raise Refusal(400, f"hotweights guard: a probe is {{'token_ids': [2 to {MAX_PROBE_TOKENS} ids < {vocab}]}}")
    return ids


def _probe_label(body: bytes) -> str | None:
    """The version label of a probe body (what requests in flight carry while it runs), at most 64 characters."""
    label = json.loads(body or b"{}").get("label")
    if label is not None and (not isinstance(label, str) or len(label) > 64):
        raise Refusal(400, "hotweights guard: a probe's label is a string of at most 64 characters")
    return label


def _engine_facts(engine: Any) -> dict[str, Any]:
    """What the trainer needs to build the family probe's reference for ``engine`` (an ``AsyncLLM``)."""
    from hotweights.vllm import compat

    config = engine.model_config.hf_config
    names = getattr(config, "architectures", None) or [None]
    return {
        "family": [names[0], compat.vllm_version(), compat.device_kind()],
        "config": config.to_json_string(use_diff=False),
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
    }


def check_body(path: str, body: bytes, caller: str | None, config: GuardConfig) -> bytes | None:
    """Check a ``/collective_rpc`` or ``/init_weight_transfer_engine`` body from ``caller``.

    Returns:
        None to pass ``body`` on as it is, or the re-encoded body (a timeout capped).

    Raises:
        Refusal: 400 for a body that is not a JSON object or a timeout that is not a number of seconds, 403 for a
            rendezvous host that is not allowed, a worker method an install does not call (:data:`RPC_METHODS`), or
            a ``reload_weights`` of anything but a hotweights checkpoint in shared memory.
    """
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Refusal(400, f"hotweights guard: the {path} body is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise Refusal(400, f"hotweights guard: the {path} body must be a JSON object")
    if path == INIT_TRANSFER:
        info = request.get("init_info")
        changed = isinstance(info, dict) and _check_init_info(info, caller, config, path)
        return json.dumps(request).encode() if changed else None
    method = request.get("method")
    args, kwargs = request.get("args", []), request.get("kwargs", {})
    if not isinstance(method, str):
        raise Refusal(400, f"hotweights guard: 'method' must be a string, not {method!r}")
    if method not in RPC_METHODS:
        raise Refusal(
            403,
            f"hotweights guard: /collective_rpc runs only the methods an install needs "
            f"({', '.join(sorted(RPC_METHODS))}), not {method[:80]!r}",
        )
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise Refusal(400, "hotweights guard: 'args' must be a JSON list and 'kwargs' a JSON object")
    timeout = request.get("timeout")
    capped = _cap(timeout, "the call's 'timeout'", config)
    changed = capped is not timeout or "timeout" not in request
    request["timeout"] = capped
    if method == ENGINE_OP:
        op = args[0] if args else kwargs.get("op")
        if op == RENDEZVOUS:
            raw = args[1] if len(args) > 1 else kwargs.get("args_json", "{}")
            try:
                join = json.loads(raw) if isinstance(raw, str) else None
            except (ValueError, RecursionError):
                join = None
            if not isinstance(join, dict):
                raise Refusal(400, f"hotweights guard: the arguments of {op!r} must be a JSON object")
            _check_host(join.get("host"), caller, config, op)
            if "timeout" in join:
                capped = _cap(join["timeout"], "the rendezvous' timeout", config)
                if capped is not join["timeout"]:
                    join["timeout"] = capped
                    changed = True
                    if len(args) > 1:
                        args[1] = json.dumps(join)
                    else:
                        kwargs["args_json"] = json.dumps(join)
    elif method == "reload_weights":
        _check_reload(args, kwargs)
    elif method == TRANSFER_INIT:
        info = args[0] if args else kwargs.get("init_info")
        if not isinstance(info, dict):
            raise Refusal(400, f"hotweights guard: {method}'s init_info must be a JSON object")
        changed |= _check_init_info(info, caller, config, method)
    return json.dumps(request).encode() if changed else None


def _check_reload(args: list[Any], kwargs: dict[str, Any]) -> None:
    """``reload_weights`` only of a checkpoint directory hotweights wrote in this host's shared memory (what the
    weights-path install sends), never of another path or another weights iterator."""
    import os.path

    path = kwargs.get("weights_path")
    other = set(kwargs) - {"weights_path", "is_checkpoint_format"}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    real = os.path.realpath(path) if isinstance(path, str) else ""
    if (
        args
        or other
        or os.path.dirname(real) != os.path.realpath(shm)
        or not os.path.basename(real).startswith("hotweights-")
    ):
        raise Refusal(
            403,
            "hotweights guard: reload_weights runs only on a hotweights checkpoint directory in the server's shared "
            f"memory ({shm}/hotweights-*), given as weights_path",
        )


def _check_init_info(info: dict[str, Any], caller: str | None, config: GuardConfig, what: str) -> bool:
    """Check the hosts an ``init_info`` names; cap its timeout. True if it was changed."""
    for key in INIT_INFO_HOSTS:
        if info.get(key) is not None:
            _check_host(info[key], caller, config, what)
    if info.get("timeout") is None:
        return False
    capped = _cap(info["timeout"], "the rendezvous' timeout", config)
    changed = capped is not info["timeout"]
    info["timeout"] = capped
    return changed


def _check_host(host: object, caller: str | None, config: GuardConfig, what: str) -> None:
    if config.host_allowed(host, caller):
        return
    own = f"your own address as this server sees it ({caller}) or loopback" if caller else "loopback"
    raise Refusal(
        403,
        f"hotweights guard: {what} may name {own} as the host to connect to, not {host!r}. Build the "
        "transport with that address (make_transport('collective', host=...)), or start the server with "
        f"--communicator-hosts {host if isinstance(host, str) else 'ADDR'} (or {HOSTS_ENV}) to allow it",
    )


def _cap(value: object, what: str, config: GuardConfig) -> Any:
    """``value`` if at most the cap (None: the cap); else the cap. Refuses what is not a number of seconds."""
    cap = config.max_rpc_timeout
    if value is None:
        return cap
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise Refusal(400, f"hotweights guard: {what} must be a number of seconds (0 to {cap:g}), not {value!r}")
    return value if value <= cap else cap


def _address(text: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _mapped_network(network: IPNetwork) -> IPNetwork:
    """An IPv4-mapped IPv6 network as its IPv4 network (addresses are compared in that form)."""
    mapped = network.network_address.ipv4_mapped if isinstance(network, ipaddress.IPv6Network) else None
    if mapped is None or network.prefixlen < 96:
        return network
    return ipaddress.IPv4Network((mapped, network.prefixlen - 96))


def _path(scope: Scope) -> str:
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    return path.removeprefix(root) if root and path.startswith(root) else path


def _query(scope: Scope) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))


def _caller(scope: Scope) -> str | None:
    """The peer's address (None over a Unix socket)."""
    client = scope.get("client")
    return str(client[0]) if client and client[0] else None


def _preflight(scope: Scope) -> bool:
    """A CORS preflight (vLLM's CORS middleware answers it; it reaches no route)."""
    if scope["type"] != "http" or scope.get("method") != "OPTIONS":
        return False
    names = {name for name, _ in scope.get("headers", ())}
    return b"origin" in names and b"access-control-request-method" in names


async def _answer(send: Send, status: int, body: Mapping[str, Any]) -> None:
    """Answer an HTTP request with ``body`` as JSON."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    """Answer ``status`` with vLLM's error shape (a websocket is closed before it is accepted)."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008 if status < 500 else 1011, "reason": message[:120]})
        return
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="hotweights"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
