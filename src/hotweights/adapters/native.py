"""Install through vLLM's own weight-transfer API, with hotweights' ``"hotweights"`` backend on the engine side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hotweights.adapters.installer import Installer, SessionAdapterOptions, split_options
from hotweights.adapters.wires import TransferAPIWire
from hotweights.core.errors import EngineNotSupportedError
from hotweights.handles import EngineHandle, as_engine
from hotweights.transports import WeightTransport
from hotweights.vllm.plugin import BACKEND

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VLLMWeightTransferAdapter"]


class VLLMWeightTransferAdapter(Installer):
    """Drives vLLM's ``init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update``.

    The engine is started with ``weight_transfer_config={"backend": "hotweights"}`` (registered by hotweights'
    vLLM plugin), a thin shim over the same install session the worker extension runs
    (:mod:`hotweights.vllm.worker.transfer_backend`); buckets travel through any hotweights transport. With
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

    def __init__(
        self, engine: Any, *, transport: str | WeightTransport = "shm", **options: Unpack[SessionAdapterOptions]
    ) -> None:
        handle = as_engine(engine)
        backend = handle.weight_transfer_backend
        if backend != BACKEND:
            raise EngineNotSupportedError(
                f"this engine's weight transfer backend is {backend or 'not configured'!r}; start it with "
                f"LLM(..., weight_transfer_config={{'backend': {BACKEND!r}}}) with hotweights installed"
            )
        chosen, common = split_options(options)
        super().__init__(handle, TransferAPIWire(handle, chosen.rpc_timeout), transport, chosen, **common)


def for_engine(handle: EngineHandle) -> VLLMWeightTransferAdapter:
    """The adapter :func:`hotweights.install` builds on the route ``weight_transfer``:
    vLLM's weight-transfer API, over the engine's default transport."""
    return VLLMWeightTransferAdapter(handle, transport=handle.default_transport)
