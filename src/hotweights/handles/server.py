"""The HTTP client of a ``vllm serve`` process (:class:`ServerAPI`): one request at a time, its failures mapped to
hotweights' errors, the token of hotweights' guard sent only where no one on the path can read it. What the
requests mean is :mod:`hotweights.handles.remote`'s."""

from __future__ import annotations

import ipaddress
import os
from typing import Any
from urllib.parse import urlsplit

import httpx

from hotweights.core.errors import EngineNotSupportedError, HotWeightsError, HotWeightsTimeoutError, InstallError
from hotweights.vllm.introspect import WORKER_EXTENSION
from hotweights.vllm.plugin import BACKEND

__all__ = ["SERVER_FLAGS", "TOKEN_ENV", "ServerAPI", "dig", "loopback"]

#: How to start a server hotweights can install into (named by every "not supported" error).
SERVER_FLAGS = (
    f"start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION} (or --weight-transfer-config "
    f'\'{{"backend":"{BACKEND}"}}\'), e.g. `python -m hotweights.serve --model DIR`'
)
#: Where :func:`~hotweights.connect` reads the server's token when none is passed (the server's guard reads it too).
TOKEN_ENV = "HOTWEIGHTS_TOKEN"
#: Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s) closes them under a request.
_LIMITS = httpx.Limits(max_connections=32, max_keepalive_connections=8, keepalive_expiry=2.0)


class ServerAPI:
    """The routes of the server at ``url`` (``http(s)://host:port`` or ``unix:///path/to.sock``); the arguments are
    :func:`~hotweights.connect`'s.

    Raises:
        ValueError: ``url`` is not a server URL.
        EngineNotSupportedError: a token would cross plain HTTP to another host (nothing was sent).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        timeout: float,
        transport: httpx.BaseTransport | None,
        token: str | None,
        insecure_token: bool,
    ) -> None:
        self.url = url
        self.timeout = timeout
        parts = urlsplit(url)
        uds: str | None = None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"{url!r}: a Unix socket URL is unix:///path/to.sock")
            base_url, self.host, uds = "http://localhost", "", parts.path
        elif parts.scheme in ("http", "https") and parts.hostname:
            base_url, self.host = url.rstrip("/"), parts.hostname
        else:
            raise ValueError(f"{url!r} is not a server URL: use http://host:port or unix:///path/to.sock")
        token = (os.environ.get(TOKEN_ENV, "") if token is None else token).strip()
        if token and parts.scheme == "http" and not insecure_token and not loopback(self.host):
            raise EngineNotSupportedError(
                f"{url}: a hotweights token would travel in plain HTTP to another host, where anyone on the path can "
                "read it and install weights; nothing was sent. Use https:// (e.g. behind a TLS proxy), a Unix socket "
                "or an SSH tunnel to a loopback port, or pass insecure_token=True on a network you trust end to end."
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if token:
            headers["X-HotWeights-Token"] = token

        def client() -> httpx.Client:
            # trust_env=False: a proxy set for the internet must not carry requests meant for this server.
            http = transport or httpx.HTTPTransport(uds=uds, limits=_LIMITS)
            return httpx.Client(base_url=base_url, transport=http, headers=headers, timeout=timeout, trust_env=False)

        self._new_client = client
        self._client = client()

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = -1.0,
        what: str | None = None,
    ) -> Any:
        """One request; the decoded JSON answer (None for an empty one). Maps failures to hotweights' errors.

        ``timeout``: seconds to wait for the answer (None: no limit; negative: the handle's ``timeout``)."""
        what = what or f"{method} {path}"
        seconds = self.timeout if timeout is not None and timeout < 0 else timeout
        wait = httpx.Timeout(self.timeout, read=seconds, write=seconds)
        try:
            try:
                response = self._client.request(method, path, json=json_body, params=params, timeout=wait)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if method != "GET":  # a POST may have reached the server: never sent twice
                    raise
                # a kept-alive connection the server had just closed: a GET is safe to send again
                response = self._client.request(method, path, params=params, timeout=wait)
        except httpx.TimeoutException as exc:
            raise HotWeightsTimeoutError(
                f"the server at {self.url} did not answer {what} within {seconds} s; check it is alive and not "
                "blocked, or raise the timeout"
            ) from exc
        except httpx.TransportError as exc:
            raise HotWeightsTimeoutError(
                f"cannot reach the server at {self.url} for {what} ({type(exc).__name__}: {exc}); check it is running "
                "and listening there"
            ) from exc
        if response.is_success:
            return response.json() if response.content else None
        message = _error_message(response)
        if response.status_code >= 500:
            # The server closes the connection after an unhandled error, while this pool would keep it alive: the
            # next request on it would fail with "connection reset". Start a fresh pool (the old one goes with GC).
            self._client = self._new_client()
        if response.status_code == 404:
            raise EngineNotSupportedError(
                f"the server at {self.url} has no {path} route (HTTP 404: {message}): hotweights needs vLLM's dev "
                f"and RL routes; {SERVER_FLAGS}"
            )
        if response.status_code == 401:
            raise EngineNotSupportedError(
                f"the server at {self.url} refused {what} (HTTP 401: {message}); pass its token as "
                f"connect(url, token=...) or set {TOKEN_ENV} (and api_key=... if it also checks vLLM's --api-key)"
            )
        if response.status_code == 403:
            raise EngineNotSupportedError(
                f"the server at {self.url} refused {what} (HTTP 403: {message}); if it checks a key, pass it as "
                "connect(url, api_key=...)"
            )
        raise InstallError(f"the server at {self.url} failed {what} (HTTP {response.status_code}): {message}")

    def config(self) -> dict[str, Any]:
        """The server's ``VllmConfig`` as JSON (dev route ``/server_info``); empty when it cannot be read."""
        try:
            info = self.request("GET", "/server_info", params={"config_format": "json"})
        except HotWeightsError:
            return {}
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    def served_model(self, config: dict[str, Any]) -> str:
        """The served model's path (or name): from the server's ``config``, else from ``/v1/models``."""
        model = dig(config, "model_config", "model")
        if isinstance(model, str) and model:
            return model
        data = (self.request("GET", "/v1/models") or {}).get("data") or [{}]
        return str(data[0].get("root") or data[0].get("id") or "")

    def close(self) -> None:
        self._client.close()


def dig(config: dict[str, Any], *keys: str) -> Any:
    """``config[keys[0]][keys[1]]...``, or None where a level is missing."""
    value: Any = config
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _error_message(response: httpx.Response) -> str:
    """The server's error text: vLLM answers ``{"error": {"message": ...}}``, ``{"error": "..."}`` or
    ``{"detail": ...}``."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)
    return str(body)


def loopback(host: str) -> bool:
    """True for a Unix socket (no host), ``localhost`` and loopback addresses."""
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
