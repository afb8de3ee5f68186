"""A readers-writer gate: generation calls share it, an install holds it alone (pure threading).

An install must never overlap a generation call: a response would be computed partly from the old weights and
partly from the new ones. Generation calls enter :meth:`ServingGate.serving` together; :meth:`installing` waits for
them to leave and keeps new ones out until the install (and its prefix-cache reset) is done. Waiting installs take
precedence over new generation calls, so a busy engine cannot starve an install.

After an install that failed while writing, :meth:`refuse` closes the gate to generation (fail closed): every call
raises :class:`PartialUpdateError` until :meth:`reopen` (a later successful install, or the user's explicit choice).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from hotweights.core.errors import HotWeightsTimeoutError, PartialUpdateError

__all__ = ["ServingGate", "WriteGate"]


class WriteGate(Protocol):
    """What an install needs from an engine kind to keep generation off the weights while it writes.

    :class:`ServingGate` is the one for a ``vllm.LLM`` (a lock its generation methods share); an ``AsyncLLM`` or a
    server pauses and resumes its scheduler instead.
    """

    refusal: str | None

    def installing(self, timeout: float | None = None) -> AbstractContextManager[float]:
        """Held from the first write until the install is done; yields the seconds it waited."""
        ...

    def refuse(self, reason: str) -> None:
        """Fail closed: refuse generation with ``reason`` until :meth:`reopen`."""
        ...

    def reopen(self) -> None:
        """Let generation in again."""
        ...


class ServingGate:
    """Many generation calls, or one install.

    Example:
        >>> gate = ServingGate()
        >>> with gate.serving():
        ...     pass
        >>> with gate.installing(timeout=1.0):
        ...     pass
    """

    def __init__(self, idle: Callable[[], bool] | None = None, poll: float = 0.005) -> None:
        self._idle = idle
        """True when the engine has no unfinished work of its own: checked once the gate is held, so that work
        that never entered the gate (a call that began before the gate existed, or requests driven through the
        engine directly) is waited for too."""
        self._poll = poll
        self._cond = threading.Condition()
        self._serving = 0
        self._installing = False
        self._waiting_installs = 0
        self._owner: int | None = None
        self._local = threading.local()  # how deep this thread is in serving(): nested calls pass through
        self.refusal: str | None = None
        """Why generation is refused (set by :meth:`refuse`), or None."""

    def refuse(self, reason: str) -> None:
        """Refuse every generation call from now on, with ``reason``, until :meth:`reopen`."""
        with self._cond:
            self.refusal = reason

    def reopen(self) -> None:
        """Let generation calls in again."""
        with self._cond:
            self.refusal = None

    @contextmanager
    def serving(self, timeout: float | None = None) -> Iterator[None]:
        """Held by a generation call; waits while an install runs or waits."""
        me = threading.get_ident()
        depth = getattr(self._local, "depth", 0)
        if self._owner == me or depth:  # the installing thread's own check, or a call inside a held one
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = max(0, self._local.depth - 1)  # holds may be released out of order
            return
        with self._cond:
            if not self._cond.wait_for(lambda: not self._installing and not self._waiting_installs, timeout):
                raise HotWeightsTimeoutError(f"generation waited {timeout} s for a weight install to finish")
            if self.refusal is not None:
                raise PartialUpdateError(self.refusal)
            self._serving += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth = max(0, self._local.depth - 1)
            with self._cond:
                self._serving -= 1
                self._cond.notify_all()

    def _wait_idle(self, start: float, timeout: float | None) -> None:
        """With the gate held (no new gated call can start), wait for the engine's own unfinished work."""
        if self._idle is None:
            return
        while not self._idle():
            if timeout is not None and time.perf_counter() - start > timeout:
                raise HotWeightsTimeoutError(
                    f"install waited {timeout} s for the engine's unfinished requests (generation started outside "
                    "hotweights' gate, e.g. before the first install or through llm.llm_engine) to finish; raise "
                    "lock_timeout or install between rollouts"
                )
            time.sleep(self._poll)

    @contextmanager
    def installing(self, timeout: float | None = None) -> Iterator[float]:
        """Held by an install; waits for running generation calls to return. Yields the seconds it waited."""
        start = time.perf_counter()
        with self._cond:
            self._waiting_installs += 1
            try:
                ok = self._cond.wait_for(lambda: not self._installing and self._serving == 0, timeout)
            finally:
                self._waiting_installs -= 1
            if not ok:
                self._cond.notify_all()
                raise HotWeightsTimeoutError(
                    f"install waited {timeout} s for {self._serving} running generation call(s) to return; "
                    "raise lock_timeout or install between rollouts"
                )
            self._installing = True
            self._owner = threading.get_ident()
        try:
            self._wait_idle(start, timeout)
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._installing = False
                self._owner = None
                self._cond.notify_all()
