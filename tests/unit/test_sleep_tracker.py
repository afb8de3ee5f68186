"""SleepTracker: the weights' sleep state from the engine's own sleep/wake_up calls (pure, no engine)."""

from __future__ import annotations

import asyncio
from typing import Any

from hotweights.vllm.patches import track_sleep


class Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return tags is None


class AsyncEngine:
    async def sleep(self, level: int = 1) -> None:
        pass

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return True


def test_unknown_until_a_call_is_seen_then_exact() -> None:
    engine = Engine()
    tracker = track_sleep(engine, is_async=False)
    assert tracker.asleep(lambda: True) is True  # unknown: the coarse report decides
    assert tracker.asleep(lambda: False) is False
    engine.sleep(level=0)  # pauses scheduling only
    assert tracker.weights_asleep is None
    engine.sleep(1)
    assert tracker.asleep(lambda: False) is True
    assert engine.wake_up(tags=["kv_cache"]) is False
    assert tracker.asleep(lambda: False) is True
    engine.wake_up(["weights"])
    assert tracker.asleep(lambda: True) is False
    engine.sleep(level=2)
    engine.wake_up()
    assert tracker.asleep(lambda: True) is False
    assert engine.calls[-1] == ("wake_up", None)  # the engine's own methods still run


def test_wrapping_is_idempotent_and_async_methods_stay_coroutines() -> None:
    engine = Engine()
    track_sleep(engine, is_async=False)
    wrapped = engine.sleep
    track_sleep(engine, is_async=False)
    assert engine.sleep is wrapped
    aengine = AsyncEngine()
    tracker = track_sleep(aengine, is_async=True)
    asyncio.run(aengine.sleep(level=1))
    assert tracker.weights_asleep is True
    assert asyncio.run(aengine.wake_up(tags=["weights"])) is True
    assert tracker.weights_asleep is False
