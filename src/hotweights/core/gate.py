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
from collections.abc import Iterator
from contextlib import contextmanager

from hotweights.core.errors import HotWeightsTimeoutError, PartialUpdateError

__all__ = ["ServingGate"]


class ServingGate:
    """Many generation calls, or one install.

    Example:
        >>> gate = ServingGate()
        >>> with gate.serving():
        ...     pass
        >>> with gate.installing(timeout=1.0):
        ...     pass
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._serving = 0
        self._installing = False
        self._waiting_installs = 0
        self._owner: int | None = None
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
        if self._owner == me:  # a generation call made by the installing thread itself (e.g. a check)
            yield
            return
        with self._cond:
            if not self._cond.wait_for(lambda: not self._installing and not self._waiting_installs, timeout):
                raise HotWeightsTimeoutError(f"generation waited {timeout} s for a weight install to finish")
            if self.refusal is not None:
                raise PartialUpdateError(self.refusal)
            self._serving += 1
        try:
            yield
        finally:
            with self._cond:
                self._serving -= 1
                self._cond.notify_all()

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
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._installing = False
                self._owner = None
                self._cond.notify_all()
