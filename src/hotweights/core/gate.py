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

from hotweights.core.errors import EngineDiedError, HotWeightsTimeoutError, PartialUpdateError

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

    Generation enters in one of two ways. A gated call (``llm.generate``) holds :meth:`serving` for its whole length.
    Work that reaches the engine outside a gated call (``llm.llm_engine.add_request``, from a call that began before
    the gate existed or from code that drives the engine by hand) takes a hold with :meth:`join`, which any thread may
    release (:meth:`leave`, :meth:`leave_all`): the thread that steps the engine is not always the one that added.

    An install closes the gate to new calls, waits for the held ones, then *drains*: it waits for the engine's own
    unfinished work (``idle``). While it drains, work that joins is let in, because the engine is busy with work the
    gate never saw and the caller may be that very call, adding its next request: keeping it out would leave the
    install waiting for a call that waits for the install. Every wait is bounded by the timeout it was given.

    Example:
        >>> gate = ServingGate()
        >>> with gate.serving():
        ...     pass
        >>> with gate.installing(timeout=1.0):
        ...     pass
    """

    #: Seconds between two checks of ``dead`` while an install waits.
    DEATH_POLL_S = 0.5

    def __init__(
        self, idle: Callable[[], bool] | None = None, poll: float = 0.005, dead: Callable[[], str | None] | None = None
    ) -> None:
        self._idle = idle
        self._dead = dead
        """Why the engine can no longer answer (None while it can): an install waiting for work the engine will
        never finish fails with :class:`EngineDiedError` instead of waiting out its timeout."""
        self._dead_checked = 0.0
        """True when the engine has no unfinished work of its own: checked once the gate is held, so that work
        that never entered the gate (a call that began before the gate existed, or requests driven through the
        engine directly) is waited for too."""
        self._poll = poll
        self._cond = threading.Condition()
        self._serving = 0
        self._installing = False
        self._draining = False
        self._waiting_installs = 0
        self._owner: int | None = None
        self._joined: set[int] = set()  # threads holding a join() hold
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

    def passes(self) -> bool:
        """Whether a call from this thread passes through without waiting: it is the installing thread, or it is
        inside a held :meth:`serving` call or :meth:`join` hold."""
        me = threading.get_ident()
        return self._owner == me or getattr(self._local, "depth", 0) > 0 or me in self._joined

    @contextmanager
    def serving(self, timeout: float | None = None) -> Iterator[None]:
        """Held by a generation call; waits while an install runs or waits."""
        if self.passes():  # the installing thread's own check, or a call inside a held one
            self._local.depth = getattr(self._local, "depth", 0) + 1
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

    def join(self, timeout: float | None = None) -> bool:
        """Hold the gate for work entering the engine outside a gated call, until :meth:`leave` (from any thread).

        Waits while an install runs or waits, except while the install drains the engine's unseen work: then the
        work joins that (it runs on the old weights, and the install waits for it too). Returns False when this
        thread passes through (:meth:`passes`) and took no hold.
        """
        if self.passes():
            return False
        deadline = None if timeout is None else time.perf_counter() + timeout
        me = threading.get_ident()
        with self._cond:
            while (self._installing or self._waiting_installs) and not (self._draining and not self._idle_now()):
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise HotWeightsTimeoutError(f"generation waited {timeout} s for a weight install to finish")
                self._cond.wait(self._poll if self._draining else left)
            if self.refusal is not None:
                raise PartialUpdateError(self.refusal)
            self._serving += 1
            self._joined.add(me)
        return True

    @property
    def joined(self) -> bool:
        """Whether any :meth:`join` hold is held."""
        return bool(self._joined)

    def leave(self, thread: int | None = None) -> None:
        """Release the :meth:`join` hold of ``thread`` (default: the calling thread), if it holds one."""
        with self._cond:
            self._leave(threading.get_ident() if thread is None else thread)

    def leave_all(self) -> None:
        """Release every :meth:`join` hold: the engine has no unfinished work, so none of them covers any."""
        with self._cond:
            for thread in list(self._joined):
                self._leave(thread)

    def _leave(self, thread: int) -> None:
        if thread in self._joined:
            self._joined.discard(thread)
            self._serving -= 1
            self._cond.notify_all()

    def _idle_now(self) -> bool:
        return self._idle is None or bool(self._idle())

    def _check_alive(self) -> None:
        """Raise :class:`EngineDiedError` once ``dead`` says why (checked at most every :attr:`DEATH_POLL_S`)."""
        now = time.perf_counter()
        if self._dead is None or now - self._dead_checked < self.DEATH_POLL_S:
            return
        self._dead_checked = now
        why = self._dead()
        if why is not None:
            raise EngineDiedError(
                f"the engine died while an install waited for its running requests: {why}. Nothing was written; "
                "start a new engine (its log says why it died)"
            )

    def _drain(self, start: float, timeout: float | None) -> None:
        """With the gate closed to new calls, wait for the engine's own unfinished work and for the work that
        joined it meanwhile (:meth:`join`)."""
        with self._cond:
            while self._serving or not self._idle_now():
                self._check_alive()
                if timeout is not None and time.perf_counter() - start > timeout:
                    raise HotWeightsTimeoutError(
                        f"install waited {timeout} s for the engine's unfinished requests (generation started "
                        "outside hotweights' gate, e.g. before the first install or through llm.llm_engine) to "
                        "finish; raise lock_timeout or install between rollouts"
                    )
                self._cond.wait(self._poll)
            self._draining = False

    def _wait_free(self, start: float, timeout: float | None) -> bool:
        """(Holding the condition) wait until no install runs and no call holds the gate; False past ``timeout``."""
        while self._installing or self._serving:
            left = None if timeout is None else start + timeout - time.perf_counter()
            if left is not None and left <= 0:
                return False
            self._check_alive()
            slice_ = self.DEATH_POLL_S if self._dead is not None else None
            self._cond.wait(left if slice_ is None else slice_ if left is None else min(left, slice_))
        return True

    @contextmanager
    def installing(self, timeout: float | None = None) -> Iterator[float]:
        """Held by an install; waits for running generation calls to return. Yields the seconds it waited."""
        start = time.perf_counter()
        with self._cond:
            self._waiting_installs += 1
            try:
                ok = self._wait_free(start, timeout)
            finally:
                self._waiting_installs -= 1
                self._cond.notify_all()  # generation held off by this waiting install may go (if it gave up)
            if not ok:
                raise HotWeightsTimeoutError(
                    f"install waited {timeout} s for {self._serving} running generation call(s) to return; "
                    "raise lock_timeout or install between rollouts"
                )
            self._installing = True
            self._draining = True
            self._owner = threading.get_ident()
        try:
            self._drain(start, timeout)
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._installing = False
                self._draining = False
                self._owner = None
                self._cond.notify_all()
