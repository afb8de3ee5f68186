"""Calls into an engine that never outlive the engine: bounded, and abandoned within seconds of its death.

vLLM's client waits for a call's answer on a future that nothing completes if the engine core dies while the call
runs (its monitor marks the engine dead, but leaves the future waiting): such a call would wait forever. Here every
wait on a multiprocess engine polls the engine's processes and fails with :class:`~hotweights.EngineDiedError` as
soon as one has ended. An engine core in this process does not die on its own, but it can be shut down
(``llm.llm_engine.engine_core.shutdown()``, or its finalizer): :func:`death` tells that too.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hotweights.core.errors import EngineDiedError, HotWeightsTimeoutError

__all__ = ["POLL_S", "death", "on_death", "watchable", "watched", "watched_call", "watching"]

T = TypeVar("T")

#: Seconds between two checks that the engine's processes still live while a call waits.
POLL_S = 0.5
#: Seconds a call may take beyond its own timeout (vLLM's timeout, in the engine, fires first where it has one).
GRACE_S = 5.0


def _resources(engine: Any) -> Any:
    """vLLM's client resources of an engine whose engine core runs in other processes (None: in this process)."""
    return getattr(getattr(getattr(engine, "llm_engine", engine), "engine_core", None), "resources", None)


def watchable(engine: Any) -> bool:
    """Whether ``engine``'s engine core runs in other processes, whose death :func:`death` can tell."""
    return _resources(engine) is not None


def death(engine: Any) -> str | None:
    """Why ``engine`` (a ``vllm.LLM`` or ``AsyncLLM``) can no longer answer, or None while it can."""
    resources = _resources(engine)
    if resources is None:
        return _shut_down_here(engine)
    manager = getattr(resources, "engine_manager", None)
    try:
        ended = dict(manager.finished_procs()) if manager is not None else {}
    except Exception:
        ended = {}
    if ended:
        return "its engine-core process ended (" + ", ".join(f"{n}: exit code {c}" for n, c in ended.items()) + ")"
    if getattr(resources, "engine_dead", False):
        return "vLLM reports its engine core dead (it died, or the engine was shut down)"
    return None


def _shut_down_here(engine: Any) -> str | None:
    """Why an engine whose core runs in this process (vLLM's ``InprocClient``) no longer serves, or None: it was
    shut down (the client's finalizer has run or was detached by ``shutdown()``), or its worker released the model
    (what vLLM's ``EngineCore.shutdown()`` does; also after a shutdown that bypassed the client)."""
    client = getattr(getattr(engine, "llm_engine", engine), "engine_core", None)
    if type(client).__name__ != "InprocClient":
        return None
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and not getattr(finalizer, "alive", True):
        return "it was shut down (llm.llm_engine.engine_core.shutdown()), so it serves nothing"
    worker = getattr(getattr(getattr(client, "engine_core", None), "model_executor", None), "driver_worker", None)
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is not None and "model" in vars(runner) and runner.model is None:
        return "its worker released the model (the engine core was shut down), so it serves nothing"
    return None


def on_death(engine: Any, callback: Callable[[], object]) -> bool:
    """Run ``callback`` on a daemon thread once any engine-core process of ``engine`` has ended (at once if one has
    already). The thread holds the processes' sentinels and ``callback``, never ``engine``. False where the engine
    core runs in this process (nothing to watch)."""
    manager = getattr(_resources(engine), "engine_manager", None)
    sentinels = [p.sentinel for p in getattr(manager, "processes", None) or () if getattr(p, "sentinel", None)]
    if not sentinels:
        return False

    def wait() -> None:
        try:
            multiprocessing.connection.wait(sentinels)
        except (OSError, ValueError):  # the engine and its processes were dropped: nothing left to tell
            return
        callback()

    threading.Thread(target=wait, name="hotweights-engine-death", daemon=True).start()
    return True


def watched(
    result: Callable[[float], T], engine: Any, timeout: float | None, what: str, cancel: Callable[[], Any] = lambda: 0
) -> T:
    """``result(poll)`` (a future's ``result``) until it answers, the engine dies or vLLM says it is dead
    (:class:`EngineDiedError`), or ``timeout`` + :data:`GRACE_S` seconds pass (:class:`HotWeightsTimeoutError`);
    ``cancel`` runs on the first and the last."""
    deadline = None if timeout is None else time.monotonic() + timeout + GRACE_S
    while True:
        wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
        try:
            return result(wait)
        except (TimeoutError, concurrent.futures.TimeoutError):
            pass
        except Exception as exc:
            if type(exc).__name__ != "EngineDeadError":  # vLLM's, raised by a call into an engine it knows is dead
                raise
            raise EngineDiedError(
                f"the engine is dead, so {what} cannot run: {death(engine) or exc}. Start a new engine (its log says "
                "why it died)"
            ) from exc
        why = death(engine)
        if why is not None:
            cancel()
            raise EngineDiedError(
                f"the engine died while hotweights waited for {what}: {why}. Nothing more can be installed into it; "
                "start a new engine (and check its log for why it died)"
            )
        if deadline is not None and time.monotonic() >= deadline:
            cancel()
            raise HotWeightsTimeoutError(
                f"the engine did not answer {what} within {timeout} s (+{GRACE_S:g} s); its processes live, so it may "
                "be stuck: check its log, or raise the timeout"
            )


def watched_call(call: Callable[[], T], engine: Any, timeout: float | None, what: str) -> T:
    """``call()`` (a blocking call into ``engine``), watched as :func:`watched` does: it runs on a daemon thread,
    which is left to vLLM's own clean-up if the engine dies first. Where the engine runs in this process, ``call``
    runs here."""
    if not watchable(engine):
        return call()
    box: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            box.set_result(call())
        except BaseException as exc:  # handed to the waiting thread as it is
            box.set_exception(exc)

    threading.Thread(target=run, name=f"hotweights-call-{what}", daemon=True).start()
    return watched(box.result, engine, timeout, what)


def watching(engine: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A wrap (for :func:`hotweights.core.attach.patch`) of ``engine``'s core client's ``call_utility``: each call
    (``is_sleeping``, ``reset_prefix_cache``, ``collective_rpc``, ...) watched as :func:`watched_call` watches one."""

    def wrap(call: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(call)
        def watched(method: str, *args: Any) -> T:
            return watched_call(lambda: call(method, *args), engine, None, repr(method))

        return watched

    return wrap
