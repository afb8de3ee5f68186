"""Pickle-free transports, behind one small contract (:class:`WeightTransport`).

Built-ins, each a sibling module with a trainer-side ``WeightTransport`` and an engine-side ``open_bucket``:

- ``shm``: buckets written once into private shared-memory files that the workers map without a copy (same host);
- ``bytes``: raw bucket bytes inside the RPC message (works wherever vLLM's RPC reaches; the fallback);
- ``collective``: a ``torch.distributed`` broadcast from the trainer to the workers (gloo on CPU, NCCL on GPU);
- ``cuda_ipc``: buckets packed on the trainer's GPU, opened by workers on the same GPU through CUDA IPC handles;
- ``ray``: each bucket put into Ray's object store once, fetched by every engine actor (engines in Ray actors);
- ``reference``: the tensors themselves, to a worker in this process (an in-process engine: nothing is copied);
- ``vllm_nccl``: vLLM's own packed NCCL broadcast and receive loop, into the session's staging
  (:mod:`hotweights.vllm.nccl`).

Modules are imported on first use (:class:`~hotweights.core.registry.LazyRegistry`). ``register_transport`` adds
one; a name registered to another module, or unknown, raises.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hotweights.core.errors import HotWeightsError
from hotweights.core.registry import LazyRegistry
from hotweights.transports.transport import Descriptor, EngineLink, Stage, WeightTransport

__all__ = [
    "Descriptor",
    "EngineLink",
    "Stage",
    "WeightTransport",
    "available_transports",
    "engine_side",
    "make_transport",
    "register_transport",
]

#: Transport name -> its module (imported on first use).
_REGISTRY = LazyRegistry("transport")


def register_transport(name: str, module: str) -> None:
    """Register a transport module (``module`` defines ``Transport`` and ``open_bucket``) under ``name``.

    Raises:
        ValueError: ``name`` is registered to another module.
    """
    _REGISTRY.register(name, module)


def available_transports() -> list[str]:
    """Names of the registered transports."""
    return _REGISTRY.names()


def _module(name: str) -> ModuleType:
    module: ModuleType = _REGISTRY.load(name)
    return module


def make_transport(name: str, **options: Any) -> WeightTransport:
    """A trainer-side transport by name, e.g. ``make_transport("shm")``."""
    transport = _module(name).Transport(**options)
    assert isinstance(transport, WeightTransport)
    return transport


def engine_side(descriptor: Descriptor) -> Any:
    """The engine-side ``open_bucket`` function for a descriptor."""
    name = descriptor.get("transport") if isinstance(descriptor, dict) else None
    if not isinstance(name, str):
        raise HotWeightsError(f"descriptor has no 'transport' name: keys {sorted(descriptor)}")
    return _module(name).open_bucket


register_transport("shm", "hotweights.transports.shm")
register_transport("bytes", "hotweights.transports.bytes")
register_transport("collective", "hotweights.transports.collective")
register_transport("cuda_ipc", "hotweights.transports.cuda_ipc")
register_transport("ray", "hotweights.transports.object_store")
register_transport("reference", "hotweights.transports.reference")
register_transport("vllm_nccl", "hotweights.vllm.nccl")
