"""Typed descriptors: each transport's round-trips through its plain wire form (JSON or msgpack, never pickle), and a
malformed one is refused where a worker receives it, typed and naming the field, before anything is staged."""

from __future__ import annotations

import json
import os
from typing import Any
from unittest import mock

import msgpack
import msgspec
import pytest
import torch

from hotweights.core.buckets import plan_buckets
from hotweights.core.errors import InstallError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import (
    Descriptor,
    MalformedDescriptorError,
    make_transport,
    parse_descriptor,
    receiver_for,
)
from hotweights.transports.bytes import BytesDescriptor
from hotweights.transports.collective import CollectiveDescriptor
from hotweights.transports.cuda_ipc import CudaIpcDescriptor
from hotweights.transports.shm import ShmDescriptor
from hotweights.vllm.nccl import VllmNcclDescriptor
from hotweights.vllm.worker.staging import StagingArea

BUILT_INS = ("shm", "bytes", "collective", "cuda_ipc", "ray", "reference", "vllm_nccl")
#: One well-formed descriptor per transport whose wire form crosses a process.
PLAIN = [
    BytesDescriptor(data=b"\x01\x02\x03\x04", nbytes=4),
    ShmDescriptor(path="/dev/shm/hotweights-1-" + "0" * 32, nbytes=8),
    ShmDescriptor(path="/dev/shm/hotweights-1-" + "a" * 32, nbytes=8, segment="a" * 32),
    CollectiveDescriptor(nbytes=16),
    VllmNcclDescriptor(nbytes=16),
    CudaIpcDescriptor(nbytes=4, gpu_uuid="GPU-1", tensor_offset=0, share=[0, b"h", 4, 0, b"r", 0, b"e", True]),
]


@pytest.mark.parametrize("typed", PLAIN, ids=lambda d: f"{d.transport}")
def test_the_wire_form_is_plain_msgpack_and_parses_back(typed: Descriptor) -> None:
    wire = typed.to_wire()
    assert wire["transport"] == typed.transport and wire["nbytes"] == typed.nbytes
    received = msgpack.unpackb(msgpack.packb(wire), raw=False)  # what vLLM's RPC does to it: no pickle
    assert parse_descriptor(received) == typed
    assert type(parse_descriptor(received)) is type(typed)


@pytest.mark.parametrize("typed", PLAIN, ids=lambda d: f"{d.transport}")
def test_a_typed_descriptor_handed_to_vllms_rpc_as_it_is_still_names_its_transport(typed: Descriptor) -> None:
    """vLLM's ``collective_rpc`` encodes its arguments with msgspec, which writes a dataclass as its fields: a
    descriptor passed to it by hand (``update_weights``' ``update_info``) parses back on the worker."""
    assert parse_descriptor(msgspec.msgpack.decode(msgspec.msgpack.encode(typed))) == typed


def test_json_carries_the_descriptors_without_bytes() -> None:
    for typed in (ShmDescriptor(path="/dev/shm/hotweights-1-" + "0" * 32, nbytes=8), CollectiveDescriptor(nbytes=2)):
        assert parse_descriptor(json.loads(json.dumps(typed.to_wire()))) == typed


def test_an_optional_field_crosses_only_when_set() -> None:
    assert set(ShmDescriptor(path="p", nbytes=0).to_wire()) == {"transport", "path", "nbytes"}
    assert ShmDescriptor(path="p", nbytes=0, segment="s").to_wire()["segment"] == "s"


def test_a_typed_descriptor_passes_as_it_is() -> None:
    typed = CollectiveDescriptor(nbytes=3)
    assert parse_descriptor(typed) is typed
    assert receiver_for("collective").parse(typed) is typed


def test_every_built_in_transport_has_an_engine_side_with_its_descriptor_type() -> None:
    for name in BUILT_INS:
        receiver = receiver_for(name)
        assert issubclass(receiver.descriptor, Descriptor)
        assert receiver.descriptor.transport == name


def test_the_transports_stage_their_own_typed_descriptors() -> None:
    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    bucket = plan_buckets(WeightUpdateManifest.from_state_dict(tensors, weight_version=1))[0]
    for name in ("bytes", "shm", "reference"):
        staged: list[Any] = []
        with make_transport(name) as transport:
            transport.send(bucket, tensors, staged.append)
        (typed,) = staged
        assert type(typed) is receiver_for(name).descriptor and typed.nbytes == bucket.nbytes


@pytest.mark.parametrize(
    ("wire", "names"),
    [
        ({"transport": "shm", "nbytes": 8}, ["shm", "path"]),  # a field missing
        ({"transport": "shm", "path": 5, "nbytes": 8}, ["shm", "path", "a string"]),  # a field of the wrong type
        ({"transport": "shm", "path": "p", "nbytes": 8, "segment": 3}, ["segment"]),
        ({"transport": "collective", "nbytes": -1}, ["collective", "non-negative integer 'nbytes'"]),
        ({"transport": "collective", "nbytes": True}, ["non-negative integer 'nbytes'"]),
        ({"transport": "cuda_ipc", "nbytes": 4, "gpu_uuid": "x", "tensor_offset": 0, "share": []}, ["share"]),
        ({"transport": "bytes", "nbytes": 4, "data": "abcd"}, ["bytes payload has str bytes"]),
        ({"transport": 3, "nbytes": 4}, ["no 'transport' name"]),
        ("shm", ["no 'transport' name"]),
    ],
)
def test_a_malformed_descriptor_is_refused_typed_naming_the_field(wire: Any, names: list[str]) -> None:
    with pytest.raises(MalformedDescriptorError) as info:
        parse_descriptor(wire)
    for name in names:
        assert name in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InstallError)  # a refusal, either way caught


def test_a_descriptor_for_another_transport_is_refused() -> None:
    with pytest.raises(MalformedDescriptorError, match="for transport 'shm', not 'bytes'"):
        ShmDescriptor.from_wire({"transport": "bytes", "path": "p", "nbytes": 1})


@pytest.mark.parametrize(
    "wire",
    [
        {"transport": "shm", "path": 7, "nbytes": 16},
        {"transport": "shm", "nbytes": 16},
        {"transport": "bytes", "nbytes": 16, "data": None},
        {"transport": "collective", "nbytes": 16, "extra": 1, "segment": 2},  # a collective stage with no group
        {"nbytes": 16, "data": b"x" * 16},
    ],
)
def test_staging_a_malformed_descriptor_stages_nothing(wire: dict[str, Any]) -> None:
    """Refused where the worker receives it: no file opened, nothing kept, the session as it was (the next bucket
    still stages)."""
    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    bucket = plan_buckets(manifest)[0]
    area = StagingArea(owner=object())
    area.begin(manifest, check=False)
    real_open = os.open
    opened: list[Any] = []
    with (
        mock.patch("os.open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)),
        pytest.raises((MalformedDescriptorError, ValueError)) as info,
    ):
        area.stage(manifest.update_id, bucket.model_dump_json(), wire)
    if "transport" in wire and wire["transport"] != "collective":
        assert isinstance(info.value, MalformedDescriptorError)
    session = area.session
    assert session is not None and not session.received and not session.staged and not session.keepalive
    assert session.nbytes == 0 and opened == []
    with make_transport("bytes") as transport:  # the same bucket, well formed, still stages
        transport.send(bucket, tensors, lambda d: area.stage(manifest.update_id, bucket.model_dump_json(), d.to_wire()))
    assert session.received == {"w"}
