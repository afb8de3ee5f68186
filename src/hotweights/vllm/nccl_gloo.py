"""vLLM's NCCL weight-transfer code run over gloo, on a machine without an accelerator (:func:`nccl_transfer_as`)."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import torch

from hotweights.core.errors import EngineNotSupportedError

__all__ = ["nccl_transfer_as"]


# ---------------------------------------------------------------------------------------------- vLLM's NCCL engine
# vLLM's dense NCCL weight-transfer code (nccl_common, nccl_engine, packed_tensor; the same calls in 0.31-0.34) makes
# its communicator in one function, ``nccl_common.stateless_init_process_group(address, port, rank, world, device)``,
# and reaches CUDA in two more: ``torch.accelerator.current_device_index()`` and ``packed_tensor._get_streams``.
# ``nccl_transfer_as("gloo")`` replaces those three, and only while the call runs: vLLM's packed broadcast, unpacking
# and receive loop then run as they are over gloo on a CPU machine (the nearest analogue of NCCL this suite has).
_GLOO_LOCK = threading.Lock()
_GLOO_USERS = 0
_GLOO_SAVED: list[tuple[Any, str, Any]] = []


class _GlooCommunicator:
    """The part of vLLM's ``PyNcclCommunicator`` its weight-transfer code uses, over a gloo group."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float = 60.0) -> None:
        from hotweights.transports.collective import create_group

        td = datetime.timedelta(seconds=timeout)
        dist: Any = torch.distributed
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=td, wait_for_workers=False)
        self.group = create_group(host, port, rank, world_size, "gloo", timeout, store=store)
        self._store = store

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.group.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        self.group = self._store = None


class _NoStream:
    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def nccl_transfer_as(backend: str) -> Iterator[None]:
    """Run vLLM's NCCL weight-transfer code over ``backend``: ``"nccl"`` as vLLM ships it, ``"gloo"`` on a machine
    without an accelerator (see above; every thread inside shares the one replacement, restored when the last
    leaves)."""
    global _GLOO_USERS
    if backend == "nccl":
        yield
        return
    if backend != "gloo" or torch.accelerator.is_available():
        raise EngineNotSupportedError(
            f"vLLM's NCCL transfer runs over 'nccl', or over 'gloo' only on a machine without an accelerator "
            f"(asked: {backend!r}); use backend='nccl' on a GPU"
        )
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    with _GLOO_LOCK:
        if _GLOO_USERS == 0:
            swaps = (
                (nccl_common, "stateless_init_process_group", _gloo_group),
                (packed_tensor, "_get_streams", lambda index, n: tuple(_NoStream() for _ in range(n))),
                (torch.accelerator, "current_device_index", lambda: 0),
            )
            for owner, name, value in swaps:
                _GLOO_SAVED.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)
        _GLOO_USERS += 1
    try:
        yield
    finally:
        with _GLOO_LOCK:
            _GLOO_USERS -= 1
            if _GLOO_USERS == 0:
                while _GLOO_SAVED:
                    owner, name, value = _GLOO_SAVED.pop()
                    setattr(owner, name, value)


def _gloo_group(master_address: str, master_port: int, rank: int, world_size: int, device: Any = None) -> Any:
    return _GlooCommunicator(master_address, master_port, rank, world_size)
