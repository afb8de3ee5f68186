"""The handle of a remote ``vllm serve`` process, reached over HTTP or a Unix socket.

``engine = hotweights.connect("http://127.0.0.1:8000")`` returns a :class:`RemoteHandle`; ``hotweights.install``
takes it like a local engine (same contract, report and errors). Every worker call is ``POST /collective_rpc``
with JSON arguments (the shm and collective transports' descriptors are JSON; the ``bytes`` transport's are not and
is refused); generation is kept off the weights by ``POST /pause`` ... ``POST /resume``. These are vLLM's dev and RL
routes: the server runs with ``VLLM_SERVER_DEV_MODE=1``, and with hotweights' worker extension
(``--worker-extension-cls``) or its weight-transfer backend (``--weight-transfer-config '{"backend":"hotweights"}'``).

Security: vLLM's ``--api-key`` guards only ``/v1``-style paths; the dev routes used here are open to anyone who
reaches the port, unless the server runs hotweights' guard (``python -m hotweights.serve`` does; see
:mod:`hotweights.serve_guard`), which wants a token on every route: ``connect(url, token=...)`` or
``HOTWEIGHTS_TOKEN`` sends it on every request.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict
from urllib.parse import urlsplit

import httpx

from hotweights.core.errors import EngineNotSupportedError, HotWeightsError, HotWeightsTimeoutError, InstallError
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.handles.pause import PauseOwner
from hotweights.telemetry import best_effort
from hotweights.telemetry import logger as _log
from hotweights.versions import record_kv
from hotweights.vllm.compat import TESTED_VLLM
from hotweights.vllm.expected import checkpoint_dir, checkpoint_expected
from hotweights.vllm.introspect import WORKER_EXTENSION
from hotweights.vllm.plugin import BACKEND

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PAUSE_MODES", "ConnectOptions", "RemoteGate", "RemoteHandle", "connect"]

PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "abort", "keep", "recompute")
#: How to start a server hotweights can install into (named by every "not supported" error).
SERVER_FLAGS = (
    f"start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION} (or --weight-transfer-config "
    f'\'{{"backend":"{BACKEND}"}}\'), e.g. `python -m hotweights.serve --model DIR`'
)
#: Seconds a resume, a version record or a cache reset may take.
SHORT_TIMEOUT = 60.0
#: Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s) closes them under a request.
_LIMITS = httpx.Limits(max_connections=32, max_keepalive_connections=8, keepalive_expiry=2.0)
#: Where :func:`connect` reads the server's token when none is passed (the server's guard reads it too).
TOKEN_ENV = "HOTWEIGHTS_TOKEN"
#: The guard's own route for the server's KV epoch (:mod:`hotweights.handles.pause`): GET reads it, POST starts one.
KV_EPOCH_ROUTE = "/hotweights/kv_epoch"
#: The guard's route for the family probe (:mod:`hotweights.serve_guard`): GET the engine's config, POST a score.
PROBE_ROUTE = "/hotweights/probe"
#: Seconds the family probe (one short request) may take.
PROBE_TIMEOUT = 120.0


class ConnectOptions(TypedDict, total=False):
    """The keyword arguments of :func:`connect` (defaults in :class:`RemoteHandle`)."""

    api_key: str | None
    timeout: float
    expected: ExpectedWeights | str | Path | None
    transport: httpx.BaseTransport | None
    token: str | None
    insecure_token: bool


def connect(url: str, **options: Unpack[ConnectOptions]) -> RemoteHandle:
    """A handle on the ``vllm serve`` process at ``url``, for :func:`hotweights.install`.

    Args:
        url: ``http://host:port`` (or ``https://``), or ``unix:///path/to.sock`` for a server started with
            ``--uds``.
        api_key: sent as ``Authorization: Bearer`` (vLLM checks it on ``/v1`` only; see the module docstring).
        token: the token of a server guarded by hotweights (``python -m hotweights.serve``), sent on every request
            as ``X-HotWeights-Token``. Default: ``$HOTWEIGHTS_TOKEN``; ``""`` sends none. It is sent only over
            ``https://``, a Unix socket or a loopback address: anyone on the path of plain HTTP to another host could
            read it and install weights.
        insecure_token: send the token over plain HTTP to another host anyway (a network you trust end to end).
        timeout: seconds to connect, and for each short request (pause, resume, version, cache reset).
            Worker calls take the adapter's ``rpc_timeout``.
        expected: what the engine accepts (an :class:`~hotweights.ExpectedWeights`, or a checkpoint directory to
            read it from). Default: the served model's directory when this process can read it; else None, and
            only the workers check the update (after it was sent).
        transport: an ``httpx`` transport to use instead of the network (e.g. ``httpx.MockTransport`` in tests).

    Raises:
        HotWeightsTimeoutError: the server cannot be reached within ``timeout``.
        EngineNotSupportedError: the server lacks the dev routes, or runs neither hotweights' worker extension nor
            its weight-transfer backend (the message names the flags to start it with), or refused the token
            (HTTP 401: pass ``token=`` or set ``HOTWEIGHTS_TOKEN``), or a token would cross plain HTTP to another
            host (nothing was sent: use ``https://``, or ``insecure_token=True``).

    Example:
        >>> engine = hotweights.connect("http://127.0.0.1:8000")                          # doctest: +SKIP
        >>> hotweights.install(engine, model.state_dict(), weight_version=step)            # doctest: +SKIP
    """
    return RemoteHandle(url, **options)


class RemoteHandle(EngineHandle):
    """A ``vllm serve`` process (an ``AsyncLLM`` behind vLLM's OpenAI server), driven through its HTTP routes."""

    kind: ClassVar[str] = "remote"
    probes: ClassVar[bool] = True
    pause_modes: ClassVar[tuple[PauseMode, ...]] = PAUSE_MODES

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        expected: ExpectedWeights | str | Path | None = None,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        insecure_token: bool = False,
    ) -> None:
        self.url = url
        self.timeout = timeout
        parts = urlsplit(url)
        uds: str | None = None
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"{url!r}: a Unix socket URL is unix:///path/to.sock")
            base_url, self._host, uds = "http://localhost", "", parts.path
        elif parts.scheme in ("http", "https") and parts.hostname:
            base_url, self._host = url.rstrip("/"), parts.hostname
        else:
            raise ValueError(f"{url!r} is not a server URL: use http://host:port or unix:///path/to.sock")
        token = (os.environ.get(TOKEN_ENV, "") if token is None else token).strip()
        if token and parts.scheme == "http" and not insecure_token and not _loopback(self._host):
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
        self._same_host: bool | None = None
        self._gate = RemoteGate(self)
        self._num_workers = int(self._request("GET", "/get_world_size", params={"include_dp": "false"})["world_size"])
        self._config = self._server_config()
        self.served_model = self._served_model()
        """The served model's path (or name), as the server reports it."""
        self._extension, self._backend = self._detect()
        if not self._extension and not self._backend:
            self.close()
            raise EngineNotSupportedError(
                f"the server at {url} runs neither hotweights' worker extension nor its weight-transfer backend; "
                + SERVER_FLAGS
            )
        self._expected = _read_expected(expected, self.served_model, self._config)

    # ------------------------------------------------------------------------------------------------ HTTP
    def _request(
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

    @property
    def extensible_kv_cache(self) -> bool:
        return _dig(self._config, "cache_config", "enable_extensible_kv_cache") is True

    def _server_config(self) -> dict[str, Any]:
        """The server's ``VllmConfig`` as JSON (dev route ``/server_info``); empty when it cannot be read."""
        try:
            info = self._request("GET", "/server_info", params={"config_format": "json"})
        except HotWeightsError:
            return {}
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    def _served_model(self) -> str:
        model = _dig(self._config, "model_config", "model")
        if isinstance(model, str) and model:
            return model
        data = (self._request("GET", "/v1/models") or {}).get("data") or [{}]
        return str(data[0].get("root") or data[0].get("id") or "")

    def _detect(self) -> tuple[str, str]:
        """(worker extension, weight-transfer backend): from the server's config, else by a cheap probe."""
        if self._config:
            ext = _dig(self._config, "parallel_config", "worker_extension_cls")
            backend = _dig(self._config, "weight_transfer_config", "backend")
            if not ext or ext == WORKER_EXTENSION or backend:
                return (str(ext) if ext else ""), (str(backend) if backend else "")
            # another class: hotweights' extension when the workers answer as it (a subclass of it)
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=self.timeout)
        except InstallError:  # the workers have no such method: no extension (a backend cannot be probed safely)
            return "", ""
        loaded = bool(answers) and all(isinstance(a, dict) and a.get("hotweights") == "hotweights" for a in answers)
        return (WORKER_EXTENSION if loaded else ""), ""

    # ------------------------------------------------------------------------------------------------ contract
    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_extension(self) -> str:
        return self._extension

    @property
    def weight_transfer_backend(self) -> str:
        return self._backend

    @property
    def same_host(self) -> bool:
        """Whether the server's workers see this host's ``/dev/shm`` (and then map the trainer's buckets there).

        With the worker extension, proved once per handle: every worker reads back a file made here just now (a
        loopback URL that a port-forward or a container carries elsewhere proves nothing). A server without it (or
        whose hotweights predates the proof) counts by its URL: a Unix socket or a loopback address."""
        if self._same_host is None:
            proved = self._prove_same_host() if self.has_extension else None
            self._same_host = _loopback(self._host) if proved is None else proved
        return self._same_host

    def _prove_same_host(self) -> bool | None:
        """True when every worker read back a file made here in shared memory, False when one did not; None when
        the server cannot say."""
        from hotweights.transports.shm_files import SHM_DIR

        name, nonce = f"hotweights-proof-{secrets.token_hex(16)}", secrets.token_hex(16)
        path = SHM_DIR / name
        try:
            path.write_text(nonce, encoding="ascii")
            answers = self.call("hotweights_engine", "sees_shm", json.dumps({"name": name}), timeout=SHORT_TIMEOUT)
        except (InstallError, EngineNotSupportedError, OSError) as exc:  # e.g. an older server: no such operation
            _log.debug("hotweights: %s cannot prove it sees this host's shared memory: %s", self.url, exc)
            return None
        finally:
            path.unlink(missing_ok=True)
        return bool(answers) and all(a == nonce for a in answers)

    @property
    def same_hotweights(self) -> bool:
        return False  # the server may run another hotweights version: only the calls every version has

    @property
    def default_transport(self) -> str:
        """``"shm"`` on this host; else ``"collective"`` (for a trainer reachable from the server at an address
        other than loopback, build the adapter with ``make_transport("collective", host=<trainer address>)``)."""
        return "shm" if self.same_host else "collective"

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout}
        try:
            json.dumps(body)  # fail before any I/O on a value JSON cannot carry
        except (TypeError, ValueError) as exc:
            binary = "bytes" if _has_bytes(body) else "a value JSON cannot carry"
            raise EngineNotSupportedError(
                f"{method!r} cannot reach a remote server: its arguments hold {binary} ({exc}), and worker calls "
                "travel as JSON. Use the 'shm' transport (same host) or 'collective' (any host), not 'bytes'."
            ) from exc
        wait = None if timeout is None else timeout + 5.0  # vLLM's own timeout fires first
        answer = self._request("POST", "/collective_rpc", json_body=body, timeout=wait, what=f"worker call {method!r}")
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):  # never guess the workers' answers
            raise InstallError(  # not EngineNotSupportedError: the call reached the workers, they may have written
                f"the server answered worker call {method!r} without a list of results ({str(answer)[:200]!r}); "
                f"it may run another vLLM than {TESTED_VLLM}: check its /collective_rpc route"
            )
        return results

    def expected_weights(self) -> ExpectedWeights | None:
        return self._expected

    @property
    def gate(self) -> RemoteGate:
        return self._gate

    def reset_prefix_cache(self) -> bool:
        """``recompute``: preempt the requests in flight (the server's guard holds new requests and answers the resume
        once they were prefilled again on the new weights). ``keep``: the requests in flight keep their blocks, and
        the KV epoch the install started on the server (through its guard) keeps them from later requests; a server
        without hotweights' guard cannot salt its requests, so its requests in flight are recomputed instead (a
        warning says so, and :func:`hotweights.weight_versions_of` reports ``"recomputed"``)."""
        mode = self.pause_mode
        if mode == "keep" and not self._gate.salted:
            _log.warning(
                "hotweights: pause='keep' on %s: the server does not run hotweights' guard, which keeps the old "
                "weights' KV blocks from requests admitted after the install, so its requests in flight are "
                "recomputed on the new weights instead. Start it with `python -m hotweights.serve` (or --middleware "
                "hotweights.serve_guard.HotWeightsGuard) to keep their KV, or pass pause='recompute'",
                self.url,
            )
            mode = "recompute"
        self._kv_mode = mode
        params = {"reset_running_requests": "true" if mode == "recompute" else "false"}
        answer = self._request("POST", "/reset_prefix_cache", params=params, timeout=SHORT_TIMEOUT)
        return bool((answer or {}).get("success", False)) or mode == "keep"

    def set_weight_version(self, version: str) -> str | None:
        self._request("POST", "/update_weight_version", json_body={"new_version": version}, timeout=SHORT_TIMEOUT)
        record_kv(version, self.__dict__.pop("_kv_mode", self.pause_mode))
        return self.get_weight_version()

    def kv_epoch(self, start: bool = False) -> int | None:
        """The server's KV epoch (``start``: begin a new one first), kept by hotweights' guard; None where the server
        runs no guard (or one that predates it)."""
        try:
            answer = self._request("POST" if start else "GET", KV_EPOCH_ROUTE, timeout=SHORT_TIMEOUT)
        except HotWeightsError:
            return None
        epoch = answer.get("epoch") if isinstance(answer, dict) else None
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None

    def _engine_facts(self) -> dict[str, Any]:
        """The engine's family, config and dtype from hotweights' guard (asked once); empty where the server runs
        no guard (or one that predates the probe route)."""
        facts = self.__dict__.get("_facts")
        if facts is None:
            try:
                facts = self._request("GET", PROBE_ROUTE, timeout=SHORT_TIMEOUT) or {}
            except HotWeightsError:
                facts = {}
            self.__dict__["_facts"] = facts = facts if isinstance(facts, dict) else {}
        return facts

    def model_config(self) -> Any:
        """The server engine's transformers config, for the family probe's reference (sent by hotweights' guard);
        None where the server runs no guard: then an unproven family cannot be probed from here."""
        text = self._engine_facts().get("config")
        if not text:
            return None
        from hotweights.core.probe import config_from_json

        return config_from_json(str(text))

    def engine_dtype(self) -> Any:
        import torch

        dtype = getattr(torch, str(self._engine_facts().get("dtype") or "float32"), None)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        """Scored by the server's guard inside this install (it holds generation routes while the probe runs; under
        ``keep`` or ``recompute`` the requests in flight decode with it, labelled ``label``)."""
        body: dict[str, Any] = {"token_ids": [int(t) for t in token_ids]}
        if label is not None and self.pause_mode in ("keep", "recompute"):
            body["label"], self._gate.relabel = label, self.get_weight_version()
        answer = self._request("POST", PROBE_ROUTE, json_body=body, timeout=PROBE_TIMEOUT, what="the family probe")
        scores = answer.get("logprobs") if isinstance(answer, dict) else None
        return None if scores is None else [None if s is None else float(s) for s in scores]

    def family(self) -> tuple[str | None, str, str]:
        """As the server's guard reads it; else from the workers where the server runs the worker extension; else
        the checkpoint's architecture, the server's ``/version``, and, for a server on this host, this host's
        device kind when it runs the same vLLM (a server elsewhere cannot tell its device: its families are
        unproven)."""
        found = self._engine_facts().get("family")
        if isinstance(found, list) and len(found) == 3:
            return (None if found[0] is None else str(found[0])), str(found[1]), str(found[2])
        arch, vllm, device = super().family()
        if vllm:
            return arch, vllm, device
        from hotweights.vllm import compat

        vllm = str((self._request("GET", "/version", timeout=SHORT_TIMEOUT) or {}).get("version", ""))
        local = compat.vllm_version()
        return arch, vllm, compat.device_kind() if self.same_host and vllm and vllm == local else ""

    def get_weight_version(self) -> str | None:
        version = (self._request("GET", "/weight_info", timeout=SHORT_TIMEOUT) or {}).get("weight_version")
        return None if version is None else str(version)

    def is_sleeping(self) -> bool:
        """vLLM's ``/is_sleeping``, which is also True while the scheduler is only paused: then the workers say
        whether their weights sleep (worker extension); False while this handle keeps the server paused itself
        (failing closed after a failed install), which the next install lifts."""
        if self._gate.refusal is not None:
            return False
        try:
            answer = self._request("GET", "/is_sleeping", timeout=SHORT_TIMEOUT)
        except EngineNotSupportedError:  # a vLLM without the route cannot sleep through it either
            return False
        return bool((answer or {}).get("is_sleeping", False)) and self._asleep_though_vllm_says_so()

    def scheduler_paused(self) -> bool | None:
        try:
            answer = self._request("GET", "/is_paused", timeout=SHORT_TIMEOUT)
        except EngineNotSupportedError:  # a vLLM without the route
            return None
        return bool((answer or {}).get("is_paused", False))

    def describe(self) -> str:
        how = "worker extension" if self._extension else f"weight-transfer backend {self._backend!r}"
        return f"vllm serve at {self.url} ({self._num_workers} worker(s), {how}, pause={self.pause_mode!r})"

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` at :meth:`close`: this trainer is done with the server (e.g. the bucket files kept
        for its next install go then, not at exit)."""
        self.__dict__.setdefault("_on_close", []).append(callback)

    def close(self) -> None:
        """Close the HTTP connections and release what this trainer kept for the server (the server keeps
        running)."""
        pending = self.__dict__.get("_on_close", [])
        while pending:
            with best_effort("release what was kept for the server"):
                pending.pop()()
        self._client.close()

    def __enter__(self) -> RemoteHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RemoteGate:
    """The :class:`~hotweights.core.gate.WriteGate` of a server: ``POST /pause?mode=...``, then ``/resume``.

    A server that is paused already (not asleep: checked before) is not paused again (see
    :mod:`hotweights.handles.pause`): someone else's pause is kept, and the install leaves it; a pause left by a
    hotweights install whose trainer is gone, or by one that failed while writing, is taken over and lifted after
    the install; a live install's pause is waited for (up to the lock timeout). While it holds the pause, the
    install is recorded on the workers as its owner.

    Fails closed across the wire: after an install that failed while writing (:meth:`refuse`), the server is left
    paused (requests queue, none is served from a mix of old and new layers) until a full install succeeds or
    :meth:`reopen` is called (``adapter.reopen_serving()``).
    """

    def __init__(self, handle: RemoteHandle) -> None:
        self.handle = handle
        self.refusal: str | None = None
        self._holding = False
        self.relabel: str | None = None
        """The server's version label before the family probe labelled requests in flight with the new one (put back
        if the install fails)."""
        self.salted = False
        """Whether the running ``keep`` install started a new KV epoch on the server (its guard salts requests)."""

    @contextmanager
    def installing(self, timeout: float | None = None) -> Iterator[float]:
        handle, start = self.handle, time.perf_counter()
        mode = handle.pause_mode
        # "keep" and "recompute" freeze requests in flight with their KV blocks; the other modes drain, so the caches
        # can go now. Under "keep" a new KV epoch starts once the server is paused (every request admitted from then
        # on starts on the new weights).
        frozen = mode in ("keep", "recompute")
        params = {"mode": "keep" if frozen else mode, "clear_cache": "false" if frozen else "true"}
        self.salted = False
        paused, ours = self._paused_already(timeout)
        handle.pause_owner("claim", PauseOwner.mine())
        self._holding = True
        try:
            if not paused:
                handle._request("POST", "/pause", params=params, timeout=timeout, what=f"pause (mode={mode!r})")
            self.salted = mode == "keep" and handle.kv_epoch(start=True) is not None
            yield time.perf_counter() - start
        finally:
            self._holding, self.relabel = False, None
            if self.refusal is None:
                handle.pause_owner("release")
                if ours:
                    handle._request("POST", "/resume", timeout=SHORT_TIMEOUT)
            else:  # left paused on purpose: the next install, from whichever trainer, lifts it
                handle.pause_owner("claim", replace(PauseOwner.mine(), failed=True))

    def _paused_already(self, timeout: float | None) -> tuple[bool, bool]:
        """(whether the server is paused now, whether this install resumes it afterwards), once no live
        hotweights install holds its pause."""
        handle = self.handle
        deadline = time.monotonic() + (SHORT_TIMEOUT if timeout is None else timeout)
        while True:
            if handle.scheduler_paused() is not True:
                return False, True
            owner = handle.pause_owner()
            if owner is None:  # someone else's pause: the install goes on under it and leaves it
                return True, False
            if owner.lifted_by_next_install():
                return True, True
            if time.monotonic() > deadline:
                raise HotWeightsTimeoutError(
                    f"the server is paused by another hotweights install ({owner.describe()}), still running after "
                    f"{timeout} s; nothing was written. Retry once it is done, or POST /resume if it is not"
                )
            time.sleep(0.1)

    def refuse(self, reason: str) -> None:
        self.refusal = reason
        relabel, self.relabel = self.relabel, None
        if relabel is not None:  # requests in flight decoded during the family probe that failed: abort them
            body = {"new_version": relabel}
            with best_effort("abort the requests in flight (fail closed)"):
                self.handle._request("DELETE", PROBE_ROUTE, timeout=SHORT_TIMEOUT)
            with best_effort("put the version label back"):
                self.handle._request("POST", "/update_weight_version", json_body=body, timeout=SHORT_TIMEOUT)

    def reopen(self) -> None:
        was, self.refusal = self.refusal, None
        if was is not None and not self._holding:  # inside an install, the gate resumes once it is done
            self.handle.pause_owner("release")
            self.handle._request("POST", "/resume", timeout=SHORT_TIMEOUT)


def _read_expected(
    expected: ExpectedWeights | str | Path | None, served: str, config: dict[str, Any]
) -> ExpectedWeights | None:
    """``expected`` as given, else read from the served model's directory when this process can read it."""
    if isinstance(expected, ExpectedWeights):
        return expected
    if expected is not None:
        model_dir: Path | None = Path(expected)
    else:  # the served directory, or a Hub id's snapshot in this host's Hugging Face cache
        revision, cache = _dig(config, "model_config", "revision"), _dig(config, "load_config", "download_dir")
        model_dir = checkpoint_dir(served, revision, cache) if served else None
    if model_dir is None or not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
        if expected is not None:
            raise ValueError(f"expected={str(expected)!r} is not a directory holding *.safetensors")
        return None
    dtype = str(_dig(config, "model_config", "dtype") or "").removeprefix("torch.")
    # The server's config does not say whether the head is tied: a checkpoint without lm_head.weight is.
    return checkpoint_expected(model_dir, dtype, tied=True)


def _dig(config: dict[str, Any], *keys: str) -> Any:
    value: Any = config
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _has_bytes(value: Any) -> bool:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return True
    if isinstance(value, dict):
        return any(_has_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_bytes(v) for v in value)
    return False


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


def _loopback(host: str) -> bool:
    """True for a Unix socket (no host), ``localhost`` and loopback addresses."""
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
