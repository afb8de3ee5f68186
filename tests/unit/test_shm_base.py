"""The trainer's delta base in shared memory, mapped by workers (``hotweights.transports.shm_base``), without vLLM."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
import torch

from hotweights.core import envelope
from hotweights.core.delta import DeltaBase
from hotweights.core.errors import DeltaBaseMismatchError
from hotweights.transports import shm_files
from hotweights.transports.shm_base import SharedDeltaBase, map_base
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension
from hotweights.vllm.worker.session import SessionOptions, session_of


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def test_workers_read_the_trainers_copy_and_see_it_move_only_at_commit() -> None:
    tensors = _tensors()
    base = SharedDeltaBase.capture(tensors, 4)
    try:
        assert base.path.parent == shm_files.SHM_DIR and oct(base.path.stat().st_mode & 0o777) == "0o600"
        one, two = map_base(base.descriptor()), map_base(json.loads(json.dumps(base.descriptor())))
        for mapped in (one, two):
            assert mapped.version == 4
            for name, t in tensors.items():
                assert torch.equal(mapped.tensors[name], t), name
        new = base.encode({**tensors, "a.weight": tensors["a.weight"] + 1}, weight_version=5)
        staged = base.staged(new)
        assert one.version == 4 and torch.equal(one.tensors["a.weight"], tensors["a.weight"])  # not yet committed
        base.commit(staged)
        assert (one.version, two.version, base.version) == (5, 5, 5)
        assert torch.equal(two.tensors["a.weight"], tensors["a.weight"] + 1)  # one copy: written once, seen by all
        assert isinstance(one.base(), DeltaBase) and one.base().version == 5
    finally:
        path = base.path
        base.close()
    assert not path.exists()


def test_a_dropped_base_removes_its_file() -> None:
    base = SharedDeltaBase.capture(_tensors(), 1)
    path = base.path
    del base
    gc.collect()
    assert not path.exists()


@pytest.mark.parametrize(
    "change",
    [
        {"path": "/tmp/not-ours"},
        {"path": str(shm_files.SHM_DIR / "hotweights-1-nothex")},
        {"layout": None},
        {"layout": [["a.weight", 0, [16, 8], "torch.float32"]]},  # over the header
        {"layout": [["a.weight", 64, [1 << 20, 8], "torch.float32"]]},  # past the end of the file
        {"layout": [["a.weight", 64, [-1, 8], "torch.float32"]]},
    ],
)
def test_a_descriptor_that_does_not_fit_is_refused(change: dict[str, Any]) -> None:
    base = SharedDeltaBase.capture(_tensors(), 1)
    try:
        with pytest.raises(ValueError):
            map_base({**base.descriptor(), **change})
    finally:
        base.close()


def test_a_worker_refuses_a_delta_when_it_did_not_install_the_base() -> None:
    """The shared copy holds v1, but this worker's last complete install was something else (another trainer's):
    the delta is refused before anything is staged."""
    tensors = {"w": torch.zeros(4)}
    base = SharedDeltaBase.capture(tensors, 1)
    worker = HotWeightsWorkerExtension()
    try:
        new = base.encode({"w": torch.ones(4)}, weight_version=2)
        wire = new.manifest.wire_manifest()
        options = SessionOptions(
            manifest=wire.to_json() if wire is not None else "",
            delta=new.manifest.to_json(),
            method="reload",
            shared_base=base.descriptor(),
        )
        with pytest.raises(DeltaBaseMismatchError) as info:
            worker.hotweights_begin(options.model_dump_json())
        assert (info.value.requested, info.value.base, info.value.serving) == (2, 1, "a version it did not install")
        session_of(worker).base.served = 9  # e.g. another trainer installed v9 since
        with pytest.raises(DeltaBaseMismatchError) as info:
            worker.hotweights_begin(options.model_dump_json())
        assert (info.value.requested, info.value.base, info.value.serving) == (2, 1, "v9")
        typed = envelope.decode(str(info.value))  # as a multiprocess engine's trainer receives it: text
        assert isinstance(typed, DeltaBaseMismatchError)
        assert (typed.requested, typed.base, typed.serving) == (2, 1, "v9")
        session_of(worker).base.served = 1
        assert worker.hotweights_begin(options.model_dump_json())["ok"] is True
        status = worker.hotweights_engine("status")
        assert status["delta_copy_bytes"] == 0 and status["delta_shared_base"] == str(base.path)
        assert worker.hotweights_engine("forget_base") is True
        assert worker.hotweights_engine("status")["delta_shared_base"] == ""
    finally:
        worker.hotweights_abort()
        base.close()
    assert not base.path.exists()
