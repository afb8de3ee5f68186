"""Install through vLLM's own weight-transfer API, with hotweights' ``"hotweights"`` backend on the engine side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hotweights.adapters._vllm import SessionAdapterOptions, VLLMSessionAdapter
from hotweights.adapters._wires import TransferAPIWire
from hotweights.adapters.base import InstallCall
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.engine.vllm_plugin import BACKEND
from hotweights.handles import as_engine
from hotweights.transports import WeightTransport

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VLLMWeightTransferAdapter"]


class VLLMWeightTransferAdapter(VLLMSessionAdapter):
    """Drives vLLM's ``init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update``.

    The engine is started with ``weight_transfer_config={"backend": "hotweights"}`` (registered by hotweights'
    vLLM plugin), a thin shim over the same install session the worker extension runs
    (:mod:`hotweights.engine.transfer_engine`); buckets travel through any hotweights transport. With
    ``transport="collective"`` the trainer is rank 0 of a process group created through
    ``init_weight_transfer_engine`` — NCCL on GPU, gloo on CPU — and a new adapter (e.g. after a trainer restart)
    replaces the workers' stale group. Options, validation, versions, prefix cache and all-or-nothing installs are
    as for :class:`VLLMMultiprocessAdapter`; but vLLM's calls return nothing, so the report cannot say which method
    ran (``install_method`` is None) or what was read back (``verify`` is refused), and ``digests_verified``
    counts the digests the workers checked by having accepted every bucket (a mismatch raises).

    Example:
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "hotweights"})            # doctest: +SKIP
        >>> adapter = VLLMWeightTransferAdapter(llm, transport="collective")                  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                     # doctest: +SKIP
    """

    name = "vllm-weight-transfer"
    verifies_digests_locally = False  # the workers verify after transit
    verifies_readback = False

    def __init__(
        self, engine: Any, *, transport: str | WeightTransport = "shm", **options: Unpack[SessionAdapterOptions]
    ) -> None:
        backend = as_engine(engine).weight_transfer_backend
        if backend != BACKEND:
            raise EngineNotSupportedError(
                f"this engine's weight transfer backend is {backend or 'not configured'!r}; start it with "
                f"LLM(..., weight_transfer_config={{'backend': {BACKEND!r}}}) with hotweights installed"
            )
        if getattr(transport, "keep_segments", False):
            raise ValueError(
                "kept shm segments are released through hotweights' worker extension, which vLLM's weight-transfer "
                "API cannot reach; use a plain make_transport('shm') here, or VLLMMultiprocessAdapter"
            )
        super().__init__(engine, wire=TransferAPIWire, transport=transport, **options)

    def _summary(
        self, summaries: list[dict[str, Any]], sent: WeightUpdateManifest | None, timer: InstallCall
    ) -> dict[str, Any]:
        return {"digests_verified": sum(s.digest is not None for s in sent.tensors.values()) if sent else 0}

    def _delta_refusal(self) -> str | None:
        if self.commit != "atomic":
            return "delta installs need commit='atomic'"
        return None
