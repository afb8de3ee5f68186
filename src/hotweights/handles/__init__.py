"""Engine handles: one per engine kind, behind the :class:`EngineHandle` contract (see :mod:`.base`).

One handle per engine object (:func:`as_engine` keeps it on the engine); it holds what every adapter on that engine
shares: the serving gate, the active version and the delta base."""

from __future__ import annotations

from typing import Any

from hotweights.core import attach
from hotweights.core.errors import EngineNotSupportedError
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.vllm import compat

__all__ = ["EngineHandle", "PauseMode", "as_engine"]


def as_engine(obj: Any) -> EngineHandle:
    """The handle of ``obj``: an :class:`EngineHandle` as is, else the one for a ``vllm.LLM`` or an ``AsyncLLM``,
    created on first use and kept on the engine.

    Raises:
        EngineNotSupportedError: ``obj`` is none of these.
    """
    if isinstance(obj, EngineHandle):
        return obj
    handle = attach.get(obj, "handle")
    if isinstance(handle, EngineHandle):
        return handle
    kind = compat.engine_kind(obj)
    if not kind:
        raise EngineNotSupportedError(
            f"{type(obj).__name__} is not an engine hotweights can install into: pass a vllm.LLM, a vLLM AsyncLLM, "
            "or the handle returned by hotweights.connect(url) for a `vllm serve` process"
        )
    # Kept on the engine object itself (a registry keyed by engine would keep every engine alive); two first
    # installs from two threads build one handle.
    made: EngineHandle = attach.value(obj, "handle", lambda: _new_handle(obj, kind))
    return made


def _new_handle(obj: Any, kind: str) -> EngineHandle:
    compat.warn_untested_vllm()
    if kind == "llm":
        from hotweights.handles.llm import LLMHandle

        return LLMHandle(obj)
    if kind == "async_llm":
        from hotweights.handles.async_llm import AsyncLLMHandle

    return AsyncLLMHandle(obj)
