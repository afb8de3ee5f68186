"""A paused engine is not a sleeping one: who paused it, and whether an install may go on under that pause.

vLLM's ``is_sleeping()`` is True while the scheduler is merely paused (``/pause``, ``pause_generation``,
``sleep(level=0)``). Writing weights is only unsafe while they are *asleep* (offloaded or discarded). So an install:

- refuses an engine whose weights are asleep (the workers say so, or the handle saw ``sleep(level>=1)``);
- into an engine that someone else paused, goes on under that pause and leaves it paused;
- into an engine that a hotweights install paused and whose trainer is gone (killed while it held the pause), goes
  on and resumes it afterwards; a live install's pause is waited for.

Each install that pauses an engine records a :class:`PauseOwner` on its workers (through the worker extension's
``hotweights_engine("pause")``; ``hotweights_engine("status")`` reads it back) and
clears it when it resumes; a trainer that dies in between leaves the record, which the next one reads.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["PauseOwner"]

#: How long a recorded pause is presumed alive when its owner runs on another host (its liveness cannot be seen).
DEFAULT_LEASE_S = 900.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, as /proc gives it), or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] == b"Z" else fields[19].decode()


@dataclass(frozen=True)
class PauseOwner:
    """The trainer process whose install paused an engine, and until when its pause is presumed alive."""

    host: str
    boot: str
    pid: int
    started: str
    until: float
    failed: bool = False
    """Left paused on purpose by an install that failed while writing (fail closed): the next install lifts it."""

    @classmethod
    def mine(cls, lease: float | None = None) -> PauseOwner:
        """This process, holding a pause for at most ``lease`` seconds (None: :data:`DEFAULT_LEASE_S`)."""
        pid = os.getpid()
        until = time.time() + (DEFAULT_LEASE_S if lease is None else lease)
        return cls(socket.gethostname(), _boot_id(), pid, _started(pid) or "", until)

    def lifted_by_next_install(self) -> bool:
        """Whether the next install may take this pause over and resume the engine after it: the install that
        paused it failed (fail closed), or its trainer is gone."""
        return self.failed or self.gone()

    def gone(self) -> bool:
        """True when the owner can no longer hold the pause: on this host (same boot), its process is gone or its
        pid was reused; elsewhere, its lease ran out."""
        if self.host == socket.gethostname() and self.boot and self.boot == _boot_id():
            return _started(self.pid) != self.started
        return time.time() > self.until

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PauseOwner | None:
        """The owner ``text`` records; None for an empty or unreadable record."""
        try:
            data = json.loads(text) if text else None
            if not isinstance(data, dict):
                return None
            host, boot, pid, started = str(data["host"]), str(data["boot"]), int(data["pid"]), str(data["started"])
            return cls(host, boot, pid, started, float(data["until"]), failed=bool(data.get("failed", False)))
        except (ValueError, KeyError, TypeError):
            return None
