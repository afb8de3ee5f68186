"""hotweights' transports as a backend of vLLM's own weight-transfer API.

With the package installed, vLLM's plugin loader registers the backend ``"hotweights"`` in every process (entry
point ``vllm.general_plugins``). An engine started with ``weight_transfer_config={"backend": "hotweights"}`` then
accepts the native flow, with hotweights' buckets and descriptors as ``update_info`` (JSON and bytes only)::

    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
    llm.collective_rpc("start_weight_update")
    llm.collective_rpc("update_weights", kwargs={"update_info": {"update_id": ..., "manifest_json": ...,
                                                                  "bucket_json": ..., "descriptor": {...}}})
    llm.collective_rpc("finish_weight_update")

Updates are staged exactly as with the worker extension and installed in one layerwise reload at
``finish_weight_update``; a session that is not finished leaves the previous weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from hotweights.engine.staging import StagingArea
from hotweights.engine.worker_ops import reload_model

__all__ = ["HotWeightsInitInfo", "HotWeightsTransferEngine", "HotWeightsUpdateInfo"]


@dataclass
class HotWeightsInitInfo(WeightTransferInitInfo):
    """Optional collective rendezvous (leave empty for the shm and bytes transports)."""

    host: str | None = None
    port: int | None = None
    world_size: int | None = None
    backend: str = "gloo"
    timeout: float = 60.0


@dataclass
class HotWeightsUpdateInfo(WeightTransferUpdateInfo):
    """One bucket; the first bucket of an update also carries the manifest (JSON)."""

    update_id: str
    bucket_json: str = ""
    descriptor: dict[str, Any] | None = None
    manifest_json: str | None = None
    abort: bool = False
    """Drop what was staged for ``update_id`` (then ``finish_weight_update`` closes the session untouched)."""


class HotWeightsTransferEngine(WeightTransferEngine[HotWeightsInitInfo, HotWeightsUpdateInfo]):
    """vLLM weight-transfer backend over hotweights' staging and transports."""

    init_info_cls = HotWeightsInitInfo
    update_info_cls = HotWeightsUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = int(getattr(self.parallel_config, "rank", 0))
        self._staging = StagingArea(self)
        self._update_id: str | None = None

    def init_transfer_engine(self, init_info: HotWeightsInitInfo) -> None:
        if init_info.host is not None and init_info.port is not None and init_info.world_size is not None:
            from hotweights.transports.collective import init_worker_group

            init_worker_group(
                self, init_info.host, init_info.port, init_info.world_size, init_info.backend, init_info.timeout
            )

    def start_weight_update(self) -> None:
        self._staging.abort()
        self._update_id = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes the accelerator, which raises on a CPU-only machine.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HotWeightsUpdateInfo) -> None:
        if update_info.abort:
            self._staging.abort(update_info.update_id)
            self._update_id = None
            return
        if update_info.descriptor is None:
            raise ValueError("update_info needs a 'descriptor' (or abort=True)")
        if update_info.manifest_json is not None:
            self._update_id = self._staging.begin(update_info.manifest_json)
        self._staging.stage(update_info.update_id, update_info.bucket_json, update_info.descriptor)

    def finish_weight_update(self) -> None:
        if self._update_id is None:
            return
        items, _ = self._staging.take(self._update_id)
        self._update_id = None
        reload_model(self.vllm_config, self.model, items)

    def shutdown(self) -> None:
        from hotweights.transports.collective import close_group

        self._staging.abort()
        close_group(self)
