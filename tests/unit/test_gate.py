"""ServingGate's wait for work that never entered it (pure threading, no engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait until ``condition()`` holds (a state, not a time: the deadline only bounds a broken test)."""
    deadline = time.perf_counter() + seconds
    while not condition():
        assert time.perf_counter() < deadline, "the condition never held"
        time.sleep(0.001)


def test_a_call_inside_a_held_serving_passes_while_an_install_waits() -> None:
    """A generation call that enters the gate again from inside its own hold (``generate`` -> ``add_request``)
    must not wait behind an install that waits for it (that would deadlock both)."""
    gate = ServingGate()
    inside, nested = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def generation() -> None:
        try:
            with gate.serving():
                inside.set()
                _until(lambda: gate._waiting_installs == 1)  # the install is waiting for this call now
                with gate.serving(timeout=1.0):  # nested: passes through (times out if it waited)
                    pass
                assert gate._waiting_installs == 1  # ... while the install still waited
                nested.set()  # inside the outer hold: the install cannot have got in before this
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=generation)
    thread.start()
    assert inside.wait(10)
    with gate.installing(timeout=10.0):
        assert nested.is_set()
    thread.join(10)
    assert not errors, errors


class _FakeLLM:
    """What patches.serving_gate touches on a vllm.LLM (pure logic: the real engine is in tests/engine)."""

    def __init__(self) -> None:
        self.llm_engine = self
        self.engine_core = object()  # what introspect.engine_kind looks for
        self.requests: list[int] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: int) -> None:
        self.requests.append(request)

    def step(self) -> list[int]:
        out, self.requests = self.requests, []
        return out

    def _run_engine(self) -> list[int]:
        out: list[int] = []
        while self.llm_engine.has_unfinished_requests():
            out += self.llm_engine.step()
        return out

    def generate(self, n: int) -> list[int]:
        for i in range(n):
            self.llm_engine.add_request(i)
        return self._run_engine()


def test_concurrent_first_use_builds_one_gate_and_wraps_once() -> None:
    from hotweights.vllm import patches

    llm = _FakeLLM()
    original = llm.generate
    barrier = threading.Barrier(8)
    gates: list[ServingGate] = []

    def first_use() -> None:
        barrier.wait()
        gates.append(patches.serving_gate(llm))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len({id(g) for g in gates}) == 1
    assert llm.generate.__wrapped__ == original  # type: ignore[attr-defined]  # wrapped once, not twice
    assert llm.generate(3) == [0, 1, 2]


def test_a_call_that_looked_generate_up_before_the_gate_waits_for_the_install_at_its_first_request() -> None:
    from hotweights.vllm import patches

    llm = _FakeLLM()
    unwrapped = llm.generate  # looked up before hotweights saw the engine
    gate = patches.serving_gate(llm)
    result: list[list[int]] = []
    with gate.installing(timeout=5.0):
        thread = threading.Thread(target=lambda: result.append(unwrapped(2)))
        thread.start()
        time.sleep(0.2)
        assert llm.requests == [] and not result  # held at add_request while the install runs
    thread.join(5)
    assert result == [[0, 1]]
    with gate.installing(timeout=1.0):  # released when its _run_engine returned
        pass


def test_a_thread_driving_the_engine_by_hand_releases_the_gate_when_its_steps_leave_nothing_to_run() -> None:
    from hotweights.vllm import patches

    llm = _FakeLLM()
    gate = patches.serving_gate(llm)
    llm.llm_engine.add_request(7)  # by hand: no _run_engine will follow
    assert llm.llm_engine.step() == [7]
    with gate.installing(timeout=1.0):  # released by the step that left the engine idle
        pass


def test_holds_released_out_of_order_leave_the_thread_counted_again() -> None:
    """A request added by hand, then a generate call: the generate's ``_run_engine`` releases the earlier hold
    before the generate's own. Afterwards this thread's calls must enter the gate again, not pass through."""
    from hotweights.vllm import patches

    llm = _FakeLLM()
    gate = patches.serving_gate(llm)
    llm.llm_engine.add_request(0)  # by hand: holds the gate
    assert llm.generate(2) == [0, 0, 1]
    assert getattr(gate._local, "depth", 0) == 0
    with gate.installing(timeout=1.0):
        blocked = threading.Thread(target=lambda: llm.generate(1))
        blocked.start()
        time.sleep(0.1)
        assert blocked.is_alive()  # another thread waits for the install
    blocked.join(5)


class _SlowAddLLM(_FakeLLM):
    """A fake whose generate pauses after each request it adds, like ``LLM.generate`` rendering its next prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.added = threading.Event()
        self.go_on = threading.Event()

    def generate(self, n: int) -> list[int]:
        for i in range(n):
            self.llm_engine.add_request(i)
            self.added.set()
            self.go_on.wait(5)
        return self._run_engine()


def test_a_call_between_its_requests_when_the_first_install_starts_is_not_deadlocked() -> None:
    """Issue 26: a generate call that added its first request before the gate existed, then the install closed the
    gate. The install waits for that call to finish (on the old weights) instead of each waiting for the other."""
    from hotweights.vllm import patches

    llm = _SlowAddLLM()
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(llm.generate(3)))  # before any hotweights call
    thread.start()
    assert llm.added.wait(5)  # its first request is in the engine, unseen
    gate = patches.serving_gate(llm)
    threading.Timer(0.1, llm.go_on.set).start()  # it adds the next two while the install drains
    t0 = time.perf_counter()
    with gate.installing(timeout=5.0) as waited:
        assert result == [[0, 1, 2]] and llm.requests == []  # the whole call ran before the install wrote
    thread.join(5)
    assert waited < 2.0 and time.perf_counter() - t0 < 2.0


def test_a_request_added_on_one_thread_and_stepped_on_another_does_not_hold_the_gate() -> None:
    """Issue 26: the hold taken where a request was added is released by the step, on another thread, that left
    the engine with nothing to run; a later install does not wait for it."""
    from hotweights.vllm import patches

    llm = _FakeLLM()
    gate = patches.serving_gate(llm)
    adder = threading.Thread(target=lambda: llm.llm_engine.add_request(5))
    adder.start()
    adder.join(5)
    stepper = threading.Thread(target=llm.llm_engine.step)
    stepper.start()
    stepper.join(5)
    assert not gate.joined
    t0 = time.perf_counter()
    with gate.installing(timeout=1.0):
        pass
    assert time.perf_counter() - t0 < 0.5


def test_a_join_waits_for_an_install_that_is_writing() -> None:
    """Once the install has drained the engine, work added outside a gated call waits for the install."""
    llm_busy = threading.Event()
    gate = ServingGate(idle=lambda: not llm_busy.is_set())
    joined = threading.Event()
    with gate.installing(timeout=1.0):
        t = threading.Thread(target=lambda: (gate.join(), joined.set()))
        t.start()
        time.sleep(0.1)
        assert not joined.is_set()  # the engine is idle: this is new work, it waits
    t.join(5)
    assert joined.is_set()
    gate.leave_all()
    assert not gate.joined


def test_an_install_waiting_on_a_dead_engine_fails_within_the_death_poll() -> None:
    """Requests a dead engine holds never finish: the drain ends with EngineDiedError, not after its timeout."""
    from hotweights import EngineDiedError

    dead: list[str] = []
    gate = ServingGate(idle=lambda: False, dead=lambda: dead[0] if dead else None)
    threading.Timer(0.2, lambda: dead.append("its engine-core process ended (exit code -9)")).start()
    t0 = time.perf_counter()
    with pytest.raises(EngineDiedError, match="exit code -9"), gate.installing(timeout=30):
        pass
    assert time.perf_counter() - t0 < 0.2 + 2 * ServingGate.DEATH_POLL_S
    with gate.serving(timeout=1):  # the gate is open again: generation gets vLLM's own error from the engine
        pass


def test_an_install_waiting_for_a_call_on_a_dead_engine_fails_too() -> None:
    from hotweights import EngineDiedError

    dead: list[str] = []
    gate = ServingGate(dead=lambda: dead[0] if dead else None)
    entered, done = threading.Event(), threading.Event()

    def hung_call() -> None:
        with gate.serving():
            entered.set()
            done.wait(10)

    threading.Thread(target=hung_call, daemon=True).start()
    assert entered.wait(5)
    threading.Timer(0.2, lambda: dead.append("vLLM reports its engine core dead")).start()
    try:
        with pytest.raises(EngineDiedError, match="reports its engine core dead"), gate.installing(timeout=30):
            pass
    finally:
        done.set()
