"""A pause mode belongs to its install (issue 27: no per-call option on a shared object): a second install into the
same engine, with another mode, neither changes the running one's mode nor runs beside it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import hotweights
from hotweights import HotWeightsTimeoutError, _install
from hotweights.handles.handle import EngineHandle


class Handle(EngineHandle):  # type: ignore[misc]
    kind = "fake"
    pause_modes = ("wait", "abort", "keep")


for _method in Handle.__abstractmethods__:
    setattr(Handle, _method, lambda *a, **k: None)
Handle.__abstractmethods__ = frozenset()


class Adapter:
    """Records the engine's pause mode as its install starts and as it ends; the first install waits for a go."""

    expected = None

    def __init__(self, engine: Handle, lock_timeout: float = 10.0) -> None:
        self.engine, self.lock_timeout = engine, lock_timeout
        self.entered, self.go = threading.Event(), threading.Event()
        self.seen: list[tuple[int, str, str]] = []

    def install(self, manifest: Any, items: Any, **kwargs: Any) -> str:
        start = self.engine.pause_mode
        if manifest.weight_version == 1:
            self.entered.set()
            assert self.go.wait(10)
        self.seen.append((manifest.weight_version, start, self.engine.pause_mode))
        return "ok"


@pytest.fixture(autouse=True)
def _no_family_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_install, "check_family", lambda *a, **k: None)


def test_a_concurrent_install_neither_changes_the_running_ones_pause_nor_runs_beside_it() -> None:
    engine = Handle()
    adapter = Adapter(engine)
    sd = {"w": torch.zeros(2)}
    first = threading.Thread(
        target=hotweights.install, args=(engine, sd), kwargs={"weight_version": 1, "adapter": adapter, "pause": "keep"}
    )
    first.start()
    assert adapter.entered.wait(5)
    second = threading.Thread(
        target=hotweights.install, args=(engine, sd), kwargs={"weight_version": 2, "adapter": adapter, "pause": "abort"}
    )
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second install ran beside the first"
    adapter.go.set()
    first.join(5)
    second.join(5)
    assert adapter.seen == [(1, "keep", "keep"), (2, "abort", "abort")]
    assert engine.pause_mode == "wait"  # nothing left behind for the next install


def test_waiting_for_another_install_is_bounded_and_typed() -> None:
    engine = Handle()
    adapter = Adapter(engine, lock_timeout=0.3)
    sd = {"w": torch.zeros(2)}
    first = threading.Thread(
        target=hotweights.install, args=(engine, sd), kwargs={"weight_version": 1, "adapter": adapter}
    )
    first.start()
    assert adapter.entered.wait(5)
    try:
        with pytest.raises(HotWeightsTimeoutError, match="another install into this engine"):
            hotweights.install(engine, sd, weight_version=2, adapter=adapter)
    finally:
        adapter.go.set()
        first.join(5)
    assert [v for v, _, _ in adapter.seen] == [1]


def test_a_pause_the_engine_cannot_honour_is_refused_before_anything() -> None:
    class LLMLike(Handle):  # type: ignore[misc]
        pause_modes = ("wait",)

    engine = LLMLike()
    adapter = Adapter(engine)
    with pytest.raises(ValueError, match="pause='keep' is not available"):
        hotweights.install(engine, {"w": torch.zeros(2)}, weight_version=1, adapter=adapter, pause="keep")
    assert adapter.seen == []
