"""Waits on an engine's answer end when the engine dies (typed, within a poll) or when their bound passes."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from hotweights import EngineDiedError, HotWeightsTimeoutError
from hotweights.vllm import liveness


def _engine(ended: dict[str, int], dead: bool = False) -> Any:
    manager = SimpleNamespace(finished_procs=lambda: dict(ended))
    return SimpleNamespace(
        engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager, engine_dead=dead))
    )


def test_a_wait_ends_within_a_poll_of_the_engines_death() -> None:
    ended: dict[str, int] = {}
    engine = _engine(ended)
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    threading.Timer(0.3, lambda: ended.update(EngineCore=-9)).start()
    start = time.monotonic()
    with pytest.raises(EngineDiedError, match="EngineCore: exit code -9"):
        liveness.watched(never.result, engine, None, "'status'")
    assert time.monotonic() - start < 0.3 + 2 * liveness.POLL_S


def test_vllms_dead_flag_counts_as_death_and_an_answer_wins_over_polling() -> None:
    assert "dead" in (liveness.death(_engine({}, dead=True)) or "")
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(7)
    assert liveness.watched(done.result, _engine({}), 1.0, "x") == 7


def test_a_live_engine_that_does_not_answer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "GRACE_S", 0.0)
    cancelled: list[bool] = []
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(HotWeightsTimeoutError, match=r"within 0\.2 s"):
        liveness.watched(never.result, _engine({}), 0.2, "'install'", cancel=lambda: cancelled.append(True))
    assert cancelled == [True]


def test_a_call_into_an_engine_in_this_process_runs_on_the_callers_thread() -> None:
    inprocess = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace()))
    assert not liveness.watchable(inprocess)
    assert liveness.watched_call(threading.get_ident, inprocess, None, "x") == threading.get_ident()
    assert liveness.watched_call(threading.get_ident, _engine({}), None, "x") != threading.get_ident()


def test_vllms_engine_dead_error_becomes_hotweights_typed_one() -> None:
    class EngineDeadError(Exception):  # vLLM's, by name
        pass

    def call() -> None:
        raise EngineDeadError("EngineCore encountered an issue")

    with pytest.raises(EngineDiedError, match="is dead"):
        liveness.watched_call(call, _engine({}, dead=True), None, "'is_sleeping'")


def test_an_engine_in_this_process_that_was_shut_down_is_dead() -> None:
    class InprocClient:  # vLLM's, by name: its finalizer is detached by shutdown()
        def __init__(self, runner: Any) -> None:
            self._finalizer = SimpleNamespace(alive=True)
            worker = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
            self.engine_core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))

    runner = SimpleNamespace(model=object())
    client = InprocClient(runner)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    assert liveness.death(llm) is None
    runner.model = None  # EngineCore.shutdown() called past the client
    assert "released the model" in (liveness.death(llm) or "")
    runner.model = object()
    client._finalizer.alive = False  # llm.llm_engine.engine_core.shutdown()
    assert "shut down" in (liveness.death(llm) or "")
    assert not liveness.watchable(llm)  # still run on the caller's thread
