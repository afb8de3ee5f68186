"""Building one engine's adapter never holds up another engine's (issue 26: no I/O under a global lock)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import hotweights
from hotweights.adapters import presets


def test_a_slow_adapter_build_does_not_block_another_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotweights.core.facts import EngineFacts
    from hotweights.handles.handle import EngineHandle

    started, release = threading.Event(), threading.Event()
    built: list[str] = []

    class Handle(EngineHandle):  # type: ignore[misc]
        kind = "fake"
        facts = EngineFacts(inprocess=True)

        def __init__(self, name: str) -> None:
            self.name = name

    for method in Handle.__abstractmethods__:
        setattr(Handle, method, lambda *a, **k: None)
    Handle.__abstractmethods__ = frozenset()

    def build(handle: Any, **kwargs: Any) -> Any:
        if handle.name == "slow":
            started.set()
            release.wait(10)
        built.append(handle.name)
        return object()

    monkeypatch.setattr(presets, "VLLMInProcessAdapter", build)
    slow, fast = Handle("slow"), Handle("fast")
    t = threading.Thread(target=hotweights.adapter_for, args=(slow,))
    t.start()
    assert started.wait(5)
    t0 = time.perf_counter()
    first = hotweights.adapter_for(fast)  # another engine: not held up by the slow one
    assert time.perf_counter() - t0 < 1.0 and built == ["fast"]
    assert hotweights.adapter_for(fast) is first  # built once
    release.set()
    t.join(5)
    assert built == ["fast", "slow"]
