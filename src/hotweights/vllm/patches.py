"""Every patch hotweights makes to a vLLM engine object, each recorded with :func:`hotweights.core.attach.patch` so
that ``detach`` undoes it: the engine's ``sleep``/``wake_up`` tracked, the core client's serialised sends, its calls
watched for the engine core's death (:func:`attach_llm`: all of these, once, when a ``vllm.LLM``'s handle is made),
the serving gate around the ``LLM``'s generation methods and its ``add_request``, and callbacks at its shutdown;
and, while the family probe scores an engine, vLLM's logprob ranking in this process run eagerly
(:func:`rank_logprobs_eagerly`), put back when the probe ends."""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from hotweights.core import attach
from hotweights.core.gate import ServingGate
from hotweights.vllm.introspect import has_unfinished_requests, llm_engine
from hotweights.vllm.liveness import death, on_death, watching

__all__ = [
    "GENERATION_METHODS",
    "SleepTracker",
    "attach_llm",
    "on_shutdown",
    "rank_logprobs_eagerly",
    "release",
    "serving_gate",
    "track_sleep",
]

_log = logging.getLogger("hotweights")


class SleepTracker:
    """Whether an engine's *weights* are asleep, from the ``sleep(level)`` / ``wake_up(tags)`` calls made through it.

    vLLM's client-side ``is_sleeping()`` is coarse: it is also True while only the KV cache sleeps (TRL wakes the
    weights first, installs, then wakes the KV cache) or while the scheduler is merely paused. So the engine's own
    ``sleep``/``wake_up`` are wrapped on the instance (:func:`track_sleep`, :func:`attach_llm`) and report here; for a
    state no call was seen for (the engine slept before hotweights first touched it) the coarse report decides,
    refusing rather than risking a write (vllm#57853: writing sleeping weights crashes the engine).
    """

    def __init__(self, *, is_async: bool) -> None:
        self.is_async = is_async
        self.weights_asleep: bool | None = None
        """True/False once a call was seen; None while unknown (the coarse report decides)."""

    def wraps(self) -> dict[str, Callable[[Any], Any]]:
        """The wraps (for :func:`hotweights.core.attach.patch`) of the engine's ``sleep`` and ``wake_up``."""
        wrap = _after_async if self.is_async else _after
        return {"sleep": lambda method: wrap(method, self._slept), "wake_up": lambda method: wrap(method, self._woke)}

    def _slept(self, *args: Any, **kwargs: Any) -> None:
        level = kwargs.get("level", args[0] if args else 1)
        if int(level) >= 1:  # level 0 only pauses scheduling
            self.weights_asleep = True

    def _woke(self, *args: Any, **kwargs: Any) -> None:
        tags = kwargs.get("tags", args[0] if args else None)
        if tags is None or _WEIGHTS in tags:
            self.weights_asleep = False

    def asleep(self, coarse: Callable[[], bool]) -> bool:
        """Whether the weights sleep: what the tracked calls say, else ``coarse()`` (the engine's own report)."""
        return self.weights_asleep if self.weights_asleep is not None else coarse()


_WEIGHTS = "weights"


def _after(method: Callable[..., Any], record: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        record(*args, **kwargs)
        return result

    return call


def _after_async(method: Callable[..., Awaitable[Any]], record: Callable[..., None]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> Any:
        result = await method(*args, **kwargs)
        record(*args, **kwargs)
        return result

    return call


def track_sleep(engine: Any, *, is_async: bool) -> SleepTracker:
    """A :class:`SleepTracker` fed by ``engine``'s own ``sleep``/``wake_up`` (wrapped once; an engine without them
    is left as it is)."""
    tracker = SleepTracker(is_async=is_async)
    if callable(getattr(engine, "sleep", None)) and callable(getattr(engine, "wake_up", None)):
        for name, wrap in tracker.wraps().items():
            attach.patch(engine, engine, name, wrap)
    return tracker


def attach_llm(llm: Any, client: Any) -> SleepTracker:
    """Every patch a ``vllm.LLM``'s handle makes from the start, in one pass; ``client`` is its core client
    (``llm.llm_engine.engine_core``). Returns the tracker of its ``sleep``/``wake_up`` calls.

    On a multiprocess engine, also: the client's sends are serialised (an install's calls, ``is_sleeping`` or
    ``collective_rpc``, and another thread's ``generate`` share one zmq socket, and two threads sending on it at once
    abort the process: ``Assertion failed: !_current_out (src/router.cpp:166)``); each of its utility calls
    (``is_sleeping``, ``reset_prefix_cache``, ``collective_rpc``, ...) fails with :class:`~hotweights.EngineDiedError`
    within a second of the engine core's death, and so does a ``generate`` waiting for its outputs then: vLLM's own
    waits would last forever. A second call patches nothing more (it only watches the engine core's death again).
    """
    tracker = SleepTracker(is_async=False)
    wraps: list[tuple[Any, str, Callable[[Any], Any]]] = []
    if callable(getattr(llm, "sleep", None)) and callable(getattr(llm, "wake_up", None)):
        wraps += [(llm, name, wrap) for name, wrap in tracker.wraps().items()]
    remote = type(client).__name__ != "InprocClient"
    if remote and callable(getattr(client, "_send_input", None)):
        wraps.append((client, "_send_input", _serialized(client)))
    ending = _ending_outputs(client)
    if remote and callable(getattr(client, "call_utility", None)) and getattr(client, "resources", None) is not None:
        wraps.append((client, "call_utility", watching(llm)))
        if ending is not None and on_death(llm, ending[0]):
            wraps.append((client, "get_output", ending[1]))
    for target, name, wrap in wraps:
        attach.patch(llm, target, name, wrap)
    return tracker


def _serialized(client: Any) -> Callable[[Any], Any]:
    """The wrap of a core client's ``_send_input``: one send at a time."""
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

    return wrap


def _ending_outputs(client: Any) -> tuple[Callable[[], None], Callable[[Any], Any]] | None:
    """``(dead, wrap)``: ``dead()``, to run once the engine core died, hands the client's output reader vLLM's own
    ``EngineDeadError`` (vLLM's monitor shuts the client down, which stops the thread that fills the outputs queue
    without a word, so a ``generate`` running then would wait forever in ``get_output``, and every install behind
    its gate with it); ``wrap`` (of ``get_output``) raises it for every later reader too. None where the client has
    no outputs queue."""
    outputs = getattr(client, "outputs_queue", None)
    if outputs is None or not callable(getattr(outputs, "put_nowait", None)):
        return None
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return None
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

    return dead, wrap


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


# ------------------------------------------------------------------------------------ the probe's logprob ranking
#: Where vLLM's V1 sampler reads its logprob ranking from: ``batched_count_greater_than``, a ``torch.compile``d
#: function (``vllm/v1/sample/ops/logprobs.py``) compiled on the first request that asks for logprobs (2 s on this
#: CPU's tiny model). When that request is the family probe's, the compile would run inside the install, while
#: generation is held. Model Runner V2 ranks in a Triton kernel and has no such name: nothing is patched there.
_SAMPLER, _RANKS = "vllm.v1.sample.sampler", "batched_count_greater_than"


class _EagerRanks:
    lock = threading.Lock()
    holds = 0
    compiled: Any = None


def _count_at_least(x: Any, values: Any) -> Any:
    """``batched_count_greater_than`` without the compile: the same expression, run eagerly (the same counts)."""
    return (x >= values).sum(-1)


def rank_logprobs_eagerly(on: bool) -> bool:
    """Take (``on``) or give back a hold on eager logprob ranking in this process: while any hold is taken, vLLM's
    sampler here counts each logprob token's rank eagerly instead of through its compiled function, so a probe on an
    engine that never served logprobs does not pay vLLM's first compile inside the install (the engine's own
    first logprobs request still does, as it would without hotweights). The compiled function is put back when the
    last hold is given back. Returns False where this process runs no V1 sampler (nothing is patched)."""
    sampler = sys.modules.get(_SAMPLER)
    if sampler is None or not hasattr(sampler, _RANKS):
        return False
    with _EagerRanks.lock:
        if on:
            if _EagerRanks.holds == 0:
                _EagerRanks.compiled = getattr(sampler, _RANKS)
                setattr(sampler, _RANKS, _count_at_least)
            _EagerRanks.holds += 1
        elif _EagerRanks.holds > 0:
            _EagerRanks.holds -= 1
            if _EagerRanks.holds == 0:
                setattr(sampler, _RANKS, _EagerRanks.compiled)
                _EagerRanks.compiled = None
    return True
