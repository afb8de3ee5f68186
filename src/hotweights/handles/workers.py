"""An engine's workers, as a handle reaches them: a worker method by name on every worker, and what hotweights'
worker extension answers where the workers carry it (their status, the KV cache, whether they share this host).

One subclass per way of reaching them (:mod:`~hotweights.handles.local`: vLLM's ``collective_rpc`` in this process;
:mod:`~hotweights.handles.remote`: a server's ``/collective_rpc`` route; :mod:`~hotweights.handles.actor`: a Ray
actor); it implements :meth:`Workers.call` and overrides what differs.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from hotweights.core.errors import EngineNotSupportedError
from hotweights.vllm.introspect import extension_class_is_ours

__all__ = ["STATUS_TIMEOUT", "NoWorkers", "Workers"]

#: Seconds for the small worker calls (the extension's status, its pause record).
STATUS_TIMEOUT = 30.0
#: Seconds the workers may take to zero their KV cache.
CLEAR_KV_TIMEOUT = 60.0
log = logging.getLogger("hotweights")


class Workers(ABC):
    """The workers of one engine, started with the ``worker_extension_cls`` ``extension_cls`` (``""``: none)."""

    def __init__(self, extension_cls: str = "") -> None:
        self.extension_cls = extension_cls
        self._extension: bool | None = None

    @abstractmethod
    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run the worker method ``method`` (by name: never a callable, which would need pickle) on every worker;
        one result per worker. A timeout raises :class:`~hotweights.HotWeightsTimeoutError`."""

    @property
    def extension(self) -> bool:
        """Whether the workers carry hotweights' worker extension: started with it, or with a subclass of it (such as
        verl's), so every ``hotweights_`` method is there. Decided once: by the class, where it can be imported in
        this process, else by asking the workers."""
        if self._extension is None:
            self._extension = self._carries_extension()
        return self._extension

    def _carries_extension(self) -> bool:
        known = extension_class_is_ours(self.extension_cls)
        if known is not None:
            return known
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=STATUS_TIMEOUT)
        except Exception:  # the workers have no such method: no extension
            log.debug("hotweights: the workers (%s) did not answer as hotweights' extension", self.extension_cls)
            return False
        return bool(answers) and all(isinstance(a, dict) and a.get("hotweights") == "hotweights" for a in answers)

    @property
    def same_host(self) -> bool:
        """True when the workers run on this host (they can map this host's ``/dev/shm``)."""
        return True

    @property
    def same_hotweights(self) -> bool:
        """True when the workers run this very hotweights (an engine this process started), so every worker method
        this version calls exists there; a server may run another version."""
        return True

    @property
    def default_transport(self) -> str:
        """The transport an installer uses when the caller names none (``"shm"``: the workers are on this host)."""
        return "shm"

    def status(self) -> dict[str, Any] | None:
        """The extension's ``status`` from the first worker (protocol, weights asleep, pause record, fixes, family),
        or None where there is no extension to ask (or it does not answer, e.g. a server running another
        hotweights)."""
        if not self.extension:
            return None
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=STATUS_TIMEOUT)
        except Exception:
            log.debug("hotweights: the workers did not answer 'status'", exc_info=True)
            return None
        return answers[0] if answers and isinstance(answers[0], dict) else None

    def asleep(self) -> bool:
        """Whether the workers' weights sleep, as they say through the extension; True where they cannot say (an
        engine vLLM reports sleeping is refused rather than written)."""
        if not self.extension:
            return True
        try:
            answers = self.call("hotweights_engine", "status", "{}", timeout=STATUS_TIMEOUT)
            return any(bool(a.get("weights_asleep", True)) for a in answers)
        except Exception:  # e.g. a server running an older hotweights: cannot be told
            log.debug("hotweights: the workers did not say whether their weights sleep", exc_info=True)
            return True

    def clear_kv_cache(self) -> int | None:
        """Zero the KV cache after a failed write (poisoned blocks survive a prefix-cache reset); the number of
        tensors zeroed, or None where the cache cannot be reached (only the worker extension reaches it)."""
        if not self.extension:
            return None
        return sum(int(n) for n in self.call("hotweights_engine", "clear_kv_cache", "{}", timeout=CLEAR_KV_TIMEOUT))


class NoWorkers(Workers):
    """An engine with no workers to call (a test double): the calls raise, and there is no extension."""

    def __init__(self, why: str = "this engine has no workers to call") -> None:
        super().__init__()
        self.why = why

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        raise EngineNotSupportedError(f"{self.why} ({method!r})")
