"""By reference: the tensors themselves go to a worker in this process; nothing is packed, copied or serialised.

The transport of an engine whose worker runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Its
descriptor holds the caller's tensors, so it never leaves the process: the in-process wire hands it to the worker
session's ``stage_tensors``, and :func:`open_bucket` refuses it anywhere else.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from hotweights.core.buckets import Bucket
from hotweights.core.cast import items_of
from hotweights.transports.transport import Descriptor, Stage, WeightTransport

__all__ = ["Transport", "open_bucket"]


class Transport(WeightTransport):
    """The whole update as one bucket, handed over by reference."""

    name = "reference"
    by_reference = True
    preferred_bucket_bytes = sys.maxsize  # one bucket: nothing is packed, so nothing is gained by cutting

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        stage({"transport": self.name, "nbytes": bucket.nbytes, "items": items_of(tensors)})


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    raise ValueError(
        "a 'reference' descriptor holds tensors of the trainer's process and is staged by reference there; it "
        "cannot be opened by a worker of another process"
    )
