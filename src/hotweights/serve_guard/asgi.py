"""The ASGI side of the guard: what it reads of a request's scope and body, and the answers it gives itself."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = [
    "ASGIApp",
    "Message",
    "Receive",
    "Refusal",
    "Scope",
    "Send",
    "answer",
    "caller_of",
    "is_preflight",
    "path_of",
    "query_of",
    "read_body",
    "refuse",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Refusal(Exception):
    """A request the guard answers itself (``status``: 400 malformed, 403 not allowed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(receive: Receive, limit: int, path: str) -> bytes | None:
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


def path_of(scope: Scope) -> str:
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    return path.removeprefix(root) if root and path.startswith(root) else path


def query_of(scope: Scope) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))


def caller_of(scope: Scope) -> str | None:
    """The peer's address (None over a Unix socket)."""
    client = scope.get("client")
    return str(client[0]) if client and client[0] else None


def is_preflight(scope: Scope) -> bool:
    """A CORS preflight (vLLM's CORS middleware answers it; it reaches no route)."""
    if scope["type"] != "http" or scope.get("method") != "OPTIONS":
        return False
    names = {name for name, _ in scope.get("headers", ())}
    return b"origin" in names and b"access-control-request-method" in names


async def answer(send: Send, status: int, body: Mapping[str, Any]) -> None:
    """Answer an HTTP request with ``body`` as JSON."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
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
