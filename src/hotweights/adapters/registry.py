"""Which install path fits an engine: a lazy registry from the engine's route to a named adapter.

The engine's handle says how its workers are reached (:attr:`~hotweights.handles.EngineHandle.route`, decided by
how the engine was started); this module maps that route to the adapter that installs there, imported on first
use, built once per engine and kept on the engine's handle. :func:`register_route` adds one (a fake engine for
tests does: :mod:`hotweights.fake`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hotweights.adapters.contract import WeightInstallAdapter
from hotweights.core.registry import LazyRegistry
from hotweights.handles import EngineHandle, as_engine

__all__ = ["adapter_for", "adapter_of", "cached_adapter", "register_route"]

#: route -> "module:factory"; the factory takes the engine's handle. Built-ins registered at the bottom.
_ROUTES = LazyRegistry("route")
# The adapter lives on the engine handle (itself kept on the engine object): a registry keyed by the engine would
# keep every engine alive. When the user drops the engine, all three go together.
_ATTR = "_hotweights_adapter"


def register_route(route: str, factory: str) -> None:
    """Install into engines whose handle's ``route`` is ``route`` with ``factory`` (``"module:function"``, called
    with the handle, returning a :class:`WeightInstallAdapter`).

    Raises:
        ValueError: ``route`` is registered to another factory.
    """
    _ROUTES.register(route, factory)


def adapter_for(engine: Any) -> WeightInstallAdapter:
    """The adapter that fits ``engine``, created on first use and kept for the engine's lifetime (it holds the
    active version).

    ``engine`` is a ``vllm.LLM``, an ``AsyncLLM`` or an :class:`~hotweights.handles.EngineHandle`. The choice:

    - workers in this process: :class:`~hotweights.adapters.VLLMInProcessAdapter` with
      ``install_method="auto"`` (tensors by reference; the direct setter where its plan proves it safe, else vLLM's
      layerwise reload);
    - started with ``worker_extension_cls=hotweights.WORKER_EXTENSION``:
      :class:`~hotweights.adapters.VLLMMultiprocessAdapter` (bucketed shm staging, all-or-nothing commit);
    - started with ``weight_transfer_config={"backend": "hotweights"}``:
      :class:`~hotweights.adapters.VLLMWeightTransferAdapter`;
    - anything else on this host: :class:`~hotweights.adapters.VLLMWeightsPathAdapter`, through vLLM's built-in
      ``reload_weights(weights_path=...)``.
    """
    return adapter_of(as_engine(engine))


def adapter_of(handle: EngineHandle) -> WeightInstallAdapter:
    """:func:`adapter_for` on an engine already made a handle."""
    adapter = cached_adapter(handle)
    if adapter is not None:
        return adapter
    with _engine_lock(handle):
        adapter = cached_adapter(handle)
        if adapter is None:
            adapter = _factory(handle.route)(handle)
            setattr(handle, _ATTR, adapter)
        return adapter


def cached_adapter(handle: EngineHandle) -> WeightInstallAdapter | None:
    """The adapter :func:`adapter_of` built on ``handle`` (None: none yet)."""
    found: WeightInstallAdapter | None = getattr(handle, _ATTR, None)
    return found


def _factory(route: str) -> Callable[[EngineHandle], WeightInstallAdapter]:
    made: Callable[[EngineHandle], WeightInstallAdapter] = _ROUTES.load(route)
    return made


def _engine_lock(handle: EngineHandle) -> threading.Lock:
    """The lock that builds ``handle``'s adapter once: one per engine, so building one engine's adapter (checkpoint
    headers, a remote status call) never stalls another engine's first install."""
    lock: threading.Lock = handle.shared("_hotweights_adapter_lock", threading.Lock)
    return lock


register_route("inprocess", "hotweights.adapters.presets:inprocess")
register_route("extension", "hotweights.adapters.presets:extension")
register_route("weight_transfer", "hotweights.adapters.presets:weight_transfer")
register_route("weights_path", "hotweights.adapters.presets:weights_path")
