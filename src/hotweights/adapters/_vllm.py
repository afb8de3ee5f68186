"""What every adapter bound to a vLLM engine shares: the engine's handle (expected weights, the serving gate, the
version and the delta base), prefix-cache reset, version record and recovery. The install session's trainer side is
:mod:`hotweights.adapters.installer`."""

from __future__ import annotations

from typing import Any, TypedDict

from hotweights.adapters.contract import Items, PrefixCachePolicy, WeightInstallAdapter
from hotweights.core.errors import EngineSleepingError
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.handles import EngineHandle, as_engine
from hotweights.telemetry import logger

__all__ = ["EngineOptions", "VLLMEngineAdapter"]


class EngineOptions(TypedDict, total=False):
    """What every adapter bound to an engine takes (defaults in :class:`VLLMEngineAdapter`)."""

    expected: ExpectedWeights | None
    prefix_cache: PrefixCachePolicy
    lock_timeout: float | None
    guard_generation: bool


class VLLMEngineAdapter(WeightInstallAdapter):
    """Base of the adapters that install into a vLLM engine: a ``vllm.LLM``, an ``AsyncLLM``, or any
    :class:`~hotweights.handles.EngineHandle`. What differs between engine kinds goes through ``self.engine``.

    Args:
        engine: the engine, or its handle (created once per engine and shared by every adapter on it).
        expected: what the engine accepts; by default read from the checkpoint the engine was started from.
        prefix_cache, lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: keep generation calls off the weights while an install writes (the install waits for
            running calls; new ones wait for the install).
    """

    def __init__(
        self,
        engine: Any,
        *,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        self.engine: EngineHandle = as_engine(engine)
        if expected is None:
            expected = self.engine.expected_weights()
            if expected is None:  # never skipped silently
                logger.warning(
                    "%s: the engine's checkpoint cannot be read from here (not a local directory), so names and "
                    "shapes are checked only by the engine itself, possibly after a partial write. Pass "
                    "expected=ExpectedWeights(...) (e.g. WeightUpdateManifest.from_safetensors(dir).tensors) to "
                    "validate before anything is written.",
                    self.engine.describe(),
                )
        super().__init__(
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            gate=self.engine.gate if guard_generation else None,
            version=self.engine.active_version,
            delta_state=self.engine.delta_state,
        )

    def _validate(
        self, manifest: WeightUpdateManifest, items: Items, force: bool
    ) -> tuple[Items, list[tuple[str, str]]]:
        if self.engine.is_sleeping():  # its weights may be offloaded or discarded: writing them crashes the engine
            raise EngineSleepingError(
                f"the engine ({self.engine.describe()}) is asleep, so its weights cannot be written; nothing was "
                "written. Wake it first (llm.wake_up(), or `await engine.wake_up()` for an AsyncLLM; waking only "
                "the weights, wake_up(tags=['weights']), is enough), then install again. An engine that slept before "
                "hotweights first saw it is judged by vLLM's is_sleeping(), which is also True while its scheduler is "
                "paused: resume it too."
            )
        return super()._validate(manifest, items, force)

    def _reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _record_engine_version(self, version: str) -> str | None:
        return self.engine.set_weight_version(version)

    def _clear_kv_cache(self) -> int | None:
        """Zero the KV cache; the number of tensors zeroed, or None where it cannot be reached."""
        return self.engine.clear_kv_cache()

    def _recover(self) -> str:
        zeroed = self._clear_kv_cache()
        self.engine.reset_prefix_cache()
        if zeroed is None:
            return "the prefix cache was reset (the KV cache cannot be reached from here)"
        return f"the prefix cache was reset and {zeroed} KV-cache tensors zeroed"

    def _engine_version_now(self) -> str | None:
        return self.engine.get_weight_version()

    def _probe_logprobs(self, token_ids: tuple[int, ...]) -> list[float | None] | None:
        return self.engine.prompt_logprobs(token_ids)
