"""``hotweights.install(llm, tensors, weight_version=...)``: one call from a trainer loop."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from hotweights.adapters.base import WeightInstallAdapter
from hotweights.adapters.inprocess import VLLMInProcessWeightReloadAdapter
from hotweights.adapters.multiprocess import VLLMMultiprocessAdapter
from hotweights.adapters.native import VLLMWeightTransferAdapter
from hotweights.core.layout import WeightLayout
from hotweights.core.manifest import MetadataValue, TensorsLike, WeightUpdateManifest, _as_items
from hotweights.core.report import InstallReport
from hotweights.engine import compat
from hotweights.engine.vllm_plugin import BACKEND

__all__ = ["adapter_for", "install"]

# The adapter lives on the engine object itself: it holds the engine, so a registry keyed by the engine would keep
# every engine alive. Stored on the LLM, both go together when the user drops the LLM.
_ATTR = "_hotweights_adapter"
_ADAPTERS_LOCK = threading.Lock()


def adapter_for(llm: Any) -> WeightInstallAdapter:
    """The adapter that fits ``llm``, created on first use and kept for the engine's lifetime (it holds the
    active version): in-process reload for in-process engines, shared memory for multiprocess ones (started with
    ``worker_extension_cls=hotweights.WORKER_EXTENSION``; without it, :class:`EngineNotSupportedError` says so)."""
    with _ADAPTERS_LOCK:
        adapter: WeightInstallAdapter | None = getattr(llm, _ATTR, None)
        if adapter is None:
            if compat.engine_mode(llm) == "inprocess":
                adapter = VLLMInProcessWeightReloadAdapter(llm)
            elif compat.weight_transfer_backend(llm) == BACKEND and not compat.worker_extension(llm):
                adapter = VLLMWeightTransferAdapter(llm, transport="shm")
            else:
                adapter = VLLMMultiprocessAdapter(llm, transport="shm")
            setattr(llm, _ATTR, adapter)
        return adapter


def install(
    llm: Any,
    tensors: TensorsLike,
    *,
    weight_version: int,
    update_id: str | None = None,
    layout: WeightLayout | None = None,
    metadata: Mapping[str, MetadataValue] | None = None,
    force: bool = False,
    digests: bool = False,
) -> InstallReport:
    """Install ``tensors`` (checkpoint format, e.g. ``model.state_dict()``) into a running ``vllm.LLM``.

    Builds the manifest, validates it against the tensors and the engine, installs through the adapter that fits
    the engine, resets the prefix cache and returns the report. ``digests=True`` hashes every tensor so the
    engine verifies the bytes it received before installing (see ``InstallReport.digests_verified``).

    Raises:
        WeightManifestValidationError: the tensors do not match what the engine serves; nothing was written.
        StaleWeightVersionError: ``weight_version`` is not newer than the active one (pass ``force=True``).
        EngineNotSupportedError: no adapter fits this engine.

    Example:
        >>> report = hotweights.install(llm, model.state_dict(), weight_version=step)  # doctest: +SKIP
        >>> print(report)                                                               # doctest: +SKIP
    """
    items = _as_items(tensors)
    manifest = WeightUpdateManifest.from_state_dict(
        items, weight_version=weight_version, update_id=update_id, layout=layout, metadata=metadata, digests=digests
    )
    return adapter_for(llm).install(manifest, items, force=force)
