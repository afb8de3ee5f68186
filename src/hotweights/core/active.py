"""The weight version an engine serves, held once per engine and shared by every adapter on it (pure threading).

A version held per adapter starts at None, so a second adapter, a new ``connect()``, or a restarted trainer would
accept any version. :class:`ActiveVersion` is seeded instead from the version the engine itself recorded (vLLM keeps
one: ``get_weight_version()``), read once on first use.

Example:
    >>> line = ActiveVersion(read=lambda: "7")
    >>> line.value
    7
    >>> line.value = 8
    >>> line.value
    8
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ActiveVersion"]


class ActiveVersion:
    """The active weight version of one engine: None until the engine reports one or an install records one.

    Args:
        read: returns the version the engine recorded (a string, e.g. vLLM's ``"default"`` before any install, or
            ``"5"``); read on first use. A value that is not a whole number reads as None (no version yet). A read
            that raises is never taken for "no version": it is retried on the next use, and :meth:`checked` raises
            until one succeeds.
    """

    def __init__(self, read: Callable[[], str | None] | None = None) -> None:
        self._read = read
        self._value: int | None = None
        self._seeded = read is None
        self._lock = threading.Lock()

    def checked(self) -> int | None:
        """The version, reading the engine's if it was never read; raises what the read raised."""
        if not self._seeded:
            with self._lock:
                if not self._seeded and self._read is not None:
                    text = self._read()
                    self._value = int(text) if isinstance(text, str) and text.strip().isdecimal() else None
                    self._seeded = True
        return self._value

    @property
    def value(self) -> int | None:
        """The version, or None while it is unknown (a failed read is retried on the next use)."""
        try:
            return self.checked()
        except Exception:
            return None

    @value.setter
    def value(self, version: int | None) -> None:
        with self._lock:
            self._value, self._seeded = version, True
