"""Worker methods called by name on every worker of a vLLM engine (never a callable: that would need pickle),
bounded by the engine's liveness, and answered here where the installed vLLM's workers lack the method."""

from __future__ import annotations

import functools
import logging
from typing import Any

from hotweights.core.errors import HotWeightsTimeoutError
from hotweights.vllm.introspect import dp_engines, num_workers
from hotweights.vllm.liveness import watched_call

__all__ = ["WORKER_METHODS_ADDED", "collective_rpc_all", "rpc", "worker_lacks"]

_log = logging.getLogger("hotweights")


async def collective_rpc_all(
    engine: Any, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> list[Any]:
    """``collective_rpc`` on every worker of every data-parallel rank of an ``AsyncLLM``: one answer per worker,
    rank by rank (a single engine core: what ``collective_rpc`` returns)."""
    if worker_lacks(method):
        return [None] * num_workers(engine)
    if not dp_engines(engine):
        return list(await engine.collective_rpc(method, timeout, args, kwargs))
    per_rank = await engine.engine_core.call_utility_all_async("collective_rpc", method, timeout, args, kwargs)
    return [answer for rank in per_rank for answer in rank]


def rpc(
    llm: Any, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
) -> list[Any]:
    """``collective_rpc`` by method name (never a callable: that would need pickle in a multiprocess engine);
    a timeout becomes :class:`HotWeightsTimeoutError` naming the method."""
    if worker_lacks(method):
        return [None] * num_workers(llm)

    try:  # abandoned within a second of the engine's death (vLLM's own wait would last forever)
        call = functools.partial(llm.collective_rpc, method, timeout=timeout, args=args, kwargs=kwargs)
        return list(watched_call(call, llm, timeout, repr(method)))
    except HotWeightsTimeoutError:
        raise
    except TimeoutError as exc:
        raise HotWeightsTimeoutError(
            f"the engine's workers did not answer {method!r} within {timeout} s; check the engine is alive and "
            "not blocked, or raise rpc_timeout"
        ) from exc


#: Worker methods hotweights calls by name that an older vLLM's ``Worker`` does not have, with the vLLM that added
#: each. vLLM 0.31 has no ``shutdown_weight_transfer_engine`` (added in 0.32: release a trainer's connection; seen:
#: every worker failed with "'CPUWorker' object has no attribute", so closing a collective transport of the
#: native backend raised): there nothing can release the group by name, and it stays until the next
#: ``init_weight_transfer_engine`` replaces it (hotweights' backend closes a stale group first) or the engine stops.
#: Such a call is answered here, as the method would answer (None per worker), instead of failing in every worker.
WORKER_METHODS_ADDED = {"shutdown_weight_transfer_engine": "0.32"}


@functools.cache
def worker_lacks(method: str) -> bool:
    """Whether the installed vLLM's ``Worker`` lacks ``method`` of :data:`WORKER_METHODS_ADDED` (feature detection;
    False where no vLLM can be imported here, e.g. a trainer talking to a server: the call goes to the workers)."""
    if method not in WORKER_METHODS_ADDED:
        return False
    try:
        from vllm.v1.worker.gpu_worker import Worker  # the base of the CPU worker too
    except Exception:
        return False
    if hasattr(Worker, method):
        return False
    _log.debug("hotweights: this vLLM's workers have no %s (added in vLLM %s)", method, WORKER_METHODS_ADDED[method])
    return True
