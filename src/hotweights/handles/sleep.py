"""Whether an engine's *weights* are asleep: the one state in which writing them crashes the engine (vllm#57853).

vLLM's client-side ``is_sleeping()`` is coarse: it is also True while only the KV cache sleeps (TRL wakes the
weights first, installs, then wakes the KV cache) or while the scheduler is merely paused. So a handle tracks the
engine's own ``sleep``/``wake_up`` calls (wrapped on the instance) and knows exactly; for a state it did not see (the
engine slept before hotweights first touched it) it falls back to the coarse report, refusing rather than risking
a write.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from hotweights.core import attach

__all__ = ["SleepTracker"]

WEIGHTS = "weights"


class SleepTracker:
    """Follows ``sleep(level)`` / ``wake_up(tags)`` made through one engine object."""

    def __init__(self, engine: Any, *, is_async: bool) -> None:
        self.weights_asleep: bool | None = None
        """True/False once a call was seen; None while unknown (the coarse report decides)."""
        if callable(getattr(engine, "sleep", None)) and callable(getattr(engine, "wake_up", None)):
            wrap = self._wrap_async if is_async else self._wrap
            attach.patch(engine, engine, "sleep", lambda method: wrap(method, self._slept))
            attach.patch(engine, engine, "wake_up", lambda method: wrap(method, self._woke))

    def _slept(self, *args: Any, **kwargs: Any) -> None:
        level = kwargs.get("level", args[0] if args else 1)
        if int(level) >= 1:  # level 0 only pauses scheduling
            self.weights_asleep = True

    def _woke(self, *args: Any, **kwargs: Any) -> None:
        tags = kwargs.get("tags", args[0] if args else None)
        if tags is None or WEIGHTS in tags:
            self.weights_asleep = False

    @staticmethod
    def _wrap(method: Callable[..., Any], record: Callable[..., None]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            record(*args, **kwargs)
            return result

        return call

    @staticmethod
    def _wrap_async(method: Callable[..., Awaitable[Any]], record: Callable[..., None]) -> Callable[..., Any]:
        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await method(*args, **kwargs)
            record(*args, **kwargs)
            return result

        return call

    def asleep(self, coarse: Callable[[], bool]) -> bool:
        """Whether the weights sleep: what the tracked calls say, else ``coarse()`` (the engine's own report)."""
        return self.weights_asleep if self.weights_asleep is not None else coarse()
