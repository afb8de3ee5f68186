"""The engine-handle contract: what differs between engine kinds, and nothing else.

An adapter (how weights are installed: layerwise reload, direct setter, vLLM's weight-transfer API, a checkpoint
path) and a transport (how bytes travel: shm, bytes, collective, cuda_ipc) never ask which kind of engine they
hold. They ask its handle to keep generation off the weights while they write, to reset the prefix cache, to record
the version and what weights it expects, and its parts the rest: :attr:`~EngineHandle.facts` what the engine is,
:attr:`~EngineHandle.workers` to call a worker method, :attr:`~EngineHandle.pausing`, :attr:`~EngineHandle.lora`
and :attr:`~EngineHandle.model` (:mod:`~hotweights.handles.workers`, :mod:`~hotweights.handles.parts`). One handle
per engine kind: a ``vllm.LLM`` (:mod:`~hotweights.handles.llm`), an ``AsyncLLM``
(:mod:`~hotweights.handles.async_llm`), a remote ``vllm serve`` process (:mod:`~hotweights.handles.remote`), an
engine in a Ray actor (:mod:`~hotweights.handles.actor`).

A handle also holds the state of its engine that every adapter on it shares: the serving gate, the active version
(:attr:`EngineHandle.active_version`, seeded from the version the engine recorded) and the trainer's delta base
(:attr:`EngineHandle.delta_state`), so a second adapter on the same engine neither accepts a stale version nor diffs
against a stale base.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

from hotweights.core import attach
from hotweights.core.active import ActiveVersion
from hotweights.core.delta import DeltaState
from hotweights.core.errors import EngineNotSupportedError, HotWeightsTimeoutError
from hotweights.core.facts import EngineFacts
from hotweights.core.gate import WriteGate
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.parts import LoraOps, Pausing, ServedModel
from hotweights.handles.workers import NoWorkers, Workers
from hotweights.vllm.introspect import WORKER_EXTENSION
from hotweights.vllm.plugin import BACKEND

__all__ = ["EngineHandle", "PauseMode"]

PauseMode = Literal["wait", "abort", "keep", "recompute"]
"""What an engine with a scheduler does with requests in flight while an install writes.

``wait`` (default): the install waits for them to finish, so no response mixes weights. ``abort``: they end at
once with ``finish_reason="abort"`` (the caller retries them). ``keep``: they are frozen, keep their KV cache (computed
by the old weights) and finish on the new weights attending to it; requests admitted after the install never reuse
those blocks. ``recompute``: they are frozen, then prefilled again (prompt and tokens so far) on the new weights
before they go on; the re-prefill counts in the install's stall. With ``keep`` and ``recompute`` one response can mix
two versions: only for off-policy trainers that accept it (see ``docs/async-rl.md``).
"""


class EngineHandle(ABC):
    """One running engine, as every adapter and transport sees it.

    It owns the state every install into the engine shares (the active version, the delta base, the install lock
    and the gate) and holds the parts that differ between engine kinds: :attr:`facts` (what the engine is),
    :attr:`workers` (a worker method by name, what the extension answers), :attr:`pausing` (its own pause and sleep),
    :attr:`lora` and :attr:`model` (what the family guard reads). The defaults of the parts are an engine that offers
    nothing more, so a test double implements the five abstract members and sets ``kind``.
    """

    #: Engine kind, named in reports and errors (``"llm"``, ``"async_llm"``, ``"remote"``).
    kind: ClassVar[str]
    #: The :data:`PauseMode` values this engine kind honours (a ``vllm.LLM`` can only wait).
    pause_modes: ClassVar[tuple[PauseMode, ...]] = ("wait",)
    #: Whether installs into it pass the guard against a model family vLLM serves wrong (:mod:`hotweights._family`):
    #: every vLLM engine does; an engine that serves exactly the tensors it stores (a fake for tests) need not.
    guards_family: ClassVar[bool] = True
    #: How the install in progress treats requests in flight (set by :meth:`installing`).
    pause_mode: PauseMode = "wait"
    #: What the engine is (workers, how it was started).
    facts: EngineFacts = EngineFacts()
    #: Its workers: a worker method by name, and what hotweights' worker extension answers.
    workers: Workers = NoWorkers()
    #: What it says of its own pause and sleep.
    pausing: Pausing = Pausing()
    #: Its LoRA adapters.
    lora: LoraOps = LoraOps()
    #: The model it serves, as the family guard reads it.
    model: ServedModel = ServedModel()

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
    def route(self) -> str:
        """How an install reaches this engine's workers, decided by how it was started (the key of
        :mod:`hotweights.adapters.registry`): ``"inprocess"``, ``"extension"`` (hotweights' worker extension, or a
        subclass of it), ``"weight_transfer"`` (its weight-transfer backend) or ``"weights_path"`` (vLLM's own
        reload, same host).

        Raises:
            EngineNotSupportedError: an engine on another host started with neither.
        """
        if self.facts.inprocess:
            return "inprocess"
        if self.workers.extension:
            return "extension"
        if self.facts.weight_transfer_backend == BACKEND:
            return "weight_transfer"
        if self.workers.same_host:
            return "weights_path"
        raise EngineNotSupportedError(
            f"{self.describe()} runs on another host and was started with neither hotweights' worker extension nor "
            f"its weight-transfer backend; start it with --worker-extension-cls {WORKER_EXTENSION} or "
            f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\''
        )

    @property
    @abstractmethod
    def gate(self) -> WriteGate:
        """Keeps generation off the weights from an install's first write to its end; fails closed on demand."""

    @abstractmethod
    def expected_weights(self) -> ExpectedWeights | None:
        """What the engine accepts (checkpoint names, shapes, dtypes), or None when it cannot be known."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes computed with the old weights; True when the engine confirmed."""

    @abstractmethod
    def set_weight_version(self, version: str) -> str | None:
        """Record ``version`` in the engine; returns what the engine now reports (None where it keeps none)."""

    @abstractmethod
    def get_weight_version(self) -> str | None:
        """The version the engine reports (None where it keeps none)."""

    def on_shutdown(self, callback: Callable[[], object]) -> None:  # noqa: B027 - a no-op where there is no hook
        """Run ``callback()`` once the engine shuts down (e.g. to release files kept for it); ignored by handles
        of engines whose shutdown cannot be seen from here."""

    def describe(self) -> str:
        """One line for reports and errors."""
        return self.kind
