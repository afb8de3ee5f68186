"""What an install tells you while it runs and after: log lines, a progress bar, flat metrics.

- **Logging.** Every install logs one ``INFO`` line on the ``hotweights`` logger (the report's summary: version,
  tensors, bytes, adapter, seconds, GB/s), ``DEBUG`` lines per phase, and, for adapters that move buckets through a
  transport, a ``DEBUG`` line per bucket (index, bytes, seconds). The library only adds a
  :class:`logging.NullHandler`; showing the lines is the application's choice, e.g.
  ``logging.basicConfig(level=logging.INFO)`` or ``logging.getLogger("hotweights").setLevel(logging.DEBUG)``.
- **Progress bar.** Bucketed installs (multiprocess engines, vLLM's weight-transfer API) count bytes on a `tqdm`
  bar on stderr. It appears only when stderr is a terminal and only for transfers that take longer than
  :data:`PROGRESS_DELAY_S`; a failed transfer clears it. Turn it off with ``HOTWEIGHTS_PROGRESS=0`` in the
  environment or :func:`set_progress` (``False``).
- **Metrics.** :meth:`hotweights.InstallReport.to_dict` flattens a report for wandb- or trackio-style loggers.

Examples:
    >>> import logging
    >>> import hotweights.telemetry
    >>> logging.getLogger("hotweights").setLevel(logging.INFO)   # with a handler of your own, e.g. basicConfig
    >>> hotweights.telemetry.set_progress(False)                 # no progress bar, even on a terminal
    >>> hotweights.telemetry.progress_enabled()
    False
    >>> hotweights.telemetry.set_progress(None)                  # back to the default: HOTWEIGHTS_PROGRESS, TTY
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hotweights.core.buckets import Bucket
    from hotweights.core.report import InstallReport

__all__ = ["PROGRESS_DELAY_S", "best_effort", "logger", "progress_enabled", "set_progress"]

logger = logging.getLogger("hotweights")
"""The library's logger; every hotweights module logs through it (or a child of it)."""
logger.addHandler(logging.NullHandler())

PROGRESS_DELAY_S = 2.0
"""Seconds a bucket transfer runs before its progress bar appears (shorter transfers never show one)."""

_OFF = frozenset({"0", "false", "no", "off"})
_progress: bool | None = None


def set_progress(enabled: bool | None) -> None:
    """Switch the progress bar for this process.

    Args:
        enabled: ``False``: never show it. ``True``: show it when stderr is a terminal, whatever
            ``HOTWEIGHTS_PROGRESS`` says. ``None``: back to the default (shown on a terminal unless
            ``HOTWEIGHTS_PROGRESS`` is ``0``, ``false``, ``no`` or ``off``).
    """
    global _progress
    _progress = enabled


def progress_enabled() -> bool:
    """Whether an install started now would show a progress bar (once it runs past :data:`PROGRESS_DELAY_S`)."""
    if _progress is False:
        return False
    if _progress is None and os.environ.get("HOTWEIGHTS_PROGRESS", "").strip().lower() in _OFF:
        return False
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def log_report(report: InstallReport) -> InstallReport:
    """Log a finished install: ``DEBUG`` per phase, then the ``INFO`` summary. Returns ``report``."""
    if logger.isEnabledFor(logging.DEBUG):
        for phase, seconds in report.phases.items():
            logger.debug("update %s phase %s: %.4f s", report.update_id, phase, seconds)
    logger.info("%s", report)
    return report


class _BucketProgress:
    """Iterates buckets; logs each one's bytes and seconds and advances the bar when the next one is asked for."""

    def __init__(self, buckets: list[Bucket], label: str) -> None:
        self.buckets = buckets
        self.label = label
        self.bar: Any = None
        if progress_enabled() and buckets:
            from tqdm import tqdm

            self.bar = tqdm(
                total=sum(b.nbytes for b in buckets),
                desc=f"hotweights {label}",
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                delay=PROGRESS_DELAY_S,
                leave=False,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def __iter__(self) -> Iterator[Bucket]:
        for bucket in self.buckets:
            start = time.perf_counter()
            yield bucket
            seconds = time.perf_counter() - start
            logger.debug(
                "%s bucket %d: %d bytes, %d tensors in %.4f s",
                self.label,
                bucket.index,
                bucket.nbytes,
                len(bucket.entries),
                seconds,
            )
            if self.bar is not None:
                self.bar.update(bucket.nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()  # leave=False: the line is cleared, whether the transfer finished or failed
            self.bar = None


@contextmanager
def bucket_progress(buckets: Iterable[Bucket], label: str = "transfer") -> Iterator[Iterable[Bucket]]:
    """The bucket loop's telemetry: ``with bucket_progress(plan) as buckets: for bucket in buckets: send(bucket)``.

    A bucket counts as done when the loop asks for the next one (or ends). The bar is closed and cleared when the
    block exits, also on an exception.
    """
    progress = _BucketProgress(list(buckets), label)
    try:
        yield progress
    finally:
        progress.close()


@contextmanager
def best_effort(what: str) -> Iterator[None]:
    """Run a clean-up step whose failure must not replace the error being raised (an abort, a release): a failure
    is logged at ``DEBUG`` on the ``hotweights`` logger, with its traceback, and not raised."""
    try:
        yield
    except Exception:
        logger.debug("best-effort step failed: %s", what, exc_info=True)
