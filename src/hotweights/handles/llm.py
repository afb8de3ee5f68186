"""The handle of a ``vllm.LLM``: in this process or multiprocess, any tensor-parallel size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hotweights.core.errors import EngineDiedError
from hotweights.core.gate import ServingGate
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.handle import EngineHandle
from hotweights.vllm import fixes, introspect, patches, rpc, scoring
from hotweights.vllm.expected import expected_weights
from hotweights.vllm.liveness import death
from hotweights.vllm.worker.ops import clear_kv_cache

__all__ = ["LLMHandle"]


class LLMHandle(EngineHandle):
    """A ``vllm.LLM``. Generation is kept off the weights by a :class:`ServingGate` that the ``LLM``'s generation
    methods enter (wrapped on this instance); an install also waits for requests that never entered it."""

    kind: ClassVar[str] = "llm"
    probes: ClassVar[bool] = True

    def __init__(self, llm: Any) -> None:
        if introspect.engine_kind(llm) != "llm":
            raise TypeError(f"LLMHandle takes a vllm.LLM, not {type(llm).__name__}")
        client = introspect.llm_engine(llm).engine_core
        self.llm = llm
        self._gate: ServingGate | None = None
        # its sleep calls tracked; multiprocess: its core client's sends serialised (an install's calls and another
        # thread's generate share one socket) and its calls failing typed within a second of the engine core's death
        self._sleep = patches.attach_llm(llm, client)

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

    @property
    def num_workers(self) -> int:
        return introspect.num_workers(self.llm)

    @property
    def inprocess(self) -> bool:
        return introspect.engine_mode(self.llm) == "inprocess"

    @property
    def worker_extension(self) -> str:
        return introspect.worker_extension(self.llm)

    @property
    def weight_transfer_backend(self) -> str:
        return introspect.weight_transfer_backend(self.llm)

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return rpc.rpc(self.llm, method, *args, timeout=timeout, kwargs=kwargs)

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

    def is_sleeping(self) -> bool:
        self.check_alive()  # asked before any install writes (also by an adapter used without hotweights.install)
        exact = introspect.weights_asleep_inprocess(self.llm)
        if exact is not None:
            return exact
        return self._sleep.asleep(lambda: introspect.is_sleeping(self.llm) and self._asleep_though_vllm_says_so())

    def scheduler_paused(self) -> bool | None:
        return introspect.scheduler_paused(self.llm)

    def clear_kv_cache(self) -> int | None:
        if self.inprocess:
            return int(sum(self.llm.collective_rpc(clear_kv_cache)))
        return super().clear_kv_cache()

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        patches.on_shutdown(self.llm, callback)

    def model_config(self) -> Any:
        return introspect.engine_model_config(self.llm).hf_config

    @property
    def extensible_kv_cache(self) -> bool:
        return introspect.extensible_kv_cache(self.llm)

    def engine_dtype(self) -> Any:
        return introspect.engine_dtype(self.llm)

    def max_lora_rank(self) -> int | None:
        return introspect.max_lora_rank(self.llm)

    def add_lora(self, name: str, lora_id: int, path: str) -> None:
        self.llm.llm_engine.add_lora(introspect.lora_request(name, lora_id, path, replace=True))

    def remove_lora(self, lora_id: int) -> None:
        self.llm.llm_engine.remove_lora(lora_id)

    def vllm_fixes(self) -> tuple[str, ...] | None:
        if self.inprocess:  # the workers are this process
            return fixes.apply_vllm_fixes()
        return super().vllm_fixes()

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        return scoring.score(self.llm, token_ids)

    def describe(self) -> str:
        mode = "in-process" if self.inprocess else f"multiprocess, {self.num_workers} worker(s)"
        return f"vllm.LLM ({mode})"
