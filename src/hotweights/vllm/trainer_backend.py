"""The trainer side of the ``"hotweights"`` backend in vLLM's weight-transfer API (vLLM >= 0.29).

A trainer written against vLLM's own API selects hotweights by its init info alone::

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from hotweights.vllm.trainer_backend import HotWeightsTrainerInitInfo

    sender = WeightTransferTrainerFactory.trainer_init(
        HotWeightsTrainerInitInfo(rank=rank), client=client, source=source
    )
    sender.send_weights()          # every round, on every trainer rank

``client`` is any of vLLM's ``VLLMWeightSyncClient`` (HTTP, Ray) for an engine started with
``weight_transfer_config={"backend": "hotweights"}``. Each round is one install session (:mod:`hotweights.vllm.worker.
transfer_backend` on the engine side): the manifest first (checked against the checkpoint the engine serves), then
every bucket through the shm transport (checked as it is staged: digests, NaN and Inf), ``prepare``, and the commit
in ``finish_weight_update``, which also records the version; then the engine's prefix cache is reset where the
client can (``client.reset_prefix_cache()``; vLLM's own clients cannot: reset it yourself, as vLLM's examples do,
before serving). A refusal or a failure aborts the session, so the
engine keeps serving what it served, and raises here as hotweights' typed error (:mod:`hotweights.core.envelope`).
Importing this module registers the trainer engine; so does hotweights' vLLM plugin.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from hotweights.core import envelope
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.manifest import TensorSpec, WeightUpdateManifest
from hotweights.transports import Descriptor, EngineLink, WeightTransport, make_transport, wire_of
from hotweights.vllm.plugin import BACKEND
from hotweights.vllm.worker.session import SessionOptions

__all__ = ["HotWeightsTrainerEngine", "HotWeightsTrainerInitInfo", "register"]

log = logging.getLogger("hotweights")


@dataclass
class HotWeightsTrainerInitInfo(TrainerInitInfo):
    """What the trainer side needs: the transport (``"shm"``: the engine's workers share this host; ``"bytes"``:
    inside the RPC, for a client that carries bytes), the bucket size (None: the transport's own) and the first
    weight version (each :meth:`HotWeightsTrainerEngine.send_weights` then adds one, unless it is given one)."""

    backend: ClassVar[str] = BACKEND

    transport: str = "shm"
    bucket_bytes: int | None = None
    first_version: int = 1
    allow_nonfinite: bool = False
    """Stage tensors that hold NaN or Inf (refused by the engine's workers by default)."""


class _ClientLink(EngineLink):
    """The :class:`~hotweights.transports.EngineLink` a transport connects through: the engine behind a client."""

    @property
    def num_workers(self) -> int:
        return 1

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        raise NotImplementedError(f"vLLM's weight-sync client carries no worker operation ({op!r})")


class HotWeightsTrainerEngine(TrainerWeightTransferEngine[HotWeightsTrainerInitInfo]):
    """Sends the trainer's weights as one hotweights install session per round (see the module)."""

    init_info_cls = HotWeightsTrainerInitInfo

    def __init__(self, init_info: HotWeightsTrainerInitInfo, *, client: Any, source: Any, is_sender: bool) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.transport: WeightTransport = make_transport(init_info.transport)
        self.transport.connect(_ClientLink())
        self._versions = itertools.count(init_info.first_version)
        self._warned = False

    @classmethod
    def trainer_init(
        cls, init_info: HotWeightsTrainerInitInfo, *, client: Any, source: Any = None
    ) -> HotWeightsTrainerEngine:
        if source is None:
            raise ValueError("the hotweights backend resends the whole model each round: pass source= to trainer_init")
        sender = init_info.rank == 0
        if sender:
            client.init_weight_transfer_engine({})  # shm and bytes need no rendezvous
        return cls(init_info, client=client, source=source, is_sender=sender)

    def send_weights(self, weight_version: int | None = None) -> None:
        """One round: every tensor of the source, installed as ``weight_version`` (default: the next one).
        Raises hotweights' typed error (e.g. :class:`~hotweights.WeightManifestValidationError`,
        :class:`~hotweights.NonFiniteWeightsError`) when the engine refused it; it then serves what it served."""
        version = next(self._versions) if weight_version is None else weight_version
        source = self.source
        assert source is not None  # trainer_init refuses a missing one
        if not self.is_sender:
            for _ in source:  # every rank takes part in the source's collectives, in order
                pass
            return
        specs = {m.name: TensorSpec(shape=tuple(m.shape), dtype=str(m.dtype)) for m in source.metadata()}
        manifest = WeightUpdateManifest(weight_version=version, update_id=uuid.uuid4().hex, tensors=specs)
        size = self.init_info.bucket_bytes or self.transport.preferred_bucket_bytes
        plan = plan_buckets(manifest, size)
        options = SessionOptions(manifest=manifest.to_json(), allow_nonfinite=self.init_info.allow_nonfinite)
        update = manifest.update_id
        self.client.start_weight_update()
        try:
            self.client.update_weights({"update_id": update, "options_json": options.model_dump_json()})
            self._send(source, plan, self._stage(update))
            self.client.update_weights({"update_id": update, "prepare": True})
        except BaseException as exc:
            self._abort(update)
            if (typed := envelope.decode(exc)) is not None:
                raise typed from exc
            raise
        try:
            self.client.finish_weight_update(str(version))  # the commit: a failure here may leave a partial write
        except Exception as exc:
            if (typed := envelope.decode(exc)) is not None:
                raise typed from exc
            raise
        reset = getattr(self.client, "reset_prefix_cache", None)  # not part of vLLM's client protocol
        if callable(reset):
            reset()
        elif not self._warned:
            self._warned = True
            log.warning(
                "hotweights: v%s installed; vLLM's weight-sync client cannot reset the engine's prefix cache, so reset "
                "it before serving (POST /reset_prefix_cache, llm.reset_prefix_cache()): blocks cached before the "
                "update would be reused with the new weights",
                version,
            )

    def _stage(self, update: str) -> Callable[[Bucket], Callable[[Descriptor], None]]:
        def deliver(bucket: Bucket) -> Callable[[Descriptor], None]:
            def stage(descriptor: Descriptor) -> None:
                wire = wire_of(descriptor)
                info = {"update_id": update, "bucket_json": bucket.model_dump_json(), "descriptor": wire}
                self.client.update_weights(info)

            return stage

        return deliver

    def _send(self, source: Any, plan: list[Bucket], deliver: Callable[[Bucket], Any]) -> None:
        """Each bucket sent as soon as the source yielded its last tensor; what it held is dropped after."""
        waiting = {e.name: b.index for b in plan for e in b.entries}
        missing = {b.index: {e.name for e in b.entries} for b in plan}
        held: dict[str, torch.Tensor] = {}
        for name, tensor in source:
            if name not in waiting:
                raise ValueError(f"the source yielded {name!r}, which its metadata() did not list")
            held[name] = tensor
            index = waiting[name]
            missing[index].discard(name)
            if not missing[index]:
                bucket = plan[index]
                self.transport.send(bucket, held, deliver(bucket))
                for e in bucket.entries:
                    held.pop(e.name, None)
        never = sorted(n for names in missing.values() for n in names)
        if never:
            raise ValueError(f"the source never yielded {len(never)} tensor(s) its metadata() listed: {never[:5]}")

    def _abort(self, update: str) -> None:
        try:
            self.client.update_weights({"update_id": update, "abort": True})
            self.client.finish_weight_update()
        except Exception:  # the engine may be what failed: the error that got here is the one to raise
            pass

    def shutdown(self) -> None:
        self.transport.close()


def register() -> None:
    """Register :class:`HotWeightsTrainerEngine` as vLLM's trainer-side ``"hotweights"`` backend (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, HotWeightsTrainerEngine)


register()
