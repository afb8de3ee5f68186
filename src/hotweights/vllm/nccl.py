"""vLLM's own NCCL weight transfer, under hotweights' install session (transport ``"vllm_nccl"``).

The bytes travel the way vLLM's ``nccl`` weight-transfer backend moves them (its packed, multi-buffered broadcast,
``vllm.distributed.weight_transfer.packed_tensor``); each worker receives them with vLLM's own
``NCCLWeightTransferEngine.receive_weights``. What that engine loads into is not the model but a
:class:`BucketTarget`: the bucket's bytes, checked name by name against the manifest. The staging area then
checks the bucket as for any transport, and the session prepares and commits it on every worker (validation before
writing, atomic commit, versions, delta, read-back), which vLLM's engine alone does not do.

It runs under the worker extension and under the ``hotweights`` weight-transfer backend (an engine started with
neither has no session to stage into). On a GPU: ``backend="nccl"`` (the trainer's tensors are moved to its
``device`` as they are packed). On a machine without an accelerator, ``backend="gloo"`` runs the same vLLM code over
gloo (:func:`hotweights.vllm.nccl_gloo.nccl_transfer_as`): how the suite proves the path on CPU.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hotweights.core import attach
from hotweights.core.buckets import Bucket
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import collective
from hotweights.transports.transport import BucketReceiver, Opened
from hotweights.vllm.nccl_gloo import nccl_transfer_as

__all__ = [
    "MAX_BUFFERS",
    "MAX_BUFFER_BYTES",
    "BucketTarget",
    "Receiver",
    "Transport",
    "VllmNcclDescriptor",
    "join",
    "joined",
    "leave",
]

#: The largest packed buffer, and the most buffers, a worker accepts from a trainer (it allocates both).
MAX_BUFFER_BYTES = 1 << 30
MAX_BUFFERS = 4
_KEY = "vllm_nccl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmNcclDescriptor(collective.CollectiveDescriptor):
    """A bucket vLLM's NCCL engine receives: only its size crosses the RPC; the bucket and its manifest name the
    tensors."""

    transport: str = "vllm_nccl"


class Transport(collective.Transport):
    """Buckets through vLLM's packed NCCL broadcast, received by vLLM's NCCL engine into the session's staging.

    Args:
        backend: ``"nccl"`` (GPU) or ``"gloo"`` (only on a machine without an accelerator).
        device: where the trainer packs (a CUDA device for NCCL; default: the current one).
        buffer_bytes, num_buffers: vLLM's packed-broadcast geometry (``packed_buffer_size_bytes``,
            ``packed_num_buffers``), sent to the workers at ``connect`` so that both sides agree.
        host, port, timeout: as for :class:`hotweights.transports.collective.Transport`.
    """

    name = "vllm_nccl"
    descriptor = VllmNcclDescriptor

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "nccl",
        timeout: float = 60.0,
        device: str | torch.device | None = None,
        buffer_bytes: int = 256 << 20,
        num_buffers: int = 2,
    ) -> None:
        if backend == "nccl" and not torch.cuda.is_available():
            raise EngineNotSupportedError(
                "the vllm_nccl transport with backend='nccl' needs a CUDA GPU; on a CPU machine use the shm transport "
                "(or backend='gloo', the CPU stand-in for NCCL)"
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        super().__init__(host=host, port=port, backend=backend, timeout=timeout, device=device)
        _check_geometry(buffer_bytes, num_buffers)
        self.buffer_bytes, self.num_buffers = buffer_bytes, num_buffers

    def _rendezvous(self, world: int) -> tuple[int, Callable[[], Any], Any]:
        with socket.create_server((self.host, self.port)) as probe:  # vLLM's store binds the port itself
            port = int(probe.getsockname()[1])

        def host_group() -> Any:
            from vllm.distributed.weight_transfer import nccl_common

            with nccl_transfer_as(self.backend):
                return nccl_common.trainer_init({"master_address": self.host, "master_port": port, "world_size": world})

        return port, host_group, None

    def _join_args(self, port: int, world: int) -> dict[str, Any]:
        geometry = {"buffer_bytes": self.buffer_bytes, "num_buffers": self.num_buffers}
        return {**super()._join_args(port, world), "vllm_nccl": geometry}

    def _broadcast(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> Callable[[], object]:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        group, device = self._group, self.device
        items = [(e.name, tensors[e.name]) for e in bucket.entries]

        def send() -> None:
            with nccl_transfer_as(self.backend):
                packed_nccl_broadcast_producer(
                    iter(items), group, 0, lambda item: item[1].to(device), self.buffer_bytes, self.num_buffers
                )

        return send


def _check_geometry(buffer_bytes: Any, num_buffers: Any) -> None:
    collective._int_in(buffer_bytes, "buffer_bytes", 1 << 10, MAX_BUFFER_BYTES, "vLLM's packed buffer size")
    collective._int_in(num_buffers, "num_buffers", 1, MAX_BUFFERS, "vLLM's packed buffer count")


# ---------------------------------------------------------------------------------------------- engine side
def join(
    owner: Any, host: str, port: int, world_size: int, backend: str, timeout: float, geometry: dict[str, Any]
) -> int:
    """A worker joins the trainer's group through vLLM's NCCL engine (replacing one it had); returns its rank.
    ``owner`` is the worker (extension) or the ``hotweights`` transfer backend: what the session stages for."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine,
        NCCLWeightTransferInitInfo,
    )

    rank, _ = collective.checked_join(owner, host, port, world_size, backend, timeout)
    if not isinstance(geometry, dict):
        raise ValueError(f"vllm_nccl needs its buffer geometry, got {geometry!r}")
    _check_geometry(geometry.get("buffer_bytes"), geometry.get("num_buffers"))
    leave(owner)
    vllm_config, device, model = _parts(owner)
    engine = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), vllm_config, device, model)
    info = NCCLWeightTransferInitInfo(
        master_address=host,
        master_port=port,
        rank_offset=1,
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=geometry["buffer_bytes"],
        packed_num_buffers=geometry["num_buffers"],
    )
    with nccl_transfer_as(backend):
        engine.init_transfer_engine(info)
    attach.put(owner, _KEY, _Joined(engine, backend))
    return rank


class _Joined:
    """A worker's vLLM NCCL engine, over which backend, and how many buckets it received."""

    def __init__(self, engine: Any, backend: str) -> None:
        self.engine, self.backend, self.buckets = engine, backend, 0


def joined(owner: Any) -> dict[str, Any]:
    """What the worker's ``status`` says of it: vLLM's engine class, the backend, buckets received (``{}``: none)."""
    entry = attach.get(owner, _KEY)
    if entry is None:
        return {}
    return {"engine": type(entry.engine).__name__, "backend": entry.backend, "buckets": entry.buckets}


def leave(owner: Any) -> bool:
    """Drop the worker's vLLM NCCL engine, if any."""
    entry = attach.get(owner, _KEY)
    attach.put(owner, _KEY, None)
    if entry is not None:
        entry.engine.shutdown()
    return entry is not None


def _parts(owner: Any) -> tuple[Any, torch.device, torch.nn.Module]:
    """vLLM's config, the device and the model of a worker or of a weight-transfer backend."""
    from hotweights.vllm.worker.runner import worker_model

    model = getattr(owner, "model", None)
    if not isinstance(model, torch.nn.Module):
        model = worker_model(owner)
    vllm_config = getattr(owner, "vllm_config", None) or owner.model_runner.vllm_config
    device = getattr(owner, "device", None)
    return vllm_config, device if isinstance(device, torch.device) else torch.device("cpu"), model


class BucketTarget:
    """What vLLM's engine loads into (``set_weight_update_target``): one bucket's bytes. Every tensor it is handed
    is checked against the bucket and the manifest (name, shape, dtype, at most once) and copied to its offset."""

    def __init__(self, bucket: Bucket, manifest: WeightUpdateManifest, device: torch.device) -> None:
        self.buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        self.manifest = manifest
        self.entries = {e.name: e for e in bucket.entries}
        self.received: set[str] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            entry = self.entries.get(name)
            if entry is None or name in self.received:
                why = "twice" if entry is not None else "though the bucket does not list it"
                raise ValueError(f"vLLM's NCCL engine delivered {name!r} {why}")
            spec = self.manifest.tensors[name]
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.torch_dtype:
                raise ValueError(
                    f"vLLM's NCCL engine delivered {name!r} as {tuple(tensor.shape)} {tensor.dtype}, the manifest "
                    f"says {tuple(spec.shape)} {spec.dtype}"
                )
            view = self.buffer[entry.offset : entry.offset + entry.nbytes]
            view.view(tensor.dtype).view(tensor.shape).copy_(tensor)
            self.received.add(name)
            loaded.add(name)
        return loaded

    def missing(self) -> list[str]:
        return [n for n in self.entries if n not in self.received]


class Receiver(BucketReceiver):
    """Receive one bucket with vLLM's NCCL engine. What it receives is named by the bucket and the manifest (both
    checked by the staging area already), never by the trainer: the engine allocates only vLLM's packed buffers of
    the geometry it accepted at ``join``, and the bucket's bytes."""

    descriptor = VllmNcclDescriptor

    @classmethod
    def open(
        cls,
        descriptor: VllmNcclDescriptor,
        worker: Any = None,
        bucket: Bucket | None = None,
        manifest: WeightUpdateManifest | None = None,
    ) -> Opened:
        if bucket is None or manifest is None:
            raise ValueError("vLLM's NCCL engine receives a bucket named by its bucket and manifest: pass both")
        return _receive(worker, bucket, manifest)


def _receive(owner: Any, bucket: Bucket, manifest: WeightUpdateManifest) -> Opened:
    entry = attach.get(owner, _KEY)
    if entry is None:
        raise EngineNotSupportedError(
            "this worker has no vLLM NCCL engine: the trainer must connect the vllm_nccl transport first"
        )
    engine, backend = entry.engine, entry.backend
    specs = [manifest.tensors[e.name] for e in bucket.entries]
    info = engine.parse_update_info(
        {
            "names": [e.name for e in bucket.entries],
            "dtype_names": [str(s.torch_dtype).removeprefix("torch.") for s in specs],
            "shapes": [list(s.shape) for s in specs],
        }
    )
    target = BucketTarget(bucket, manifest, engine.device)
    engine.set_weight_update_target(target, engine.model_config)
    try:
        with nccl_transfer_as(backend):
            engine.receive_weights(info)
    finally:
        engine.reset_weight_update_target()
    missing = target.missing()
    if missing:
        raise ValueError(f"vLLM's NCCL engine never delivered {missing[:5]} of bucket {bucket.index}")
    entry.buckets += 1
    return target.buffer, None
