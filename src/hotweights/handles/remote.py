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

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import httpx

from hotweights.core.errors import EngineNotSupportedError, HotWeightsError, HotWeightsTimeoutError, InstallError
from hotweights.core.facts import EngineFacts
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.handles.pause import PauseOwner
from hotweights.handles.remote_parts import PROBE_ROUTE, SHORT_TIMEOUT, RemoteModel, RemotePausing, RemoteWorkers
from hotweights.handles.server import SERVER_FLAGS, ServerAPI, dig
from hotweights.telemetry import best_effort
from hotweights.telemetry import logger as _log
from hotweights.versions import record_kv
from hotweights.vllm.expected import checkpoint_dir, checkpoint_expected
from hotweights.vllm.introspect import WORKER_EXTENSION

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PAUSE_MODES", "ConnectOptions", "RemoteGate", "RemoteHandle", "connect"]

PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "abort", "keep", "recompute")
#: The guard's own route for the server's KV epoch (:mod:`hotweights.handles.pause`): GET reads it, POST starts one.
KV_EPOCH_ROUTE = "/hotweights/kv_epoch"


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
        self.server = server = ServerAPI(
            url, api_key=api_key, timeout=timeout, transport=transport, token=token, insecure_token=insecure_token
        )
        self._gate = RemoteGate(self)
        workers = int(server.request("GET", "/get_world_size", params={"include_dp": "false"})["world_size"])
        config = server.config()
        self.served_model = server.served_model(config)
        """The served model's path (or name), as the server reports it."""
        ext, backend, ours = _detect(server, config)
        if not ours and not backend:
            self.close()
            raise EngineNotSupportedError(
                f"the server at {url} runs neither hotweights' worker extension nor its weight-transfer backend; "
                + SERVER_FLAGS
            )
        kv = dig(config, "cache_config", "enable_extensible_kv_cache") is True
        self.facts = EngineFacts(
            num_workers=workers, worker_extension=ext, weight_transfer_backend=backend, extensible_kv_cache=kv
        )
        self.workers = RemoteWorkers(server, ext, extension=ours)
        self.pausing = RemotePausing(self)
        self.model = RemoteModel(self)
        self._expected = _read_expected(expected, self.served_model, config)

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
        answer = self.server.request("POST", "/reset_prefix_cache", params=params, timeout=SHORT_TIMEOUT)
        return bool((answer or {}).get("success", False)) or mode == "keep"

    def set_weight_version(self, version: str) -> str | None:
        self.server.request("POST", "/update_weight_version", json_body={"new_version": version}, timeout=SHORT_TIMEOUT)
        record_kv(version, self.__dict__.pop("_kv_mode", self.pause_mode))
        return self.get_weight_version()

    def get_weight_version(self) -> str | None:
        version = (self.server.request("GET", "/weight_info", timeout=SHORT_TIMEOUT) or {}).get("weight_version")
        return None if version is None else str(version)

    def kv_epoch(self, start: bool = False) -> int | None:
        """The server's KV epoch (``start``: begin a new one first), kept by hotweights' guard; None where the server
        runs no guard (or one that predates it)."""
        try:
            answer = self.server.request("POST" if start else "GET", KV_EPOCH_ROUTE, timeout=SHORT_TIMEOUT)
        except HotWeightsError:
            return None
        epoch = answer.get("epoch") if isinstance(answer, dict) else None
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None

    def describe(self) -> str:
        how = (
            "worker extension"
            if self.workers.extension
            else f"weight-transfer backend {self.facts.weight_transfer_backend!r}"
        )
        return f"vllm serve at {self.url} ({self.facts.num_workers} worker(s), {how}, pause={self.pause_mode!r})"

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
        self.server.close()

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
        handle.pausing.owner("claim", PauseOwner.mine())
        self._holding = True
        try:
            if not paused:
                handle.server.request("POST", "/pause", params=params, timeout=timeout, what=f"pause (mode={mode!r})")
            self.salted = mode == "keep" and handle.kv_epoch(start=True) is not None
            yield time.perf_counter() - start
        finally:
            self._holding, self.relabel = False, None
            if self.refusal is None:
                handle.pausing.owner("release")
                if ours:
                    handle.server.request("POST", "/resume", timeout=SHORT_TIMEOUT)
            else:  # left paused on purpose: the next install, from whichever trainer, lifts it
                handle.pausing.owner("claim", replace(PauseOwner.mine(), failed=True))

    def _paused_already(self, timeout: float | None) -> tuple[bool, bool]:
        """(whether the server is paused now, whether this install resumes it afterwards), once no live
        hotweights install holds its pause."""
        handle = self.handle
        deadline = time.monotonic() + (SHORT_TIMEOUT if timeout is None else timeout)
        while True:
            if handle.pausing.scheduler_paused() is not True:
                return False, True
            owner = handle.pausing.owner()
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
                self.handle.server.request("DELETE", PROBE_ROUTE, timeout=SHORT_TIMEOUT)
            with best_effort("put the version label back"):
                self.handle.server.request("POST", "/update_weight_version", json_body=body, timeout=SHORT_TIMEOUT)

    def reopen(self) -> None:
        was, self.refusal = self.refusal, None
        if was is not None and not self._holding:  # inside an install, the gate resumes once it is done
            self.handle.pausing.owner("release")
            self.handle.server.request("POST", "/resume", timeout=SHORT_TIMEOUT)


def _read_expected(
    expected: ExpectedWeights | str | Path | None, served: str, config: dict[str, Any]
) -> ExpectedWeights | None:
    """``expected`` as given, else read from the served model's directory when this process can read it."""
    if isinstance(expected, ExpectedWeights):
        return expected
    if expected is not None:
        model_dir: Path | None = Path(expected)
    else:  # the served directory, or a Hub id's snapshot in this host's Hugging Face cache
        revision, cache = dig(config, "model_config", "revision"), dig(config, "load_config", "download_dir")
        model_dir = checkpoint_dir(served, revision, cache) if served else None
    if model_dir is None or not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
        if expected is not None:
            raise ValueError(f"expected={str(expected)!r} is not a directory holding *.safetensors")
        return None
    dtype = str(dig(config, "model_config", "dtype") or "").removeprefix("torch.")
    # The server's config does not say whether the head is tied: a checkpoint without lm_head.weight is.
    return checkpoint_expected(model_dir, dtype, tied=True)


def _detect(server: ServerAPI, config: dict[str, Any]) -> tuple[str, str, bool]:
    """(worker extension, weight-transfer backend, whether the workers carry hotweights' extension): from the
    server's config, else by a cheap probe. A class other than hotweights' own is its extension when the workers
    answer as it (a subclass of it, such as verl's); the server's class is never imported here."""
    ext = str(dig(config, "parallel_config", "worker_extension_cls") or "")
    backend = str(dig(config, "weight_transfer_config", "backend") or "")
    if config and (not ext or ext == WORKER_EXTENSION or backend):
        return ext, backend, ext == WORKER_EXTENSION
    try:
        answers = RemoteWorkers(server, ext, extension=False).call(
            "hotweights_engine", "status", "{}", timeout=server.timeout
        )
    except InstallError:  # the workers have no such method: no extension (a backend cannot be probed safely)
        return ext, "", False
    ours = bool(answers) and all(isinstance(a, dict) and a.get("hotweights") == "hotweights" for a in answers)
    return (ext or (WORKER_EXTENSION if ours else "")), "", ours
