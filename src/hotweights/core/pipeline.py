"""Pipelined sends: pack the next buckets while one is being staged, at most ``depth`` buckets in flight.

A transport's ``send(bucket, stage)`` packs a bucket, then calls ``stage(descriptor)`` once, which returns when
every worker has staged it. :func:`send_pipelined` runs up to ``depth`` sends at once, each on its own thread, and
lets their ``stage`` calls through one at a time, in the plan's order: while the workers stage bucket ``i`` (or, in a
streaming commit, install it), the trainer packs ``i + 1``. A bucket is packed only when a thread is free to send
it, so at most ``depth`` packed buckets exist at once. The first failure stops the pipeline: sends not started are
skipped, sends waiting for their turn raise :class:`PipelineStopped` from ``stage`` (so their transport cleans up
what it made), and the first error is raised once every thread has returned.

Nothing here knows vLLM, buckets or transports: it orders callbacks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["MAX_DEPTH", "PipelineStopped", "send_pipelined"]

B = TypeVar("B")
D = TypeVar("D")

#: Most buckets a pipeline may hold at once (each is a packed bucket in memory).
MAX_DEPTH = 8


class PipelineStopped(RuntimeError):
    """Raised from a waiting send's ``stage``: an earlier bucket failed, this one is not staged."""


class _Turnstile:
    """Lets ``stage`` calls through one at a time, in order; the first failure stops every later one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.turn = 0
        self.error: BaseException | None = None

    def wait_for(self, position: int) -> None:
        with self._cond:
            while self.turn != position and self.error is None:
                self._cond.wait()
            if self.error is not None:
                raise PipelineStopped(f"not staged: an earlier bucket failed ({type(self.error).__name__})")

    def passed(self, position: int) -> None:
        with self._cond:
            if self.turn == position:
                self.turn += 1
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """Run a block whose error stops the pipeline (and is raised)."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc)
            raise


def send_pipelined(
    items: Sequence[B],
    send: Callable[[B, Callable[[D], None]], None],
    stage: Callable[[B, D], None],
    depth: int,
    done: Iterable[B] | None = None,
) -> None:
    """``send(item, stage_one)`` for every item, up to ``depth`` at once, their ``stage(item, descriptor)`` calls
    one at a time in ``items``' order. ``done``, when given, is iterated once per item as each one is staged (a
    progress bar over the same items). ``depth <= 1`` sends one after the other on this thread."""
    progress = iter(done) if done is not None else None
    if depth <= 1 or len(items) <= 1:
        for item in items:
            if progress is not None:
                next(progress, None)
            send(item, lambda descriptor, item=item: stage(item, descriptor))  # type: ignore[misc]
        _finish(progress)
        return
    gate = _Turnstile()

    def run(position: int, item: B) -> None:
        if gate.error is not None:
            return  # stopped before this one was packed
        staged = False

        def stage_one(descriptor: D) -> None:
            nonlocal staged
            gate.wait_for(position)
            with gate.stopping():  # at once: the sends waiting for their turn stop before this one's clean-up
                stage(item, descriptor)
            staged = True
            gate.passed(position)

        with gate.stopping():
            send(item, stage_one)
        if not staged:  # a send that returned without staging would hold every later bucket forever
            error = RuntimeError(f"the transport's send returned without staging item {position}")
            gate.fail(error)
            raise error

    pool = ThreadPoolExecutor(max_workers=min(depth, MAX_DEPTH), thread_name_prefix="hotweights-send")
    futures: list[Future[None]] = []
    try:
        futures = [pool.submit(run, i, item) for i, item in enumerate(items)]
        for future in futures:
            if progress is not None:
                next(progress, None)
            future.result()
    except BaseException as exc:
        gate.fail(exc)
        raise _first_error(futures, exc) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    _finish(progress)


def _first_error(futures: list[Future[None]], caught: BaseException) -> BaseException:
    """The error that stopped the pipeline: the earliest real one (not a waiting send's :class:`PipelineStopped`),
    else what the caller caught (e.g. a ``KeyboardInterrupt``)."""
    for future in futures:
        if future.cancelled():
            continue
        try:
            error = future.exception()
        except BaseException:  # interrupted again while waiting for it: skip it
            continue
        if error is not None and not isinstance(error, PipelineStopped):
            return error
    return caught


def _finish(progress: Any) -> None:
    if progress is not None:
        next(progress, None)  # the last item counts as done when the iterator is asked for the next
