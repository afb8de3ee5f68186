"""Ray transport: each bucket goes into Ray's object store once; every engine actor fetches it (zero-copy on its
own node, moved between nodes by Ray).

Trainer side only: the descriptor carries the bucket's ``ObjectRef``, which Ray passes to the actor as a reference
(never resolved on the way); the actor (:class:`hotweights.integrations.ray.EngineActor`) fetches it and hands the
bytes to its engine's workers through a transport of its own host. The object is freed once the last reference
goes: when the send returns, or with the trainer's process (Ray's ownership), so a dead trainer leaves nothing in
the object store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket, pack_into
from hotweights.transports.transport import BucketReceiver, Descriptor, Opened, Stage, WeightTransport

__all__ = ["ObjectStoreDescriptor", "Receiver", "Transport"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectStoreDescriptor(Descriptor):
    """A bucket in Ray's object store (Ray carries the reference to the engine actor)."""

    transport: str = "ray"
    ref: Any
    """The bucket's ``ray.ObjectRef``."""


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
            stage(ObjectStoreDescriptor(ref=ref, nbytes=bucket.nbytes))
        finally:
            del ref  # freed once every actor that fetched it let go


class Receiver(BucketReceiver):
    """Refuses: the engine actor resolves ``"ray"`` descriptors before its workers see them."""

    descriptor = ObjectStoreDescriptor

    @classmethod
    def open(
        cls, descriptor: ObjectStoreDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None
    ) -> Opened:
        raise ValueError(
            "a 'ray' bucket reached an engine worker directly: install into an engine hosted in a Ray actor through "
            "hotweights.integrations.ray.engine(actor), whose actor fetches the bucket first"
        )
