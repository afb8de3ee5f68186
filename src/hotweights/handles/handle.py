"""The engine-handle contract: what differs between engine kinds, and nothing else.

An adapter (how weights are installed: layerwise reload, direct setter, vLLM's weight-transfer API, a checkpoint
path) and a transport (how bytes travel: shm, bytes, collective, cuda_ipc) never ask which kind of engine they
hold. They ask its handle to call a worker method, to keep generation off the weights while they write, to reset
the prefix cache, to record the version, and what weights it expects. One handle per engine kind: a
``vllm.LLM`` (:mod:`~hotweights.handles.llm`), an ``AsyncLLM`` (:mod:`~hotweights.handles.async_llm`), a remote
``vllm serve`` process.

A handle also holds the state of its engine that every adapter on it shares: the serving gate, the active version
(:attr:`EngineHandle.active_version`, seeded from the version the engine recorded) and the trainer's delta base
(:attr:`EngineHandle.delta_state`), so a second adapter on the same engine neither accepts a stale version nor diffs
against a stale base.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

from hotweights.core import attach
from hotweights.core.active import ActiveVersion
from hotweights.core.delta import DeltaState
from hotweights.core.errors import EngineNotSupportedError, HotWeightsTimeoutError
from hotweights.core.gate import WriteGate
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.pause import PauseOwner
from hotweights.vllm import introspect
from hotweights.vllm.introspect import WORKER_EXTENSION
from hotweights.vllm.plugin import BACKEND

__all__ = ["EngineHandle", "PauseMode"]

#: Seconds the workers may take to zero their KV cache.
CLEAR_KV_TIMEOUT = 60.0

PauseMode = Literal["wait", "abort", "keep", "recompute"]
"""What an engine with a scheduler does with requests in flight while an install writes.

``wait`` (default): the install waits for them to finish, so no response mixes weights. ``abort``: they end at
once with ``finish_reason="abort"`` (the caller retries them). ``keep``: they are frozen, keep their KV cache (computed
by the old weights) and finish on the new weights attending to it; requests admitted after the install never reuse
those blocks. ``recompute``: they are frozen, then prefilled again (prompt and tokens so far) on the new weights
before they go on; the re-prefill counts in the install's stall. With ``keep`` and ``recompute`` one response can mix
two versions: only for off-policy trainers that accept it (see ``docs/async-rl.md``).
"""


#: Seconds for the small worker calls that tell a paused engine from a sleeping one.
PAUSE_CALL_TIMEOUT = 30.0
log = logging.getLogger("hotweights")


class EngineHandle(ABC):
    """One running engine, as every adapter and transport sees it."""

    #: Engine kind, named in reports and errors (``"llm"``, ``"async_llm"``, ``"remote"``).
    kind: ClassVar[str]
    #: The :data:`PauseMode` values this engine kind honours (a ``vllm.LLM`` can only wait).
    pause_modes: ClassVar[tuple[PauseMode, ...]] = ("wait",)
    #: Whether installs into it pass the guard against a model family vLLM serves wrong (:mod:`hotweights._family`):
    #: every vLLM engine does; an engine that serves exactly the tensors it stores (a fake for tests) need not.
    guards_family: ClassVar[bool] = True
    #: How the install in progress treats requests in flight (set by :meth:`installing`).
    pause_mode: PauseMode = "wait"

    @property
    def active_version(self) -> ActiveVersion:
        """The weight version this engine serves, shared by every adapter on it; seeded from the version the engine
        recorded (so monotonic versions hold across adapters, ``connect()`` calls and trainer restarts)."""
        line: ActiveVersion = self.shared("_active_version", lambda: ActiveVersion(self.get_weight_version))
        return line

    @property
    def delta_state(self) -> DeltaState:
        """The trainer's delta base for this engine, shared by every adapter on it (see :class:`DeltaState`)."""
        state: DeltaState = self.shared("_delta_state", DeltaState)
        return state

    def shared(self, name: str, make: Callable[[], Any]) -> Any:
        """This engine's ``name`` (state every adapter and install on it shares), made by ``make()`` once, also when
        two threads ask first together."""
        return attach.value(self, name, make)  # the lock is held only to make it, never across I/O

    def check_pause_mode(self, mode: PauseMode) -> None:
        """ValueError for a pause mode this engine kind cannot honour."""
        if mode not in self.pause_modes:
            raise ValueError(
                f"pause={mode!r} is not available for a {self.describe()}: it supports {self.pause_modes} (a "
                "vllm.LLM waits for running generation calls; 'abort', 'keep' and 'recompute' need an AsyncLLM or a "
                "server)"
            )

    def set_pause_mode(self, mode: PauseMode) -> None:
        """Choose how installs treat requests in flight (a :class:`~hotweights.Fleet` sets it on each member under
        its own lock; :func:`hotweights.install` uses :meth:`installing`)."""
        self.check_pause_mode(mode)
        self.pause_mode = mode

    @contextmanager
    def installing(self, pause: PauseMode | None, timeout: float | None) -> Iterator[None]:
        """One install at a time into this engine, whatever adapter runs it, under its own ``pause`` mode: the mode
        is per install, never left for a concurrent one to read (waits at most ``timeout`` s for another install).

        This lock is the one lock of an install: an adapter's ``install`` enters it too (with ``pause=None``: the
        mode stays as :meth:`set_pause_mode` left it), and where this thread's install already holds it
        (``hotweights.install`` and a fleet take it around the adapter's install) entering again changes nothing.
        """
        if self.__dict__.get("_installing_thread") == threading.get_ident():
            yield  # inside this thread's install already
            return
        if pause is not None:
            self.check_pause_mode(pause)
        self.check_alive()  # before the lock: an engine that can no longer serve is refused at once
        lock: threading.Lock = self.shared("_install_lock", threading.Lock)
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            raise HotWeightsTimeoutError(
                f"waited {timeout} s for another install into this engine to finish; nothing was written. Retry "
                "later or raise the adapter's lock_timeout"
            )
        self._installing_thread: int | None = threading.get_ident()
        try:
            if pause is not None:
                self.pause_mode = pause
            yield
        finally:
            if pause is not None:
                self.pause_mode = "wait"
            self._installing_thread = None
            lock.release()

    def check_alive(self) -> None:  # noqa: B027 - nothing to check where the engine's death cannot be seen
        """Raise :class:`~hotweights.EngineDiedError` where the engine can no longer serve (checked before an install
        takes the lock); a no-op where its death cannot be seen from here."""

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """Worker processes (tensor x pipeline parallel size)."""

    @property
    def inprocess(self) -> bool:
        """True when the workers run in this process (tensors can be handed over by reference)."""
        return False

    @property
    @abstractmethod
    def worker_extension(self) -> str:
        """The ``worker_extension_cls`` the engine was started with (``""`` when none)."""

    @property
    def has_extension(self) -> bool:
        """Whether the engine's workers carry hotweights' worker extension: started with it, or with a subclass of it
        (such as verl's), so every ``hotweights_`` method is there. Decided once: by the class, where it can be
        imported in this process, else by asking the workers."""
        found: bool = self.shared("_has_extension", self._carries_extension)
        return found

    def _carries_extension(self) -> bool:
        known = introspect.extension_class_is_ours(self.worker_extension)
        if known is not None:
            return known
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=PAUSE_CALL_TIMEOUT)
        except Exception:  # the workers have no such method: no extension
            log.debug("hotweights: the workers of %r did not answer as hotweights' extension", self.worker_extension)
            return False
        return bool(answers) and all(isinstance(a, dict) and a.get("hotweights") == "hotweights" for a in answers)

    @property
    @abstractmethod
    def weight_transfer_backend(self) -> str:
        """The ``weight_transfer_config.backend`` the engine was started with (``""`` when none)."""

    @property
    def extensible_kv_cache(self) -> bool:
        """Whether the engine's KV cache is vLLM 0.34's extensible one (see
        :func:`hotweights.vllm.worker.runner.kv_cache_lent`)."""
        return False

    @property
    def same_host(self) -> bool:
        """True when the engine's workers run on this host (they can map this host's ``/dev/shm``)."""
        return True

    @property
    def same_hotweights(self) -> bool:
        """True when the engine's workers run this very hotweights (an engine this process started), so every worker
        method this version calls exists there; a server may run another version."""
        return True

    @property
    def route(self) -> str:
        """How an install reaches this engine's workers, decided by how it was started (the key of
        :mod:`hotweights.adapters.registry`): ``"inprocess"``, ``"extension"`` (hotweights' worker extension),
        ``"weight_transfer"`` (its weight-transfer backend) or ``"weights_path"`` (vLLM's own reload, same host).

        Raises:
            EngineNotSupportedError: an engine on another host started with neither.
        """
        if self.inprocess:
            return "inprocess"
        if self.has_extension:
            return "extension"
        if self.weight_transfer_backend == BACKEND:
            return "weight_transfer"
        if self.same_host:
            return "weights_path"
        raise EngineNotSupportedError(
            f"{self.describe()} runs on another host and was started with neither hotweights' worker extension nor "
            f"its weight-transfer backend; start it with --worker-extension-cls {WORKER_EXTENSION} or "
            f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\''
        )

    @property
    def default_transport(self) -> str:
        """The transport adapters use when the caller names none (``"shm"``: the engine is on this host)."""
        return "shm"

    @abstractmethod
    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run the worker method ``method`` (by name: never a callable, which would need pickle) on every worker;
        one result per worker. A timeout raises :class:`~hotweights.HotWeightsTimeoutError`."""

    @abstractmethod
    def expected_weights(self) -> ExpectedWeights | None:
        """What the engine accepts (checkpoint names, shapes, dtypes), or None when it cannot be known."""

    @property
    @abstractmethod
    def gate(self) -> WriteGate:
        """Keeps generation off the weights from an install's first write to its end; fails closed on demand."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes computed with the old weights; True when the engine confirmed."""

    @abstractmethod
    def set_weight_version(self, version: str) -> str | None:
        """Record ``version`` in the engine; returns what the engine now reports (None where it keeps none)."""

    @abstractmethod
    def get_weight_version(self) -> str | None:
        """The version the engine reports (None where it keeps none)."""

    def is_sleeping(self) -> bool:
        """True while the engine's weights are asleep (offloaded or discarded): they must not be written. A paused
        scheduler alone is not sleep (see :mod:`hotweights.handles.pause`)."""
        return False

    def scheduler_paused(self) -> bool | None:
        """Whether the engine's scheduler is paused, by anyone; None where it cannot be told."""
        return None

    def worker_status(self) -> dict[str, Any] | None:
        """The extension's ``status`` from the first worker (protocol, weights asleep, pause record), or None where
        there is no extension to ask (or it does not answer, e.g. a server running another hotweights)."""
        if not self.has_extension:
            return None
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=PAUSE_CALL_TIMEOUT)
        except Exception:
            log.debug("hotweights: the workers did not answer 'status'", exc_info=True)
            return None
        return answers[0] if answers and isinstance(answers[0], dict) else None

    def _asleep_though_vllm_says_so(self) -> bool:
        """vLLM reports the engine sleeping, which it also does while the scheduler is only paused: the workers'
        own answer where the worker extension can give one, else True (refuse rather than risk a write)."""
        if not self.has_extension:
            return True
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=PAUSE_CALL_TIMEOUT)
            return any(bool(a.get("weights_asleep", True)) for a in answers)
        except Exception:  # e.g. a server running an older hotweights: cannot be told
            log.debug("hotweights: the workers did not say whether their weights sleep", exc_info=True)
            return True

    def pause_owner(self, action: str = "read", owner: PauseOwner | None = None) -> PauseOwner | None:
        """The hotweights install recorded as holding the engine's pause (None: none, or no worker extension to
        keep the record); ``action="claim"`` records ``owner``, ``"release"`` clears it (both return the record
        they replaced)."""
        if not self.has_extension:
            return None
        try:
            if action == "read":
                status = self.worker_status()
                text = str(status.get("pause_owner", "")) if status else ""
            else:
                args = json.dumps({"action": action, "owner": owner.to_json() if owner else ""})
                text = str(self.call("hotweights_engine", "pause", args, timeout=PAUSE_CALL_TIMEOUT)[0])
        except Exception:  # e.g. a server running an older hotweights: no record is kept there
            log.debug("hotweights: the pause record could not be %s", action, exc_info=True)
            return None
        return PauseOwner.from_json(text)

    def clear_kv_cache(self) -> int | None:
        """Zero the KV cache after a failed write (poisoned blocks survive a prefix-cache reset); the number of
        tensors zeroed, or None where the cache cannot be reached (only the worker extension reaches it)."""
        if not self.has_extension:
            return None
        return sum(int(n) for n in self.call("hotweights_engine", "clear_kv_cache", "{}", timeout=CLEAR_KV_TIMEOUT))

    def on_shutdown(self, callback: Callable[[], object]) -> None:  # noqa: B027 - a no-op where there is no hook
        """Run ``callback()`` once the engine shuts down (e.g. to release files kept for it); ignored by handles
        of engines whose shutdown cannot be seen from here."""

    #: Whether :meth:`prompt_logprobs` can score the engine while an install holds its gate.
    probes: ClassVar[bool] = False

    def model_config(self) -> Any:
        """The transformers config of the engine's model, or None where it cannot be read from here."""
        return None

    def max_lora_rank(self) -> int | None:
        """The largest LoRA rank the engine takes; None where it was started without LoRA (``enable_lora``)."""
        return None

    def add_lora(self, name: str, lora_id: int, path: str) -> None:
        """Load the LoRA adapter saved in ``path`` as ``name`` (id ``lora_id``), replacing the one of that id: vLLM
        loads the new one first and keeps the old one if that fails."""
        from hotweights.core.errors import EngineNotSupportedError

        raise EngineNotSupportedError(f"{self.describe()}: hotweights cannot install LoRA adapters here")

    def remove_lora(self, lora_id: int) -> None:
        """Unload the LoRA adapter of id ``lora_id`` (one hotweights loaded)."""
        from hotweights.core.errors import EngineNotSupportedError

        raise EngineNotSupportedError(f"{self.describe()}: hotweights cannot remove LoRA adapters here")

    def engine_dtype(self) -> Any:
        """The dtype the engine keeps its weights in (``torch.float32`` where it cannot be read)."""
        import torch

        return torch.float32

    def vllm_fixes(self) -> tuple[str, ...] | None:
        """The mends of vLLM's reload (:data:`~hotweights.vllm.fixes.VLLM_FIXES`) in place where the engine's
        workers run: asked of the workers through the worker extension; else, where hotweights' vLLM plugin reaches
        the engine's processes, the ones this environment applies; ``()`` where the plugin is kept out
        (``VLLM_PLUGINS``); None where it cannot be told from here."""
        from hotweights.vllm.fixes import apply_vllm_fixes, vllm_fixes_reach_workers

        if self.has_extension:
            answers = self.call("hotweights_engine", "status", "{}", timeout=PAUSE_CALL_TIMEOUT)
            fixes = answers[0].get("fixes") if answers and isinstance(answers[0], dict) else None
            if isinstance(fixes, list):
                return tuple(str(f) for f in fixes)
        if self.model_config() is None:
            return None
        return apply_vllm_fixes() if vllm_fixes_reach_workers() else ()

    def family(self) -> tuple[str | None, str, str]:
        """``(architecture, vLLM version, device kind)`` of the engine, as far as they can be read from here: from
        the engine's own config in this process, else from the workers (worker extension); ``None``/``""`` where
        unknown."""
        from hotweights.vllm import compat

        config = self.model_config()
        if config is not None:
            names = getattr(config, "architectures", None) or [None]
            return names[0], compat.vllm_version(), compat.device_kind()
        if self.has_extension:  # an engine that cannot be reached raises here, as it should
            answers = self.call("hotweights_engine", "status", "{}", timeout=PAUSE_CALL_TIMEOUT)
            status = answers[0] if answers and isinstance(answers[0], dict) else {}
            if status.get("architecture"):
                return str(status["architecture"]), str(status.get("vllm", "")), str(status.get("device", ""))
        expected = self.expected_weights()
        names = list(getattr(expected, "architectures", None) or []) or [None]
        return names[0], "", ""

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        """The engine's log-probability of each of ``token_ids[1:]`` after the tokens before it, computed while the
        calling thread holds the gate (an install's own check); None where this engine kind cannot be asked so.
        ``label``: the version being installed, which requests in flight that decode while the probe runs (an
        ``AsyncLLM`` or a server under ``keep`` or ``recompute``) carry."""
        return None

    def describe(self) -> str:
        """One line for reports and errors."""
        return self.kind
