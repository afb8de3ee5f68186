"""Every patch hotweights makes to a vLLM engine object, each recorded with :func:`hotweights.core.attach.patch` so
that ``detach`` undoes it: the serving gate around the ``LLM``'s generation methods and its ``add_request``, the
core client's serialised sends, its calls watched for the engine core's death, and callbacks at its shutdown."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from hotweights.core import attach
from hotweights.core.gate import ServingGate
from hotweights.vllm.introspect import has_unfinished_requests, llm_engine
from hotweights.vllm.liveness import death, on_death, watched_call

__all__ = [
    "GENERATION_METHODS",
    "on_shutdown",
    "release",
    "serialize_core_sends",
    "serving_gate",
    "watch_core_calls",
]

_log = logging.getLogger("hotweights")
_WATCH_LOCK = threading.Lock()


def serialize_core_sends(llm: Any) -> bool:
    """Make the sends of a multiprocess ``LLM``'s core client thread-safe (once per engine): an install's calls
    (``is_sleeping``, ``collective_rpc``: utility messages) and another thread's ``generate`` (``add_request``)
    share one zmq socket, and two threads sending on it at once abort the process (``Assertion failed:
    !_current_out (src/router.cpp:166)``). True when the client's sends are now serialised."""
    client = llm_engine(llm).engine_core
    if not callable(getattr(client, "_send_input", None)) or type(client).__name__ == "InprocClient":
        return False
    lock = threading.Lock()

    def wrap(send: Any) -> Any:
        @functools.wraps(send)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                try:
                    return send(*args, **kwargs)
                except Exception as exc:
                    # vLLM's monitor closes the socket of an engine core that died, maybe between send's liveness
                    # check and its write (seen: ZMQError "Socket operation on non-socket"): say it is dead
                    if type(exc).__name__ == "ZMQError" and getattr(client.resources, "engine_dead", False):
                        from vllm.v1.engine.exceptions import EngineDeadError

                        raise EngineDeadError() from exc
                    raise

        return locked

    return attach.patch(llm, client, "_send_input", wrap)


def watch_core_calls(llm: Any) -> bool:
    """Make every utility call of a multiprocess ``LLM``'s core client (``is_sleeping``, ``reset_prefix_cache``,
    ``collective_rpc``, ...) fail with :class:`~hotweights.EngineDiedError` within a second of the engine core's
    death (once per engine): vLLM's own call waits on a future that nothing completes once the engine core died.
    True when the client's calls are watched."""

    client = llm_engine(llm).engine_core
    call = getattr(client, "call_utility", None)
    if not callable(call) or type(client).__name__ == "InprocClient" or getattr(client, "resources", None) is None:
        return False

    def wrap(call: Any) -> Any:
        @functools.wraps(call)
        def watched(method: str, *args: Any) -> Any:
            return watched_call(lambda: call(method, *args), llm, None, repr(method))

        return watched

    with _WATCH_LOCK:
        if not attach.patched(llm, client, "call_utility"):
            attach.patch(llm, client, "call_utility", wrap)
            _end_outputs_on_death(llm, client)
    return True


def _end_outputs_on_death(llm: Any, client: Any) -> None:
    """Once the engine core dies, hand its output reader vLLM's own ``EngineDeadError``: vLLM's monitor shuts the
    client down, which stops the thread that fills the outputs queue without a word, so a ``generate`` running then
    (``get_output``) would wait forever, and every install behind its gate with it."""
    outputs = getattr(client, "outputs_queue", None)
    if outputs is None or not callable(getattr(outputs, "put_nowait", None)):
        return
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return

    died = threading.Event()

    def dead() -> None:
        died.set()
        outputs.put_nowait(EngineDeadError())  # wakes the reader waiting now

    def wrap(get: Any) -> Any:
        @functools.wraps(get)
        def get_output() -> Any:
            if died.is_set() and outputs.empty():  # and every later one (the error above went to one reader)
                raise EngineDeadError()
            return get()

        return get_output

    if on_death(llm, dead):
        attach.patch(llm, client, "get_output", wrap)


def on_shutdown(llm: Any, callback: Callable[[], object]) -> bool:
    """Run ``callback()`` once the engine's core client has shut down (``llm.llm_engine.engine_core.shutdown()``,
    what ``AsyncLLM.shutdown()`` and vLLM's finalizers call); False where the engine has no such client."""
    core: Any = getattr(llm_engine(llm), "engine_core", None)
    if core is None or not callable(getattr(core, "shutdown", None)):
        return False
    pending: list[Callable[[], object]] = attach.value(llm, "on_shutdown", list)
    attach.patch(llm, core, "shutdown", _then(lambda: release(pending)))
    pending.append(callback)
    return True


def _then(after: Callable[[], object]) -> Callable[[Any], Any]:
    """A wrap (for :func:`hotweights.core.attach.patch`) that runs ``after()`` once the wrapped call returned or
    raised."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                after()

        return call

    return wrap


def release(pending: list[Callable[[], object]]) -> None:
    """Run (and drop) the clean-ups :func:`on_shutdown` registered, latest first; a failing one is logged."""
    while pending:
        done = pending.pop()
        try:
            done()
        except Exception:  # the engine is gone either way: say so, never raise from its shutdown
            _log.warning("hotweights: a clean-up after the engine shut down failed", exc_info=True)


#: ``vllm.LLM`` methods that run the engine and therefore must not overlap an install.
GENERATION_METHODS = ("generate", "chat", "beam_search", "encode", "embed", "classify", "score", "reward")


def serving_gate(llm: Any) -> ServingGate:
    """The engine's :class:`ServingGate`, created once (also under concurrent first use); the LLM's generation
    methods enter it.

    The methods are wrapped on this ``LLM`` instance only (``llm.generate`` etc.), so that a generation call in
    one thread and an install in another never overlap. A call that had already looked the method up before the
    gate existed, or code that drives ``llm.llm_engine`` by hand, is caught where it adds requests:
    ``llm.llm_engine.add_request`` joins the gate (:meth:`ServingGate.join`) until the adding thread's
    ``_run_engine`` returns or a step on any thread leaves the engine with nothing to run. Requests already running
    when an install starts are waited for (the install drains the engine), and a call among them may add its next
    requests meanwhile, so it never waits for the install that waits for it. Idempotent.
    """

    def make() -> ServingGate:
        gate = ServingGate(idle=lambda: not has_unfinished_requests(llm), dead=lambda: death(llm))
        for name in GENERATION_METHODS:
            attach.patch(llm, llm, name, lambda method: _gated(method, gate))
        _gate_requests(llm, gate)
        return gate

    gate: ServingGate = attach.value(llm, "gate", make)
    return gate


def _gated(method: Any, gate: ServingGate) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with gate.serving():
            return method(*args, **kwargs)

    return call


def _gate_requests(llm: Any, gate: ServingGate) -> None:
    """Gate ``llm_engine.add_request``: work added outside a gated call holds the gate (:meth:`ServingGate.join`)
    until the adding thread's ``llm._run_engine`` returns, or until a step on any thread leaves the engine with no
    unfinished requests (a request may be added on one thread and stepped on another)."""
    engine = getattr(llm, "llm_engine", None)
    if not all(
        callable(getattr(o, n, None)) for o, n in ((engine, "add_request"), (engine, "step"), (llm, "_run_engine"))
    ):
        return

    def release_if_idle() -> None:
        if gate.joined and not has_unfinished_requests(llm):
            gate.leave_all()

    def gated_add(add: Any) -> Any:
        @functools.wraps(add)
        def add_request(*args: Any, **kwargs: Any) -> Any:
            held = gate.join()  # waits while an install runs, unless it drains work this call may belong to
            try:
                return add(*args, **kwargs)
            except BaseException:
                if held:
                    gate.leave()
                raise

        return add_request

    def leave_then_release() -> None:
        gate.leave()
        release_if_idle()

    attach.patch(llm, engine, "add_request", gated_add)
    attach.patch(llm, engine, "step", _then(release_if_idle))
    attach.patch(llm, llm, "_run_engine", _then(leave_then_release))
