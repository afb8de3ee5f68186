"""Bytes transport: a bucket's raw bytes travel inside the RPC message (the "HTTP load" idea, no pickle).

Works wherever vLLM's RPC reaches, at the cost of the copies vLLM's message path makes; the fallback transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket, pack_into
from hotweights.transports.transport import Descriptor, Stage, WeightTransport

__all__ = ["Transport", "open_bucket"]


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
        stage({"transport": self.name, "data": data, "nbytes": bucket.nbytes})


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    """A writable buffer over the received bytes, size-checked against the bucket."""
    data = descriptor["data"]
    nbytes = int(descriptor["nbytes"])
    size = memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else None
    if size != nbytes:
        got = size if size is not None else type(data).__name__
        raise ValueError(f"bytes payload has {got} bytes, the bucket declares {nbytes}")
    buf = bytearray(data)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8), buf
