"""The weights-path adapter's host side: what it writes for vLLM's loader, and a dead trainer's directory swept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hotweights.adapters.weights_path import _host_tensors
from hotweights.transports.shm import SHM_DIR, sweep_stale


def test_host_tensors_are_contiguous_cpu_and_never_share_storage(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    items = [("w.t", base.t()), ("a", base), ("b", base)]  # a transposed view, and two names on one storage
    out = _host_tensors(items)
    assert all(t.is_contiguous() for t in out.values())
    assert out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()
    save_file(out, str(tmp_path / "model.safetensors"))  # safetensors refuses shared or strided tensors
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(loaded["w.t"], base.t()) and torch.equal(loaded["b"], base)


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
