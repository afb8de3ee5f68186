"""CUDA IPC transport: each bucket is packed once into a CUDA buffer on the trainer's GPU; the engine's workers on
the same physical GPU open it through a CUDA IPC handle and stage views of it — no host round trip, no copy.

The descriptor carries only the handle's primitives (ints and bytes, never pickle). torch's IPC reference
counting keeps the trainer's block alive until every worker has dropped its views (after the commit), so the
trainer may free its buffer as soon as the bucket is staged: handles are released after the install.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from hotweights.core.buckets import Bucket, pack_into
from hotweights.core.errors import HotWeightsError
from hotweights.transports.transport import BucketReceiver, Descriptor, Opened, Stage, WeightTransport

__all__ = ["CudaIpcDescriptor", "Receiver", "Transport"]

#: The types of a CUDA IPC handle's primitives, in ``UntypedStorage._share_cuda_()``'s order.
_SHARE = (int, bytes, int, int, bytes, int, bytes, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudaIpcDescriptor(Descriptor):
    """A CUDA buffer of the trainer's, by its IPC handle's primitives (ints and bytes, never pickle)."""

    transport: str = "cuda_ipc"
    gpu_uuid: str
    """The physical GPU the buffer lives on (a worker on another GPU refuses it)."""
    tensor_offset: int
    """The buffer's offset in its storage."""
    share: list[Any]
    """``(device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        fix = "send the descriptor the cuda_ipc transport's send made"
        self.require("gpu_uuid", isinstance(self.gpu_uuid, str), "a string", fix)
        self.require("tensor_offset", isinstance(self.tensor_offset, int), "an integer", fix)
        share = self.share
        ok = isinstance(share, (list, tuple)) and len(share) == len(_SHARE)
        self.require(
            "share",
            ok and all(isinstance(v, t) for v, t in zip(share, _SHARE, strict=False)),
            "an 8-item list of a CUDA IPC handle's primitives",
            fix,
        )


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class Transport(WeightTransport):
    """Same-GPU transport through CUDA IPC handles.

    Args:
        device: the CUDA device the buckets are packed on (the engine's workers must be on the same GPU).
    """

    name = "cuda_ipc"
    preferred_bucket_bytes = 256 << 20

    def __init__(self, device: str | torch.device | int = "cuda") -> None:
        if not torch.cuda.is_available():
            raise HotWeightsError("the cuda_ipc transport needs a CUDA GPU; use 'shm' on CPU-only machines")
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8, device=self.device)
        pack_into(buffer, bucket, tensors)
        torch.cuda.current_stream(self.device).synchronize()  # bytes are in place before a worker reads them
        storage = buffer.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()  # type: ignore[no-untyped-call]
        stage(
            CudaIpcDescriptor(
                nbytes=bucket.nbytes,
                gpu_uuid=_gpu_uuid(self.device.index or 0),
                tensor_offset=int(buffer.storage_offset()),
                share=[
                    int(device),
                    bytes(handle),
                    int(size),
                    int(offset),
                    bytes(ref_handle),
                    int(ref_offset),
                    bytes(event_handle),
                    bool(event_sync),
                ],
            )
        )
        del buffer, storage  # torch's IPC ref counting keeps the block until the workers let go


class Receiver(BucketReceiver):
    """Open the trainer's CUDA buffer on this worker's device (must be the same physical GPU)."""

    descriptor = CudaIpcDescriptor

    @classmethod
    def open(
        cls, descriptor: CudaIpcDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None
    ) -> Opened:
        device = torch.cuda.current_device()
        if descriptor.gpu_uuid != _gpu_uuid(device):
            raise ValueError(
                f"bucket lives on GPU {descriptor.gpu_uuid}, this worker runs on {_gpu_uuid(device)}: CUDA IPC "
                "needs the same physical GPU; use the 'collective' transport (NCCL) across GPUs"
            )
        nbytes = descriptor.nbytes
        (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = descriptor.share
        buffer = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor, (max(nbytes, 1),), (1,), descriptor.tensor_offset, torch.UntypedStorage,
            torch.uint8, device, handle, size, offset, False, ref_handle, ref_offset, event_handle, event_sync,
        )  # fmt: skip
        return buffer[:nbytes], buffer
