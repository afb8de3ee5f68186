"""The parts of a :class:`~hotweights.handles.remote.RemoteHandle`: the server's workers through its
``/collective_rpc`` route (:class:`RemoteWorkers`), its pause and sleep through vLLM's routes
(:class:`RemotePausing`), and its model as hotweights' guard describes and scores it (:class:`RemoteModel`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hotweights.core.errors import EngineNotSupportedError, HotWeightsError, InstallError
from hotweights.handles.parts import PartOwner, Pausing, ServedModel
from hotweights.handles.server import ServerAPI, loopback
from hotweights.handles.workers import Workers
from hotweights.telemetry import logger as _log
from hotweights.vllm.compat import TESTED_VLLM

__all__ = ["PROBE_ROUTE", "RemoteModel", "RemotePausing", "RemoteWorkers"]

#: Seconds a resume, a version record or a cache reset may take.
SHORT_TIMEOUT = 60.0
#: The guard's route for the family probe (:mod:`hotweights.serve_guard`): GET the engine's config, POST a score.
PROBE_ROUTE = "/hotweights/probe"
#: Seconds the family probe (one short request) may take.
PROBE_TIMEOUT = 120.0


class RemoteWorkers(Workers):
    """A server's workers: ``POST /collective_rpc`` with JSON arguments. ``extension``: whether they carry hotweights'
    worker extension, as the server's config (or the workers, asked) said at connect."""

    def __init__(self, server: ServerAPI, extension_cls: str, *, extension: bool) -> None:
        super().__init__(extension_cls)
        self.server = server
        self._extension = extension
        self._same_host: bool | None = None

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
        what = f"worker call {method!r}"
        answer = self.server.request("POST", "/collective_rpc", json_body=body, timeout=wait, what=what)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):  # never guess the workers' answers
            raise InstallError(  # not EngineNotSupportedError: the call reached the workers, they may have written
                f"the server answered worker call {method!r} without a list of results ({str(answer)[:200]!r}); "
                f"it may run another vLLM than {TESTED_VLLM}: check its /collective_rpc route"
            )
        return results

    @property
    def same_host(self) -> bool:
        """Whether the server's workers see this host's ``/dev/shm`` (and then map the trainer's buckets there).

        With the worker extension, proved once: every worker reads back a file made here just now (a loopback URL
        that a port-forward or a container carries elsewhere proves nothing). A server without it (or whose
        hotweights predates the proof) counts by its URL: a Unix socket or a loopback address."""
        if self._same_host is None:
            proved = self._prove_same_host() if self.extension else None
            self._same_host = loopback(self.server.host) if proved is None else proved
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
            _log.debug("hotweights: %s cannot prove it sees this host's shared memory: %s", self.server.url, exc)
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


class ServerGate(Protocol):
    """What the parts ask of a server's gate: whether it fails closed, and the version label the probe moved."""

    refusal: str | None
    relabel: str | None


class ServerHandle(PartOwner, Protocol):
    """What :class:`RemotePausing` and :class:`RemoteModel` ask of their handle (a
    :class:`~hotweights.handles.remote.RemoteHandle`)."""

    @property
    def server(self) -> ServerAPI: ...
    @property
    def gate(self) -> ServerGate: ...


class RemotePausing(Pausing):
    """A server's sleep and pause, through vLLM's ``/is_sleeping`` and ``/is_paused``."""

    def __init__(self, handle: ServerHandle) -> None:
        super().__init__(handle.workers)
        self.handle = handle

    def weights_asleep(self) -> bool:
        """vLLM's ``/is_sleeping``, which is also True while the scheduler is only paused: then the workers say
        whether their weights sleep (worker extension); False while this handle keeps the server paused itself
        (failing closed after a failed install), which the next install lifts."""
        if self.handle.gate.refusal is not None:
            return False
        try:
            answer = self.handle.server.request("GET", "/is_sleeping", timeout=SHORT_TIMEOUT)
        except EngineNotSupportedError:  # a vLLM without the route cannot sleep through it either
            return False
        return bool((answer or {}).get("is_sleeping", False)) and self.workers.asleep()

    def scheduler_paused(self) -> bool | None:
        try:
            answer = self.handle.server.request("GET", "/is_paused", timeout=SHORT_TIMEOUT)
        except EngineNotSupportedError:  # a vLLM without the route
            return None
        return bool((answer or {}).get("is_paused", False))


class RemoteModel(ServedModel):
    """A server's model, as hotweights' guard describes it (``GET /hotweights/probe``, asked once) and scores it."""

    probes = True

    def __init__(self, handle: ServerHandle) -> None:
        super().__init__(handle.workers, handle.expected_weights)
        self.handle = handle
        self._facts: dict[str, Any] | None = None

    def _guard_facts(self) -> dict[str, Any]:
        """The engine's family, config and dtype from hotweights' guard (asked once); empty where the server runs
        no guard (or one that predates the probe route)."""
        if self._facts is None:
            try:
                facts = self.handle.server.request("GET", PROBE_ROUTE, timeout=SHORT_TIMEOUT) or {}
            except HotWeightsError:
                facts = {}
            self._facts = facts if isinstance(facts, dict) else {}
        return self._facts

    def config(self) -> Any:
        """The server engine's transformers config, for the family probe's reference (sent by hotweights' guard);
        None where the server runs no guard: then an unproven family cannot be probed from here."""
        text = self._guard_facts().get("config")
        if not text:
            return None
        from hotweights.core.probe import config_from_json

        return config_from_json(str(text))

    def dtype(self) -> torch.dtype:
        dtype = getattr(torch, str(self._guard_facts().get("dtype") or "float32"), None)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    def family(self) -> tuple[str | None, str, str]:
        """As the server's guard reads it; else from the workers where the server runs the worker extension; else
        the checkpoint's architecture, the server's ``/version``, and, for a server on this host, this host's
        device kind when it runs the same vLLM (a server elsewhere cannot tell its device: its families are
        unproven)."""
        found = self._guard_facts().get("family")
        if isinstance(found, list) and len(found) == 3:
            return (None if found[0] is None else str(found[0])), str(found[1]), str(found[2])
        arch, vllm, device = super().family()
        if vllm:
            return arch, vllm, device
        from hotweights.vllm import compat

        vllm = str((self.handle.server.request("GET", "/version", timeout=SHORT_TIMEOUT) or {}).get("version", ""))
        local = compat.vllm_version()
        return arch, vllm, compat.device_kind() if self.workers.same_host and vllm and vllm == local else ""

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        """Scored by the server's guard inside this install (it holds generation routes while the probe runs; under
        ``keep`` or ``recompute`` the requests in flight decode with it, labelled ``label``)."""
        handle = self.handle
        body: dict[str, Any] = {"token_ids": [int(t) for t in token_ids]}
        if label is not None and handle.pause_mode in ("keep", "recompute"):
            body["label"], handle.gate.relabel = label, handle.get_weight_version()
        answer = handle.server.request(
            "POST", PROBE_ROUTE, json_body=body, timeout=PROBE_TIMEOUT, what="the family probe"
        )
        scores = answer.get("logprobs") if isinstance(answer, dict) else None
        return None if scores is None else [None if s is None else float(s) for s in scores]


def _has_bytes(value: Any) -> bool:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return True
    if isinstance(value, dict):
        return any(_has_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_bytes(v) for v in value)
    return False
