"""Engine handles: one per engine kind, behind the :class:`EngineHandle` contract (:mod:`.handle`).

One handle per engine object (:func:`as_engine` keeps it on the engine); it holds what every adapter on that engine
shares: the serving gate, the active version and the delta base."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hotweights.core import attach
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.registry import LazyRegistry
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.vllm import compat, introspect

__all__ = ["EngineHandle", "PauseMode", "as_engine"]


#: Engine kind (:func:`hotweights.vllm.introspect.engine_kind`) -> its handle class, imported on first use.
_KINDS = LazyRegistry("engine kind")
_KINDS.register("llm", "hotweights.handles.llm:LLMHandle")
_KINDS.register("async_llm", "hotweights.handles.async_llm:AsyncLLMHandle")


def as_engine(obj: Any) -> EngineHandle:
    """The handle of ``obj``: an :class:`EngineHandle` as is, else the one for a ``vllm.LLM`` or an ``AsyncLLM``,
    created on first use and kept on the engine.

    Raises:
        EngineNotSupportedError: ``obj`` is none of these.
    """
    if isinstance(obj, EngineHandle):
        return obj
    kind = introspect.engine_kind(obj)
    if kind not in _KINDS:
        raise EngineNotSupportedError(
            f"{type(obj).__name__} is not an engine hotweights can install into: pass a vllm.LLM, a vLLM AsyncLLM, "
            "or the handle returned by hotweights.connect(url) for a `vllm serve` process"
        )
    # Kept on the engine object itself (a registry keyed by engine would keep every engine alive); two first
    # installs from two threads build one handle. The class is looked up only when the handle is made.
    handle: EngineHandle = attach.value(obj, "handle", lambda: _handle_class(kind)(obj))
    return handle


def _handle_class(kind: str) -> Callable[[Any], EngineHandle]:
    compat.warn_untested_vllm()
    made: Callable[[Any], EngineHandle] = _KINDS.load(kind)
    return made
