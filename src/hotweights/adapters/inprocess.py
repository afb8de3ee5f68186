"""Install into an engine that runs in this process: the install session, tensors handed over by reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hotweights.adapters._vllm import EngineOptions
from hotweights.adapters.installer import Installer
from hotweights.adapters.options import InstallerOptions, InstallMethod
from hotweights.adapters.wires import InProcessWire
from hotweights.core.errors import EngineNotSupportedError
from hotweights.handles import EngineHandle, as_engine
from hotweights.handles.llm import LLMHandle
from hotweights.vllm import introspect

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VLLMInProcessAdapter"]


class VLLMInProcessAdapter(Installer):
    """Installs checkpoint-format tensors into an in-process ``vllm.LLM``; ``install_method="auto"`` by default (what
    :func:`hotweights.install` uses there).

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The install session
    (:mod:`hotweights.vllm.worker.session`) runs in the engine's worker, called directly: the manifest and the tensors
    are handed over by reference, never serialised or copied. The worker checks the manifest against the
    checkpoint it serves, then installs every tensor at once: by vLLM's layerwise reload (``install_method=
    "reload"``: fused parameters are rebuilt from complete parts and vLLM's post-load processing, e.g. oneDNN packing
    on CPU, runs on the new weights), by the direct setter (``"direct"``), or by whichever the setter's plan proves
    safe (``"auto"``, the default). Nothing is staged
    aside (the tensors are the caller's), so a failure while writing leaves a partial update: the engine then
    fails closed until a full install.

    Args:
        engine: the ``vllm.LLM``.
        install_method: ``"auto"`` (default), ``"reload"`` or ``"direct"``.
        expected: what the engine accepts; by default read from the safetensors headers of the model directory the
            engine was started from, in the engine's dtype.
        prefix_cache: ``"reset"`` (default) or ``"keep"``.
        rpc_timeout: seconds the install may take (None: no limit).
        lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).
        verify: default of ``install(..., verify=...)``: read the live parameters back after the install.

    Example:
        >>> adapter = VLLMInProcessAdapter(llm)                                      # doctest: +SKIP
        >>> manifest = WeightUpdateManifest.from_module(model, weight_version=step)  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                            # doctest: +SKIP
    """

    name = "inprocess"
    default_method: InstallMethod = "auto"

    def __init__(
        self,
        engine: Any,
        *,
        install_method: InstallMethod | None = None,
        rpc_timeout: float | None = None,
        verify: bool = False,
        **options: Unpack[EngineOptions],
    ) -> None:
        handle = as_engine(engine)
        if not isinstance(handle, LLMHandle) or not handle.inprocess:
            raise EngineNotSupportedError(
                "this vllm.LLM runs its engine in other processes; the in-process adapters hand tensors over by "
                "reference and cannot reach them. Start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0, or use "
                "hotweights.install(llm, ...) to pick an adapter that fits."
            )
        method = install_method or self.default_method
        chosen = InstallerOptions(install_method=method, verify=verify, rpc_timeout=rpc_timeout)
        super().__init__(handle, InProcessWire(handle.llm, rpc_timeout), "reference", chosen, **options)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.install_method}"

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` whose worker runs in this process."""
        assert isinstance(self.engine, LLMHandle)
        return self.engine.llm

    @property
    def model(self) -> torch.nn.Module:
        """The model the engine serves (its worker runs in this process)."""
        return introspect.inprocess_model(self.llm)


def for_engine(handle: EngineHandle) -> VLLMInProcessAdapter:
    """The adapter :func:`hotweights.install` builds on the route ``inprocess``:
    the session in this process, ``install_method="auto"``."""
    return VLLMInProcessAdapter(handle)
