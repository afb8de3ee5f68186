"""Bytes transport: a bucket's raw bytes travel inside the RPC message (the "HTTP load" idea, no pickle).

Works wherever vLLM's RPC reaches, at the cost of the copies vLLM's message path makes; the fallback transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket, pack_into
from hotweights.transports.transport import (
    BucketReceiver,
    Descriptor,
    MalformedDescriptorError,
    Opened,
    Stage,
    WeightTransport,
)

__all__ = ["BytesDescriptor", "Receiver", "Transport"]

_BYTES_LIKE = (bytes, bytearray, memoryview)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BytesDescriptor(Descriptor):
    """The bucket's bytes themselves."""

    transport: str = "bytes"
    data: bytes | bytearray | memoryview
    """The packed bucket (msgpack delivers ``bytes``; in this process it may stay a ``bytearray``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.data, _BYTES_LIKE):
            raise _wrong_size(type(self.data).__name__, self.nbytes)


def _wrong_size(got: object, nbytes: int) -> MalformedDescriptorError:
    return MalformedDescriptorError(f"bytes payload has {got} bytes, the bucket declares {nbytes}")


class Transport(WeightTransport):
    """Raw bucket bytes in the RPC message."""

    name = "bytes"
    shareable = True  # packed once, then each engine's RPC carries it
    preferred_bucket_bytes = (
        16 << 20
    )  # under vLLM's ~24 MB shared-memory message ring; larger messages are copied several times on their way

    @property
    def overlaps(self) -> bool:
        return True  # each send packs a buffer of its own

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        data = bytearray(bucket.nbytes)
        if bucket.nbytes:
            pack_into(torch.frombuffer(data, dtype=torch.uint8), bucket, tensors)
        stage(BytesDescriptor(data=data, nbytes=bucket.nbytes))


class Receiver(BucketReceiver):
    """A writable buffer over the received bytes, size-checked against the bucket."""

    descriptor = BytesDescriptor

    @classmethod
    def open(cls, descriptor: BytesDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None) -> Opened:
        nbytes = descriptor.nbytes
        size = memoryview(descriptor.data).nbytes
        if size != nbytes:
            raise _wrong_size(size, nbytes)
        buf = bytearray(descriptor.data)
        empty = torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else empty, buf
