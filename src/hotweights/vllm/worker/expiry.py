"""The staging expiry of a worker's install session: what was staged is dropped when no commit came in time (a
fleet's trainer that died between its stage and its commit), so the worker keeps serving what it served."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

__all__ = ["StagingExpiry"]

log = logging.getLogger("hotweights")

#: How many expired updates a worker remembers (its status reports them, most recent last).
_REMEMBERED = 16


class StagingExpiry:
    """One timer per worker session: :meth:`arm` it at ``begin``, disarm it (``seconds=None``) at ``commit`` or
    ``abort``.

    Args:
        lock: the session's lock, held while an expired update is dropped.
        open_update: the update the session has open now (None: none).
        abort: drops an update's staging.
    """

    def __init__(
        self,
        lock: AbstractContextManager[object],
        open_update: Callable[[], str | None],
        abort: Callable[[str], object],
    ) -> None:
        self._lock, self._open_update, self._abort = lock, open_update, abort
        self._timer: threading.Timer | None = None
        self.expired: list[str] = []
        """Updates dropped by their staging expiry (most recent last, at most 16)."""

    def arm(self, update_id: str, seconds: float | None) -> None:
        """Expire ``update_id``'s staging after ``seconds`` without a commit (None: cancel any expiry)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds is not None:
            self._timer = threading.Timer(seconds, self._fire, (update_id, seconds))
            self._timer.daemon = True
            self._timer.start()

    def _fire(self, update_id: str, seconds: float) -> None:
        with self._lock:
            if self._open_update() != update_id:
                return  # committed or aborted meanwhile
            self._abort(update_id)
            self.expired = [*self.expired[-(_REMEMBERED - 1) :], update_id]
        log.warning(
            "hotweights: update %s was staged but not committed within %g s: dropped; this worker keeps serving "
            "what it served",
            update_id,
            seconds,
        )
        from hotweights.transports.shm_files import sweep_stale

        sweep_stale()  # the bucket files of a trainer that is gone
