"""Engine handles: one per engine kind, behind the :class:`EngineHandle` contract (see :mod:`.base`)."""

from __future__ import annotations

from typing import Any

from hotweights.core.errors import EngineNotSupportedError
from hotweights.engine import compat
from hotweights.handles.base import EngineHandle, PauseMode

__all__ = ["EngineHandle", "PauseMode", "as_engine"]

# The handle lives on the engine object itself (a registry keyed by engine would keep every engine alive).
_ATTR = "_hotweights_handle"


def as_engine(obj: Any) -> EngineHandle:
    """The handle of ``obj``: an :class:`EngineHandle` as is, else the one for a ``vllm.LLM`` or an ``AsyncLLM``,
    created on first use and kept on the engine.

    Raises:
        EngineNotSupportedError: ``obj`` is none of these.
    """
    if isinstance(obj, EngineHandle):
        return obj
    handle = getattr(obj, _ATTR, None)
    if isinstance(handle, EngineHandle):
        return handle
    kind = compat.engine_kind(obj)
    if kind == "llm":
        from hotweights.handles.llm import LLMHandle

        handle = LLMHandle(obj)
    elif kind == "async_llm":
        from hotweights.handles.async_llm import AsyncLLMHandle

        handle = AsyncLLMHandle(obj)
    else:
        raise EngineNotSupportedError(
            f"{type(obj).__name__} is not an engine hotweights can install into: pass a vllm.LLM, a vLLM AsyncLLM, "
            "or the handle returned by hotweights.connect(url) for a `vllm serve` process"
        )
    setattr(obj, _ATTR, handle)
    return handle
