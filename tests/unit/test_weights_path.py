"""The weights-path adapter's host side: what it writes for vLLM's loader, and a dead trainer's directory swept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from hotweights.adapters.weights_path import _write_safetensors
from hotweights.core.cast import CastItems
from hotweights.transports.shm_files import SHM_DIR, sweep_stale


def test_the_checkpoint_written_is_what_safetensors_and_vllm_read(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    items = [("w.t", base.t()), ("a", base), ("b", base), ("h", base.to(torch.bfloat16)), ("e", torch.zeros(0))]
    _write_safetensors(tmp_path / "model.safetensors", items)  # a transposed view, two names on one storage
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(loaded) == sorted(n for n, _ in items)
    for name, tensor in items:
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_a_cast_update_is_written_in_the_engine_dtype_one_tensor_at_a_time(tmp_path: Path) -> None:
    tensors = [("w", torch.randn(8, 8)), ("ids", torch.arange(4))]
    _write_safetensors(tmp_path / "model.safetensors", CastItems(tensors, {"w": torch.bfloat16}))
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert loaded["w"].dtype == torch.bfloat16 and torch.equal(loaded["w"], tensors[0][1].to(torch.bfloat16))
    assert torch.equal(loaded["ids"], tensors[1][1])


def test_a_dead_trainers_checkpoint_directory_is_swept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    directory = SHM_DIR / f"hotweights-{pid}-ckpt-test"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"x")
    os.utime(directory, (0, 0))
    mine = SHM_DIR / f"hotweights-{os.getpid()}-ckpt-test"  # a live process's: kept
    mine.mkdir()
    try:
        removed = sweep_stale(min_age=60.0)
        assert directory in removed and not directory.exists()
        assert mine.exists()
    finally:
        mine.rmdir()
