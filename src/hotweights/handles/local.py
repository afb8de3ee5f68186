"""The parts of a handle on an engine object in this process: a ``vllm.LLM`` (:mod:`.llm`) or an ``AsyncLLM``
(:mod:`.async_llm`). Each reads the engine object itself or calls it; an ``AsyncLLM``'s calls return coroutines,
which its handle awaits on the engine's loop (the part's ``drive``), while a ``vllm.LLM``'s values are taken as they
are (:func:`direct`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.parts import LoraOps, PartOwner, Pausing, ServedModel
from hotweights.handles.workers import Workers
from hotweights.vllm import fixes, introspect, rpc, scoring
from hotweights.vllm.patches import SleepTracker
from hotweights.vllm.worker.ops import clear_kv_cache

__all__ = ["AsyncModel", "AsyncPausing", "AsyncWorkers", "LLMModel", "LLMPausing", "LLMWorkers", "LocalLora"]

Drive = Callable[[Any, "float | None", str], Any]
"""What an engine call returned, handed back: ``drive(returned, timeout, what)``."""
#: Seconds an engine's small calls may take (a version, a cache reset, a LoRA load).
SHORT_TIMEOUT = 60.0
#: Seconds the family probe's one short request may take.
PROBE_TIMEOUT = 120.0
T = TypeVar("T")


def direct(returned: Any, timeout: float | None, what: str) -> Any:
    """A ``vllm.LLM``'s drive: its calls return their values."""
    return returned


class LLMWorkers(Workers):
    """The workers of a ``vllm.LLM``: vLLM's ``collective_rpc``, watched for the engine core's death."""

    def __init__(self, llm: Any, extension_cls: str, *, inprocess: bool) -> None:
        super().__init__(extension_cls)
        self.llm, self.inprocess = llm, inprocess

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return rpc.rpc(self.llm, method, *args, timeout=timeout, kwargs=kwargs)

    def clear_kv_cache(self) -> int | None:
        if self.inprocess:  # the worker is in this process: no extension needed
            return int(sum(self.llm.collective_rpc(clear_kv_cache)))
        return super().clear_kv_cache()


class AsyncWorkers(Workers):
    """The workers of an ``AsyncLLM``: every worker of every data-parallel rank, each answering (vLLM's own call
    returns rank 0's answers only)."""

    def __init__(self, engine: Any, extension_cls: str, drive: Drive) -> None:
        super().__init__(extension_cls)
        self.engine, self.drive = engine, drive

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        wait = None if timeout is None else timeout + 5.0  # vLLM's own timeout fires first
        calls: list[Any] = self.drive(
            rpc.collective_rpc_all(self.engine, method, timeout, args, kwargs), wait, repr(method)
        )
        return calls


class LLMPausing(Pausing):
    """A ``vllm.LLM``'s sleep: exact where its worker is in this process, else as its own ``sleep``/``wake_up``
    calls say (``tracker``), else as vLLM and the workers say. ``alive()`` raises for an engine that can no longer
    serve (asked before any install writes, also by an adapter used without ``hotweights.install``)."""

    def __init__(self, llm: Any, workers: Workers, tracker: SleepTracker, alive: Callable[[], None]) -> None:
        super().__init__(workers)
        self.llm, self.tracker, self.alive = llm, tracker, alive

    def weights_asleep(self) -> bool:
        self.alive()
        exact = introspect.weights_asleep_inprocess(self.llm)
        if exact is not None:
            return exact
        return self.tracker.asleep(lambda: introspect.is_sleeping(self.llm) and self.workers.asleep())

    def scheduler_paused(self) -> bool | None:
        return introspect.scheduler_paused(self.llm)


class AsyncPausing(Pausing):
    """An ``AsyncLLM``'s sleep (as its own ``sleep``/``wake_up`` calls say, else as vLLM and the workers say) and
    its scheduler's pause."""

    def __init__(self, engine: Any, workers: Workers, tracker: SleepTracker, drive: Drive) -> None:
        super().__init__(workers)
        self.engine, self.tracker, self.drive = engine, tracker, drive

    def weights_asleep(self) -> bool:
        def coarse() -> bool:
            return bool(self.drive(self.engine.is_sleeping(), SHORT_TIMEOUT, "is_sleeping"))

        return self.tracker.asleep(lambda: coarse() and self.workers.asleep())

    def scheduler_paused(self) -> bool | None:
        return bool(self.drive(self.engine.is_paused(), SHORT_TIMEOUT, "is_paused"))


class LocalLora(LoraOps):
    """The LoRA adapters of a ``vllm.LLM`` or an ``AsyncLLM``, through vLLM's ``add_lora``/``remove_lora``."""

    def __init__(self, engine: Any, drive: Drive = direct) -> None:
        self.engine, self.drive = engine, drive

    def max_rank(self) -> int | None:
        return introspect.max_lora_rank(self.engine)

    def load_adapter(self, name: str, lora_id: int, path: str) -> None:
        request = introspect.lora_request(name, lora_id, path, replace=True)
        self.drive(introspect.llm_engine(self.engine).add_lora(request), SHORT_TIMEOUT, "add_lora")

    def unload_adapter(self, lora_id: int) -> None:
        self.drive(introspect.llm_engine(self.engine).remove_lora(lora_id), SHORT_TIMEOUT, "remove_lora")


class LLMModel(ServedModel):
    """The model a ``vllm.LLM`` serves: its config and dtype read here, scored by its own ``generate`` (called by
    the thread that holds its gate)."""

    probes = True

    def __init__(
        self, llm: Any, workers: Workers, expected: Callable[[], ExpectedWeights | None], *, inprocess: bool
    ) -> None:
        super().__init__(workers, expected)
        self.llm, self.inprocess = llm, inprocess

    def config(self) -> Any:
        return introspect.engine_model_config(self.llm).hf_config

    def dtype(self) -> torch.dtype:
        return introspect.engine_dtype(self.llm)

    def vllm_fixes(self) -> tuple[str, ...] | None:
        if self.inprocess:  # the workers are this process
            return fixes.apply_vllm_fixes()
        return super().vllm_fixes()

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        return scoring.score(self.llm, token_ids)


class ProbeGate(Protocol):
    """What :class:`AsyncModel` asks of an ``AsyncLLM``'s gate while the family probe runs inside an install."""

    relabel: str | None
    ours: bool
    """Whether the running install paused the engine (and so resumes it at its end)."""

    def probing(self) -> AbstractContextManager[None]: ...


class AsyncDriver(PartOwner, Protocol):
    """What :class:`AsyncModel` asks of its handle (an :class:`~hotweights.handles.async_llm.AsyncLLMHandle`)."""

    @property
    def engine(self) -> Any: ...
    @property
    def gate(self) -> ProbeGate: ...

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T: ...


class AsyncModel(ServedModel):
    """The model an ``AsyncLLM`` serves: its config and dtype read here, scored by its own ``generate`` inside the
    install's pause."""

    probes = True

    def __init__(self, handle: AsyncDriver) -> None:
        super().__init__(handle.workers, handle.expected_weights)
        self.handle = handle

    def config(self) -> Any:
        return introspect.engine_model_config(self.handle.engine).hf_config

    def dtype(self) -> torch.dtype:
        return introspect.engine_dtype(self.handle.engine)

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        """Scored by the engine's own ``generate`` (not the wrapper that holds requests) while the install holds every
        other new request (:meth:`~hotweights.handles.async_llm.PauseGate.probing`); the scheduler it paused runs
        for the probe's one request. Under ``keep`` or ``recompute``, requests in flight decode on the new weights
        meanwhile, labelled ``label`` (a probe that fails aborts them)."""
        handle = self.handle
        label = label if handle.pause_mode in ("keep", "recompute") else None
        if label is not None:
            handle.gate.relabel = handle.get_weight_version()
        with handle.gate.probing():  # the install resumes an engine it paused: no second pause after the probe
            scored = scoring.score_during_install(handle.engine, token_ids, label, repause=not handle.gate.ours)
            scores: list[float | None] = handle.run(scored, PROBE_TIMEOUT, "the family probe")
            return scores
