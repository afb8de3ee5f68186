"""By reference: the tensors themselves go to a worker in this process; nothing is packed, copied or serialised.

The transport of an engine whose worker runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Its
descriptor holds the caller's tensors, so it never leaves the process: the in-process wire hands it to the worker
session's ``stage_tensors``, and :class:`Receiver` refuses it anywhere else.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket
from hotweights.core.cast import items_of
from hotweights.transports.transport import BucketReceiver, Descriptor, Opened, Stage, WeightTransport

__all__ = ["Receiver", "ReferenceDescriptor", "Transport"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceDescriptor(Descriptor):
    """The caller's tensors themselves (never leaves the trainer's process)."""

    transport: str = "reference"
    items: Any
    """The update's (name, tensor) pairs, or a lazy cast of them (:func:`~hotweights.core.cast.items_of`)."""


class Transport(WeightTransport):
    """The whole update as one bucket, handed over by reference."""

    name = "reference"
    by_reference = True
    preferred_bucket_bytes = sys.maxsize  # one bucket: nothing is packed, so nothing is gained by cutting

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        stage(ReferenceDescriptor(nbytes=bucket.nbytes, items=items_of(tensors)))


class Receiver(BucketReceiver):
    """Refuses: a reference descriptor is staged by reference, in the trainer's process."""

    descriptor = ReferenceDescriptor

    @classmethod
    def open(
        cls, descriptor: ReferenceDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None
    ) -> Opened:
        raise ValueError(
            "a 'reference' descriptor holds tensors of the trainer's process and is staged by reference there; it "
            "cannot be opened by a worker of another process"
        )
