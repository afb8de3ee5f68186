"""The handle of a ``vllm.LLM``: in this process or multiprocess, any tensor-parallel size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hotweights.core.errors import EngineDiedError
from hotweights.core.gate import ServingGate
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.handle import EngineHandle
from hotweights.handles.local import LLMModel, LLMPausing, LLMWorkers, LocalLora
from hotweights.vllm import introspect, patches
from hotweights.vllm.expected import expected_weights
from hotweights.vllm.liveness import death

__all__ = ["LLMHandle"]


class LLMHandle(EngineHandle):
    """A ``vllm.LLM``. Generation is kept off the weights by a :class:`ServingGate` that the ``LLM``'s generation
    methods enter (wrapped on this instance); an install also waits for requests that never entered it."""

    kind: ClassVar[str] = "llm"

    def __init__(self, llm: Any) -> None:
        if introspect.engine_kind(llm) != "llm":
            raise TypeError(f"LLMHandle takes a vllm.LLM, not {type(llm).__name__}")
        client = introspect.llm_engine(llm).engine_core
        self.facts = facts = introspect.engine_facts(llm)
        self.llm = llm
        self._gate: ServingGate | None = None
        # its sleep calls tracked; multiprocess: its core client's sends serialised (an install's calls and another
        # thread's generate share one socket) and its calls failing typed within a second of the engine core's death
        tracker = patches.attach_llm(llm, client)
        self.workers = workers = LLMWorkers(llm, facts.worker_extension, inprocess=facts.inprocess)
        self.pausing = LLMPausing(llm, workers, tracker, self.check_alive)
        self.lora = LocalLora(llm)
        self.model = LLMModel(llm, workers, self.expected_weights, inprocess=facts.inprocess)

    def check_alive(self) -> None:
        """Raise :class:`EngineDiedError` where the engine can no longer serve: an in-process engine that was shut
        down (its calls would fail deep in vLLM, e.g. with a bare ``AssertionError``), or a multiprocess engine
        whose engine core ended."""
        why = death(self.llm)
        if why is not None:
            raise EngineDiedError(
                f"the engine ({self.describe()}) can no longer serve: {why}. hotweights writes nothing into it, and "
                "it serves no version; start a new engine (vllm.LLM(...)) and install into that"
            )

    def expected_weights(self) -> ExpectedWeights | None:
        return expected_weights(self.llm)

    @property
    def gate(self) -> ServingGate:
        if self._gate is None:
            self._gate = patches.serving_gate(self.llm)
        return self._gate

    def reset_prefix_cache(self) -> bool:
        return introspect.reset_prefix_cache(self.llm)

    def set_weight_version(self, version: str) -> str | None:
        return introspect.set_engine_weight_version(self.llm, version)

    def get_weight_version(self) -> str | None:
        return introspect.engine_weight_version(self.llm)

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        patches.on_shutdown(self.llm, callback)

    def describe(self) -> str:
        mode = "in-process" if self.facts.inprocess else f"multiprocess, {self.facts.num_workers} worker(s)"
        return f"vllm.LLM ({mode})"
