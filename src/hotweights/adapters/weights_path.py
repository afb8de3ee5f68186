"""Install into any multiprocess engine through vLLM's own worker method: no extension, no backend, no flags."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hotweights.adapters._vllm import VLLMEngineAdapter
from hotweights.adapters.base import Items, PrefixCachePolicy
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.core.report import PhaseTimer
from hotweights.engine import compat
from hotweights.transports.shm import SHM_DIR, sweep_stale

__all__ = ["VLLMWeightsPathAdapter"]

#: File the update is written to, inside a private directory per install.
CHECKPOINT_FILE = "model.safetensors"


class VLLMWeightsPathAdapter(VLLMEngineAdapter):
    """Installs through ``collective_rpc("reload_weights", weights_path=...)``, which every vLLM worker has.

    The validated update is written as one safetensors file into a private directory in ``/dev/shm`` (mode 0700,
    named ``hotweights-<pid>-…``); every worker then reloads it in one layerwise reload, so fused parameters are
    rebuilt from complete parts. The directory is removed on every outcome. Nothing touches the model until the
    reload starts; generation waits only for the reload itself.

    This is the zero-configuration path: a plain ``LLM(model=...)`` or ``AsyncLLM`` needs no extension. The worker
    extension buys more (bucketed, pre-checked staging with an all-or-nothing commit, streaming with bounded memory,
    the direct setter, kept segments: see :class:`VLLMMultiprocessAdapter`). Here the host holds the update once in
    ``/dev/shm`` for the length of the install, and a reload that fails midway leaves a partial update (the engine
    then fails closed). Afterwards the workers' model config names the removed directory: a later
    ``reload_weights()`` without arguments would not find it (hotweights always passes its own).

    Args:
        llm: a multiprocess ``vllm.LLM``, an ``AsyncLLM``, or an engine handle whose workers can read this host's
            ``/dev/shm``.
        rpc_timeout: seconds the reload may take before :class:`HotWeightsTimeoutError`.
        expected, prefix_cache, lock_timeout, guard_generation: see :class:`VLLMMultiprocessAdapter`.

    Example:
        >>> llm = LLM(model=path)                                   # doctest: +SKIP
        >>> VLLMWeightsPathAdapter(llm).install(manifest, tensors)  # doctest: +SKIP
    """

    name = "weights-path"

    def __init__(
        self,
        llm: Any,
        *,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        rpc_timeout: float | None = 300.0,
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        super().__init__(
            llm,
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            guard_generation=guard_generation,
        )
        self.rpc_timeout = rpc_timeout
        sweep_stale(min_age=60.0)  # checkpoint directories of trainers that died mid-install

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: PhaseTimer) -> dict[str, int]:
        self._refuse_unmended()
        directory = Path(tempfile.mkdtemp(prefix=f"hotweights-{os.getpid()}-ckpt-", dir=SHM_DIR))
        try:
            with timer("pack"):
                save_file(_host_tensors(items), str(directory / CHECKPOINT_FILE))
            self._begin_writing(timer)
            with timer("install"):
                self.engine.call(
                    "reload_weights",
                    timeout=self.rpc_timeout,
                    kwargs={"weights_path": str(directory), "is_checkpoint_format": True},
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return self._digests(manifest)

    def _refuse_unmended(self) -> None:
        """vLLM's own reload needs mending for some models (:data:`~hotweights.engine.compat.VLLM_FIXES`); the
        mend runs in the engine's processes only through hotweights' vLLM plugin: refuse where it cannot."""
        if self.engine.kind not in ("llm", "async_llm") or compat.vllm_fixes_reach_workers():
            return
        needed = compat.vllm_fixes_needed(self.llm)
        if needed:
            why = "; ".join(compat.VLLM_FIXES[n] for n in needed)
            raise EngineNotSupportedError(
                f"this model needs a fix to vLLM's reload_weights that runs in the engine's processes through "
                f"hotweights' vLLM plugin, and VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r} leaves it out ({why}); "
                "nothing was written. Add hotweights to VLLM_PLUGINS, or start the engine with "
                f"worker_extension_cls={compat.WORKER_EXTENSION!r}."
            )


def _host_tensors(items: Items) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing storage with another (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out
