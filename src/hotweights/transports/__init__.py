"""Pickle-free transports, behind one small contract (:mod:`hotweights.transports.transport`).

Built-ins, each a sibling module with a trainer-side ``Transport``, its descriptor type and an engine-side
``Receiver``:

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

from hotweights.core.registry import LazyRegistry
from hotweights.transports.transport import (
    BucketReceiver,
    Descriptor,
    EngineLink,
    MalformedDescriptorError,
    Opened,
    Stage,
    WeightTransport,
    wire_of,
)

__all__ = [
    "BucketReceiver",
    "Descriptor",
    "EngineLink",
    "MalformedDescriptorError",
    "Opened",
    "Stage",
    "WeightTransport",
    "available_transports",
    "make_transport",
    "parse_descriptor",
    "receiver_for",
    "register_transport",
    "transport_type",
    "wire_of",
]

#: Transport name -> its module (imported on first use).
_REGISTRY = LazyRegistry("transport")


def register_transport(name: str, module: str) -> None:
    """Register a transport module under ``name``: it defines ``Receiver`` (the engine side, a
    :class:`BucketReceiver`) and, unless only the engine side lives in hotweights, ``Transport`` (a
    :class:`WeightTransport`).

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


def transport_type(name: str) -> type[WeightTransport]:
    """The trainer-side class of the transport ``name``, to read what it declares before building one (e.g.
    :attr:`~WeightTransport.hosts_group`).

    Raises:
        HotWeightsError: no transport of that name is registered (the message lists those that are).
    """
    kind: type[WeightTransport] = _module(name).Transport
    return kind


def make_transport(name: str, **options: Any) -> WeightTransport:
    """A trainer-side transport by name, e.g. ``make_transport("shm")``."""
    transport = transport_type(name)(**options)
    assert isinstance(transport, WeightTransport)
    return transport


def receiver_for(name: str) -> type[BucketReceiver]:
    """The engine side of the transport ``name``.

    Raises:
        HotWeightsError: no transport of that name is registered (the message lists those that are).
    """
    receiver: type[BucketReceiver] = _module(name).Receiver
    return receiver


def parse_descriptor(wire: object) -> Descriptor:
    """The typed descriptor of a wire form (a typed one is returned as it is): parsed by the descriptor type of the
    transport its ``"transport"`` key names.

    Raises:
        MalformedDescriptorError: no transport name, or a field missing or of the wrong type.
        HotWeightsError: an unknown transport name.
    """
    if isinstance(wire, Descriptor):
        return wire
    name = wire.get("transport") if isinstance(wire, dict) else None
    if not isinstance(name, str):
        keys = sorted(map(str, wire)) if isinstance(wire, dict) else type(wire).__name__
        raise MalformedDescriptorError(
            f"descriptor has no 'transport' name: keys {keys}; send the descriptor a transport's send made"
        )
    return receiver_for(name).parse(wire)


register_transport("shm", "hotweights.transports.shm")
register_transport("bytes", "hotweights.transports.bytes")
register_transport("collective", "hotweights.transports.collective")
register_transport("cuda_ipc", "hotweights.transports.cuda_ipc")
register_transport("ray", "hotweights.transports.object_store")
register_transport("reference", "hotweights.transports.reference")
register_transport("vllm_nccl", "hotweights.vllm.nccl")
