"""hotweights as a backend of vLLM's own weight-transfer API: a thin shim over the install session.

With the package installed, vLLM's plugin loader registers the backend ``"hotweights"`` in every process (entry
point ``vllm.general_plugins``). An engine started with ``weight_transfer_config={"backend": "hotweights"}`` then
accepts vLLM's four-phase flow, which maps onto :class:`~hotweights.vllm.worker.session.WorkerSession` (JSON and bytes
only in ``update_info``)::

    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})   # or a collective rendezvous
    llm.collective_rpc("start_weight_update")
    llm.collective_rpc("update_weights", kwargs={"update_info": {"update_id": ..., "options_json": ...}})  # begin
    llm.collective_rpc("update_weights", kwargs={"update_info": {"update_id": ..., "bucket_json": ...,
                                                                  "descriptor": {...}}})  # stage, per bucket
    # (a flow written by hand may instead send the first bucket with "manifest_json": all options at default)
    llm.collective_rpc("update_weights", kwargs={"update_info": {"update_id": ..., "prepare": True}})
    llm.collective_rpc("finish_weight_update")                                     # commit

Every session option (method, commit, delta) works as through the worker extension, but ``verify``:
:class:`~hotweights.adapters.VLLMWeightTransferAdapter` refuses it, because vLLM's calls return nothing and what a
read-back found could not come back. For the same reason what the session says (the method that ran, what was
checked) stays in the engine's log; a refusal raises, and leaves with its envelope (:mod:`hotweights.core.envelope`),
so the trainer gets it back typed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from hotweights.core.envelope import enveloped
from hotweights.vllm.worker.ops import reload_model
from hotweights.vllm.worker.session import SessionOptions, WorkerSession, refusal

__all__ = ["HotWeightsInitInfo", "HotWeightsTransferEngine", "HotWeightsUpdateInfo"]

log = logging.getLogger("hotweights")


@dataclass
class HotWeightsInitInfo(WeightTransferInitInfo):
    """Optional collective rendezvous (leave empty for the shm and bytes transports)."""

    host: str | None = None
    port: int | None = None
    world_size: int | None = None
    backend: str = "gloo"
    timeout: float = 60.0
    vllm_nccl: dict[str, Any] | None = None
    """Join through vLLM's own NCCL engine, with this packed-buffer geometry (:mod:`hotweights.vllm.nccl`)."""


@dataclass
class HotWeightsUpdateInfo(WeightTransferUpdateInfo):
    """One step of a session: ``options_json`` begins it, a bucket stages, ``prepare`` readies, ``abort`` drops."""

    update_id: str
    options_json: str = ""
    manifest_json: str = ""
    """Shorthand for ``options_json`` with every option at its default (what a flow written by hand sends)."""
    bucket_json: str = ""
    descriptor: dict[str, Any] | None = None
    prepare: bool = False
    abort: bool = False


class _Worker:
    """What the session needs of a worker, for the model this backend updates (its ``reload_weights`` is vLLM's
    layerwise reload into that model)."""

    def __init__(self, engine: HotWeightsTransferEngine) -> None:
        self.model_runner = self
        self._engine = engine

    @property
    def vllm_config(self) -> Any:
        return self._engine.vllm_config

    def get_model(self) -> torch.nn.Module:
        model = self._engine.model
        assert isinstance(model, torch.nn.Module)
        return model

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool = True) -> None:
        reload_model(self._engine.vllm_config, self.get_model(), weights_iterator)


class HotWeightsTransferEngine(WeightTransferEngine[HotWeightsInitInfo, HotWeightsUpdateInfo]):
    """vLLM weight-transfer backend over hotweights' install session and transports."""

    init_info_cls = HotWeightsInitInfo
    update_info_cls = HotWeightsUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = int(getattr(self.parallel_config, "rank", 0))
        self._session = WorkerSession(_Worker(self), owner=self)
        self._update_id: str | None = None

    @enveloped
    def init_transfer_engine(self, init_info: HotWeightsInitInfo) -> None:
        if init_info.host is not None and init_info.port is not None and init_info.world_size is not None:
            args = (self, init_info.host, init_info.port, init_info.world_size, init_info.backend, init_info.timeout)
            if init_info.vllm_nccl is not None:
                from hotweights.vllm.nccl import join

                join(*args, init_info.vllm_nccl)
                return
            from hotweights.transports.collective import init_worker_group

            init_worker_group(*args)

    @enveloped
    def start_weight_update(self) -> None:
        self._session.abort()  # a session a crashed trainer left open
        self._update_id = None

    @enveloped
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronizes the accelerator, which raises on a CPU-only machine.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: HotWeightsUpdateInfo) -> None:
        session, update_id = self._session, update_info.update_id
        if update_info.abort:
            session.abort(update_id)
            self._update_id = None
            return
        options: str | SessionOptions = update_info.options_json
        if not options and update_info.manifest_json:
            options = SessionOptions(manifest=update_info.manifest_json)
        if options:
            self._update_id = str(session.begin(options)["update_id"])
        if update_info.bucket_json:
            if update_info.descriptor is None:
                raise ValueError("update_info with a bucket needs its 'descriptor'")
            session.stage(update_id, update_info.bucket_json, update_info.descriptor)
        if update_info.prepare:
            problems = session.prepare(update_id)
            if problems:
                raise refusal(problems)

    @enveloped
    def finish_weight_update(self) -> None:
        if self._update_id is None:
            return
        update_id, self._update_id = self._update_id, None
        summary = self._session.commit(update_id)
        log.info("hotweights: installed %s: %s", update_id, summary)

    def shutdown(self) -> None:
        from hotweights.transports.collective import close_group
        from hotweights.vllm.nccl import leave

        self._session.abort()
        leave(self)
        close_group(self)
