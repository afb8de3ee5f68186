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
            ``"5"``); read once, on first use. A value that is not a whole number reads as None. Errors read as None
            too (an engine that cannot say has no version to refuse against).
    """

    def __init__(self, read: Callable[[], str | None] | None = None) -> None:
        self._read = read
        self._value: int | None = None
        self._seeded = read is None
        self._lock = threading.Lock()

    @property
    def value(self) -> int | None:
        if not self._seeded:
            with self._lock:
                if not self._seeded:
                    self._value = _parse(self._read)
                    self._seeded = True
        return self._value

    @value.setter
    def value(self, version: int | None) -> None:
        with self._lock:
            self._value, self._seeded = version, True


def _parse(read: Callable[[], str | None] | None) -> int | None:
    try:
        text = read() if read is not None else None
    except Exception:
        return None
    return int(text) if isinstance(text, str) and text.strip().isdecimal() else None
