"""Collective transport: buckets broadcast from the trainer (rank 0) to the engine's workers (ranks 1..N) over a
``torch.distributed`` process group of their own — gloo on CPU, NCCL on GPU, through the same code.

The group is separate from vLLM's own (built from a ``TCPStore`` + backend directly, not
``init_process_group``), bound to loopback by default, and every wait has a timeout. Re-connecting (e.g. a trainer
that crashed and came back) replaces the workers' stale group first.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed

from hotweights.core.buckets import Bucket, pack_into
from hotweights.core.errors import HotWeightsError, HotWeightsTimeoutError
from hotweights.transports.base import Descriptor, EngineLink, Stage, WeightTransport

__all__ = ["Transport", "close_group", "create_group", "open_bucket"]

_GROUP_ATTR = "_hotweights_group"
# torch's stubs do not export the store and backend classes used here (TCPStore, PrefixStore, ProcessGroupGloo).
dist: Any = torch.distributed


def create_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout: float, store: Any = None
) -> Any:
    """A process group of ``world_size`` ranks rendezvousing at ``host:port`` (rank 0 hosts the store)."""
    td = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=td, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"hotweights/{port}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = td
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl_opts)
    raise HotWeightsError(f"unknown collective backend {backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")


def _run_with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run ``fn`` in a thread; raise :class:`HotWeightsTimeoutError` naming ``what`` if it does not finish."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"hotweights-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise HotWeightsTimeoutError(f"waited {timeout} s for {what}; raise the transport's timeout if it is slow")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class Transport(WeightTransport):
    """Broadcast buckets over a dedicated process group.

    Args:
        host: address the trainer's rendezvous store binds to (loopback by default; set the trainer host's
            address when the engine runs elsewhere).
        port: store port (0: pick a free one).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout: seconds for the rendezvous and for each broadcast.
        device: where buckets are packed (``"cpu"`` for gloo, a CUDA device for NCCL).
    """

    name = "collective"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        timeout: float = 60.0,
        device: str | torch.device = "cpu",
    ) -> None:
        self.host, self.port, self.backend, self.timeout = host, port, backend, timeout
        self.device = torch.device(device)
        self._engine: EngineLink | None = None
        self._store: Any = None
        self._group: Any = None

    def connect(self, engine: EngineLink) -> None:
        """Rendezvous with every engine worker; the trainer is rank 0."""
        self.close()
        world = 1 + engine.num_workers
        td = datetime.timedelta(seconds=self.timeout)
        # TCPStore alone listens on every interface whatever its host: hand it a socket bound to ``host`` (it takes
        # ownership of the descriptor and closes it with the store).
        listener = socket.create_server((self.host, self.port), backlog=64)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            self.host, port, world, is_master=True, timeout=td, wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )  # fmt: skip
        init = threading.Thread(
            target=lambda: engine.call(
                "hotweights_init_communicator", self.host, port, world, self.backend, self.timeout
            ),
            daemon=True,
        )
        init.start()
        what = f"rendezvous with {engine.num_workers} engine worker(s) at {self.host}:{port}"
        self._group = _run_with_timeout(
            lambda: create_group(self.host, port, 0, world, self.backend, self.timeout, store=self._store),
            self.timeout,
            what,
        )
        init.join(self.timeout)
        self._engine = engine

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self._group is None:
            raise HotWeightsError("collective transport is not connected; the adapter calls connect(engine) first")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        pack_into(buffer, bucket, dict(tensors))
        staged = threading.Thread(target=lambda: stage({"transport": self.name, "nbytes": bucket.nbytes}), daemon=True)
        staged.start()
        _run_with_timeout(
            lambda: self._group.broadcast(buffer, 0).wait(), self.timeout, f"broadcast of bucket {bucket.index}"
        )
        staged.join(self.timeout)
        if staged.is_alive():
            raise HotWeightsTimeoutError(f"waited {self.timeout} s for the workers to stage bucket {bucket.index}")

    def close(self) -> None:
        """Drop the group on both sides."""
        if self._engine is not None:
            try:
                self._engine.call("hotweights_close_communicator")
            finally:
                self._engine = None
        self._group = None
        self._store = None


# ---------------------------------------------------------------------------------------------- engine side
def init_worker_group(worker: Any, host: str, port: int, world_size: int, backend: str, timeout: float) -> None:
    """Worker side of :meth:`Transport.connect`: replaces any stale group, joins as rank 1 + worker rank."""
    close_group(worker)
    rank = 1 + int(getattr(worker, "rank", 0))
    setattr(worker, _GROUP_ATTR, (create_group(host, port, rank, world_size, backend, timeout), backend))


def close_group(worker: Any) -> bool:
    """Drop the worker's group, if any."""
    had = getattr(worker, _GROUP_ATTR, None) is not None
    setattr(worker, _GROUP_ATTR, None)
    return had


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    """Receive one bucket from the trainer's broadcast into a fresh buffer."""
    entry = getattr(worker, _GROUP_ATTR, None)
    if entry is None:
        raise RuntimeError("no hotweights communicator on this worker; the trainer must connect the transport first")
    group, backend = entry
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buffer = torch.empty(int(descriptor["nbytes"]), dtype=torch.uint8, device=device)
    group.broadcast(buffer, 0).wait()
    return buffer, None
