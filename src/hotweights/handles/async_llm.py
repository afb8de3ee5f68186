"""The handle of an ``AsyncLLM`` (vLLM's async engine, what async RL rollouts run on).

Installs run in a worker thread (:func:`hotweights.install_async` puts them there, so packing and copying never
block the event loop); every engine call is a coroutine scheduled on the caller's loop and awaited from that
thread with a timeout. Generation is kept off the weights by pausing the scheduler (``pause_generation``) from the
first write to the end of the install, and resumed always, also on failure. What ``keep`` and ``recompute`` do to
the KV cache of requests in flight: :mod:`hotweights.handles.pause`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from hotweights.core import attach
from hotweights.core.errors import HotWeightsTimeoutError, PartialUpdateError
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.handles.local import AsyncModel, AsyncPausing, AsyncWorkers, LocalLora
from hotweights.handles.pause import KvEpoch, decoding, recomputed
from hotweights.telemetry import best_effort
from hotweights.versions import record_kv
from hotweights.vllm import introspect, liveness, patches
from hotweights.vllm.expected import expected_weights

__all__ = ["PAUSE_MODES", "AsyncLLMHandle", "PauseGate"]

T = TypeVar("T")

PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "abort", "keep", "recompute")
#: ``AsyncLLM`` methods that start requests: refused while the engine fails closed.
REQUEST_METHODS = ("generate", "encode")
#: Seconds a resume or a version record may take.
SHORT_TIMEOUT = 60.0
#: Seconds a ``recompute`` install waits for the requests it preempted to be prefilled again on the new weights.
RECOMPUTE_TIMEOUT = 120.0


class AsyncLLMHandle(EngineHandle):
    """An ``AsyncLLM``, driven from a worker thread through the event loop it runs on (see :meth:`bind`)."""

    kind: ClassVar[str] = "async_llm"
    pause_modes: ClassVar[tuple[PauseMode, ...]] = PAUSE_MODES

    def __init__(self, engine: Any) -> None:
        if introspect.engine_kind(engine) != "async_llm":
            raise TypeError(f"AsyncLLMHandle takes a vLLM AsyncLLM, not {type(engine).__name__}")
        self.facts = facts = introspect.engine_facts(engine)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._gate = PauseGate(self)
        tracker = patches.track_sleep(engine, is_async=True)
        for name in REQUEST_METHODS:
            attach.patch(engine, engine, name, lambda method: _refusing(method, self._gate, self._gate.epoch))
        self.workers = workers = AsyncWorkers(engine, facts.worker_extension, self.run)
        self.pausing = AsyncPausing(engine, workers, tracker, self.run)
        self.lora = LocalLora(engine, self.run)
        self.model = AsyncModel(self)

    def bind(self, loop: asyncio.AbstractEventLoop, pause: PauseMode) -> None:
        """Drive the engine through ``loop`` (the one it runs on); ValueError for a ``pause`` it cannot honour."""
        self.check_pause_mode(pause)
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Await ``coro`` on the engine's loop from this (worker) thread, within ``timeout`` seconds."""
        loop = self.loop
        if loop is None or loop.is_closed() or _in_loop_thread(loop):
            coro.close()
            raise RuntimeError(
                "an AsyncLLM is driven through hotweights.install_async, awaited on the engine's event loop: "
                "`await hotweights.install_async(engine, tensors, weight_version=step)`"
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        if liveness.watchable(self.engine):
            # watched: abandoned within a second of the engine core's death (vLLM's own wait would last forever)
            return liveness.watched(future.result, self.engine, timeout, what, cancel=future.cancel)
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            future.cancel()
            raise HotWeightsTimeoutError(
                f"the AsyncLLM did not finish {what} within {timeout} s; check the engine is alive and its loop is "
                "not blocked, or raise the timeout"
            ) from exc

    def expected_weights(self) -> ExpectedWeights | None:
        return expected_weights(self.engine)

    @property
    def gate(self) -> PauseGate:
        return self._gate

    def reset_prefix_cache(self) -> bool:
        """``recompute``: preempt the requests in flight (vLLM prefills them again on the new weights) and drop every
        cached block. ``keep``: the requests in flight keep their blocks; the KV epoch the install started keeps them
        from any request admitted after it, so True (with nothing in flight, vLLM drops every cached block too).
        Other modes: nothing runs, every cached block is dropped."""
        mode = self.pause_mode
        if mode in ("keep", "recompute"):
            in_flight = self.run(_in_flight(self.engine), SHORT_TIMEOUT, "requests in flight")
            if mode == "recompute":
                self._gate.preempted = decoding(in_flight)
                return bool(self.run(self.engine.reset_prefix_cache(True), SHORT_TIMEOUT, "reset_prefix_cache"))
            if in_flight:  # they hold blocks: vLLM would refuse (and warn); the epoch keeps theirs from new requests
                return self._gate.epoch.epoch > 0
        return bool(self.run(self.engine.reset_prefix_cache(False), SHORT_TIMEOUT, "reset_prefix_cache"))

    def set_weight_version(self, version: str) -> str | None:
        self.run(self.engine.update_weight_version(version), SHORT_TIMEOUT, "update_weight_version")
        self._gate.label = version
        record_kv(version, self.pause_mode)
        return self.get_weight_version()

    def get_weight_version(self) -> str | None:
        return str(self.run(self.engine.get_weight_version(), SHORT_TIMEOUT, "get_weight_version"))

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        patches.on_shutdown(self.engine, callback)

    def describe(self) -> str:
        ranks = len(introspect.dp_engines(self.engine))
        dp = f", {ranks} data-parallel ranks" if ranks else ""
        return f"AsyncLLM ({self.facts.num_workers} worker(s){dp}, pause={self.pause_mode!r})"


class PauseGate:
    """The :class:`~hotweights.core.gate.WriteGate` of an ``AsyncLLM``: pause the scheduler, resume always (an
    engine someone else paused is left paused).

    Under ``pause="wait"``, ``"abort"`` or ``"recompute"`` it also holds requests that arrive during the install and
    hands them to vLLM after the resume (``recompute``: once the requests it preempted produced a token on the new
    weights), so they queue on every vLLM: from 0.33 vLLM itself rejects them while paused
    (``RetryableRequestError``). One that slipped past the hold as the pause began is resubmitted once it ends.
    Under ``keep`` nothing is held: once the engine is paused the install starts a new KV epoch
    (:class:`~hotweights.handles.pause.KvEpoch`), and every request admitted from then on carries it in its
    ``cache_salt``."""

    def __init__(self, handle: AsyncLLMHandle) -> None:
        self.handle = handle
        self.refusal: str | None = None
        self._hold: asyncio.Event | None = None
        self.epoch = KvEpoch()
        """The engine's KV epoch, folded into the salt of every request the handle's wrapper admits."""
        self.preempted: frozenset[str] = frozenset()
        """Requests the running ``recompute`` install preempted after its write (waited for after the resume)."""
        self.label: str | None = None
        """The version label the running install recorded (their first token on the new weights carries it)."""
        self.recompute_s: float | None = None
        """Seconds the last ``recompute`` install waited after the resume for the requests it preempted."""
        self.ours = False
        """Whether the running install paused the scheduler (and resumes it)."""
        self.relabel: str | None = None
        """The version label before the family probe labelled requests in flight with the new one (put back if the
        install fails)."""
        self.installs = 0
        """Installs that held requests so far (a rejected request resubmits when one ran since it was sent)."""
        self.held = 0
        """Requests held until an install resumed the engine, and rejected ones resubmitted (for tests, metrics)."""

    @contextmanager
    def installing(self, timeout: float | None = None) -> Iterator[float]:
        handle, start = self.handle, time.perf_counter()
        mode = handle.pause_mode
        frozen = mode in ("keep", "recompute")  # vLLM's "keep" pause: requests in flight are frozen, blocks and all
        # Paused by someone else already (not asleep: checked before): the install goes on under that pause and
        # leaves it (a trainer killed while it held a pause took this in-process engine with it).
        ours = self.ours = handle.pausing.scheduler_paused() is not True
        hold = asyncio.Event() if ours and mode != "keep" else None
        self._hold = hold
        self.preempted, self.label, self.recompute_s = frozenset(), None, None
        try:
            if ours:  # frozen requests keep their KV blocks; the other modes drain, so the caches can go now
                pause = handle.engine.pause_generation(mode="keep" if frozen else mode, clear_cache=not frozen)
                handle.run(pause, timeout, f"pause_generation(mode={mode!r}) (requests in flight)")
            if mode == "keep":  # once frozen: every request admitted from now on starts on the new weights
                self.epoch.bump()
            yield time.perf_counter() - start
        finally:
            try:
                if ours:
                    handle.run(handle.engine.resume_generation(), SHORT_TIMEOUT, "resume_generation")
                    if self.preempted and self.label is not None:  # recompute: part of the stall
                        read, label = functools.partial(introspect.requests_in_flight, handle.engine), self.label
                        waited = recomputed(read, self.preempted, label, RECOMPUTE_TIMEOUT)
                        self.recompute_s = handle.run(waited, RECOMPUTE_TIMEOUT + 5.0, "the re-prefill")
            finally:
                self.preempted, self.ours, self.relabel = frozenset(), False, None
                hold = hold or self._hold  # under keep: the family probe's hold
                if hold is not None:
                    self._hold = None
                    self.installs += 1
                    loop = handle.loop
                    if loop is not None and not loop.is_closed():
                        loop.call_soon_threadsafe(hold.set)

    @contextmanager
    def probing(self) -> Iterator[None]:
        """Keep new requests held while the family probe's request runs inside the install (under ``keep`` too, from
        now to the end of the install). Requests frozen by ``keep`` or ``recompute`` decode while it runs: a probe
        that fails aborts them (:meth:`refuse`)."""
        if self._hold is None and self.handle.pause_mode == "keep" and self.ours:
            self._hold = asyncio.Event()  # set at the end of the install, as the other modes' hold
        yield

    async def wait_open(self) -> bool:
        """Wait while an install holds new requests; True when it did."""
        hold = self._hold
        if hold is None:
            return False
        self.held += 1
        await hold.wait()
        return True

    def refuse(self, reason: str) -> None:
        """Fail closed: new requests raise, and requests in flight (frozen by ``keep`` or ``recompute``, which would
        go on over a mix of weights, or over weights the family probe failed) are aborted."""
        self.refusal = reason
        handle = self.handle
        if handle.loop is None or handle.loop.is_closed() or _in_loop_thread(handle.loop):
            return
        with best_effort("abort the requests in flight (fail closed)"):
            running = handle.run(_in_flight(handle.engine), SHORT_TIMEOUT, "requests in flight")
            if running:
                aborted = handle.engine.abort(list(running), internal=True)  # the output processor's own ids
                handle.run(aborted, SHORT_TIMEOUT, "abort (fail closed)")
        if self.relabel is not None:
            with best_effort("put the version label back"):
                handle.run(handle.engine.update_weight_version(self.relabel), SHORT_TIMEOUT, "update_weight_version")

    def reopen(self) -> None:
        self.refusal = None


#: Times a request rejected by a paused engine is resubmitted after an install (each time another install began).
RESUBMITS = 3


def _refusing(
    method: Callable[..., AsyncIterator[Any]], gate: PauseGate, epoch: KvEpoch | None = None
) -> Callable[..., AsyncIterator[Any]]:
    """``method`` (an async generator) that raises :class:`PartialUpdateError` while ``gate`` refuses, waits while
    an install holds requests, salts each request with ``epoch`` (the engine's KV epoch), and resubmits a request vLLM
    rejected because an install had just paused it."""

    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        for attempt in range(RESUBMITS + 1):
            await gate.wait_open()
            if gate.refusal is not None:  # also one set by the install a request waited for (fail closed)
                raise PartialUpdateError(gate.refusal)
            installs, started = gate.installs, False
            # the epoch at admission (each try: a request held through an install starts in the epoch after it)
            salted_args, salted_kwargs = epoch.call(args, kwargs) if epoch is not None else (args, kwargs)
            try:
                async for item in method(*salted_args, **salted_kwargs):
                    started = True
                    yield item
                return
            except Exception as exc:
                rejected = type(exc).__name__ == "RetryableRequestError" and not started
                if not rejected or attempt == RESUBMITS or (gate._hold is None and gate.installs == installs):
                    raise
                gate.held += 1  # paused by an install between the hold's check and vLLM's admission: resubmit

    return call


async def _in_flight(engine: Any) -> dict[str, tuple[int, str | None]]:
    """:func:`~hotweights.vllm.introspect.requests_in_flight`, read on the engine's loop (which updates them)."""
    return introspect.requests_in_flight(engine)


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
