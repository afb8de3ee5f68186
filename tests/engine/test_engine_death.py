"""An engine that dies while an install waits on it: the install fails within seconds, typed, instead of waiting
forever (vLLM's client leaves a call's future waiting when its engine core dies)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

import hotweights

from .conftest import TinyCheckpoint, Variant, start_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


def test_an_engine_killed_while_an_install_waits_fails_it_within_seconds(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the next module's engines run in-process again
    core = llm.llm_engine.engine_core
    pid = core.resources.engine_manager.processes[0].pid
    outcome: list[BaseException | hotweights.InstallReport] = []

    def install() -> None:
        try:
            outcome.append(hotweights.install(llm, b.state_dict(), weight_version=1))
        except BaseException as exc:  # the outcome under test
            outcome.append(exc)

    try:
        os.kill(pid, signal.SIGSTOP)  # the engine stops answering: the install's first call waits on it
        thread = threading.Thread(target=install, daemon=True)
        thread.start()
        time.sleep(2.0)
        assert not outcome, outcome  # it waits: the engine lives, stopped
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # ... and dies while the call waits
        thread.join(30.0)
        assert outcome, "the install still waits 30 s after the engine died"
        took = time.monotonic() - killed
        assert isinstance(outcome[0], hotweights.EngineDiedError), repr(outcome[0])
        assert "engine-core process ended" in str(outcome[0]) or "dead" in str(outcome[0])
        assert took < 10.0, took
        # the next install into the dead engine is refused at once, typed
        start = time.monotonic()
        with pytest.raises(hotweights.EngineDiedError):
            hotweights.install(llm, a.state_dict(), weight_version=2)
        assert time.monotonic() - start < 10.0
    finally:
        with_ok = getattr(core, "shutdown", None)
        if with_ok is not None:
            with_ok()


def test_an_engine_killed_while_generating_and_installing_ends_both_within_seconds(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """A thread loops ``generate`` (three prompts per call); the engine core stops with a call in flight, an install
    waits for that call, and the engine core is killed. vLLM's own monitor then shuts its client down, which leaves
    the ``generate`` waiting for outputs forever and the install waiting for it (seen: both still waiting 120 s
    later). Both end within seconds: ``generate`` with vLLM's ``EngineDeadError``, the install with
    ``EngineDiedError``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from hotweights.testing import PROMPTS, greedy_vllm

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the next module's engines run in-process again
    core = llm.llm_engine.engine_core
    pid = core.resources.engine_manager.processes[0].pid
    ended: dict[str, BaseException] = {}
    calls = [0]

    def generating() -> None:
        try:
            while True:
                greedy_vllm(llm, PROMPTS[:3])
                calls[0] += 1
        except BaseException as exc:  # the outcome under test
            ended["generate"] = exc

    def installing() -> None:
        try:
            hotweights.install(llm, a.state_dict(), weight_version=2)
        except BaseException as exc:  # the outcome under test
            ended["install"] = exc

    try:
        hotweights.install(llm, b.state_dict(), weight_version=1)  # the engine's gate exists
        threads = [threading.Thread(target=generating, daemon=True)]
        threads[0].start()
        while calls[0] < 2:
            assert not ended, ended
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)  # a generate call is in flight and stays there
        threads.append(threading.Thread(target=installing, daemon=True))
        threads[1].start()
        time.sleep(1.5)
        assert not ended, ended  # both wait on the stopped engine
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(max(0.0, killed + 15.0 - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"still waiting 15 s after the kill: {sorted(ended)} ended"
        assert isinstance(ended["generate"], (EngineDeadError, hotweights.HotWeightsError)), repr(ended["generate"])
        assert isinstance(ended["install"], hotweights.EngineDiedError), repr(ended["install"])
    finally:
        core.shutdown()
