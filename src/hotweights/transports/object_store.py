"""Ray transport: each bucket goes into Ray's object store once; every engine actor fetches it (zero-copy on its
own node, moved between nodes by Ray).

Trainer side only: the descriptor carries the bucket's ``ObjectRef``, which Ray passes to the actor as a reference
(never resolved on the way); the actor (:class:`hotweights.integrations.ray.EngineActor`) fetches it and hands the
bytes to its engine's workers through a transport of its own host. The object is freed once the last reference
goes: when the send returns, or with the trainer's process (Ray's ownership), so a dead trainer leaves nothing in
the object store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket, pack_into
from hotweights.transports.transport import Descriptor, Stage, WeightTransport

__all__ = ["Transport", "open_bucket"]


class Transport(WeightTransport):
    """One object-store copy per bucket, for every engine actor that stages it."""

    name = "ray"
    preferred_bucket_bytes = 64 << 20
    shareable = True  # one ObjectRef, fetched by every actor

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        import numpy as np
        import ray

        data = np.empty(bucket.nbytes, dtype=np.uint8)
        if bucket.nbytes:
            pack_into(torch.from_numpy(data), bucket, tensors)
        ref = ray.put(data)
        del data  # the object store holds the bytes now
        try:
            stage({"transport": self.name, "ref": ref, "nbytes": bucket.nbytes})
        finally:
            del ref  # freed once every actor that fetched it let go


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    """Never called on a worker: the engine actor resolves ``"ray"`` descriptors before its workers see them."""
    raise ValueError(
        "a 'ray' bucket reached an engine worker directly: install into an engine hosted in a Ray actor through "
        "hotweights.integrations.ray.engine(actor), whose actor fetches the bucket first"
    )
