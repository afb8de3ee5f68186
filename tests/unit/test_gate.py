"""ServingGate's wait for work that never entered it (pure threading, no engine)."""

from __future__ import annotations

import threading
import time

import pytest

from hotweights import HotWeightsTimeoutError
from hotweights.core.gate import ServingGate


def test_install_waits_for_unfinished_work_outside_the_gate() -> None:
    busy = threading.Event()
    busy.set()
    gate = ServingGate(idle=lambda: not busy.is_set())
    timer = threading.Timer(0.2, busy.clear)  # a call that began before the gate existed finishes in 0.2 s
    timer.start()
    with gate.installing(timeout=5.0) as waited:
        assert not busy.is_set()
    assert waited >= 0.15


def test_idle_wait_has_a_timeout_and_releases_the_gate() -> None:
    gate = ServingGate(idle=lambda: False)
    t0 = time.perf_counter()
    with pytest.raises(HotWeightsTimeoutError, match="unfinished requests"), gate.installing(timeout=0.1):
        pass
    assert time.perf_counter() - t0 < 2.0
    with gate.serving(timeout=1.0):  # the failed install did not leave the gate held
        pass


def test_new_gated_calls_wait_while_the_install_waits_for_idle() -> None:
    busy = threading.Event()
    busy.set()
    gate = ServingGate(idle=lambda: not busy.is_set())
    order: list[str] = []

    def install() -> None:
        with gate.installing(timeout=5.0):
            order.append("install")

    t = threading.Thread(target=install)
    t.start()
    time.sleep(0.05)  # the install holds the gate, waiting for idle
    with pytest.raises(HotWeightsTimeoutError), gate.serving(timeout=0.05):
        pass
    busy.clear()
    t.join(5)
    with gate.serving(timeout=1.0):
        order.append("serve")
    assert order == ["install", "serve"]
