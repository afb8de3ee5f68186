"""Shared-memory transport: the trainer writes each bucket once into a private file in ``/dev/shm``; the workers
map it (copy-on-write, so nothing is copied unless written) and the trainer unlinks it as soon as they have.

Nothing outlives a send: the file is unlinked after ``stage`` returns or raises, and at interpreter exit for a
send interrupted in between. A SIGKILL between create and unlink can leave one bucket-sized file behind; the
names start with ``hotweights-`` and :func:`sweep_stale` removes those of dead processes.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hotweights.core.buckets import Bucket, pack_into
from hotweights.transports.base import Descriptor, Stage, WeightTransport

__all__ = ["SHM_DIR", "Transport", "open_bucket", "sweep_stale"]

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
_PREFIX = "hotweights-"
_LIVE: set[Path] = set()


@atexit.register
def _unlink_live() -> None:
    for path in list(_LIVE):
        path.unlink(missing_ok=True)


def sweep_stale(directory: Path = SHM_DIR, min_age: float = 0.0) -> list[Path]:
    """Remove this user's segments left by dead processes (name ``hotweights-<pid>-...``, pid gone) that are at
    least ``min_age`` seconds old; returns what was removed."""
    removed = []
    now = time.time()
    for path in directory.glob(f"{_PREFIX}*"):
        m = re.match(rf"{_PREFIX}(\d+)-", path.name)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and now - st.st_mtime >= min_age:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class Transport(WeightTransport):
    """Same-host transport through shared memory (the default for ``vllm.LLM`` multiprocess engines)."""

    name = "shm"
    # measured: 16-32 MiB buckets installed ~2x faster than 512 MiB ones (new shm pages are costly to fill at once)
    preferred_bucket_bytes = 32 << 20

    def __init__(self) -> None:
        # Segments of senders that died mid-transfer (SIGKILL skips every cleanup) go first; the age margin spares
        # a live sender whose pid this process cannot see (another PID namespace sharing /dev/shm).
        sweep_stale(min_age=60.0)

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        path = SHM_DIR / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # private to this user
        _LIVE.add(path)
        try:
            size = max(bucket.nbytes, 1)
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as mm:
                buffer = torch.frombuffer(mm, dtype=torch.uint8)
                pack_into(buffer, bucket, dict(tensors))
                del buffer
            os.close(fd)
            fd = -1
            stage({"transport": self.name, "path": str(path), "nbytes": bucket.nbytes})
        finally:
            if fd >= 0:
                os.close(fd)
            path.unlink(missing_ok=True)
            _LIVE.discard(path)


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    """Map a bucket file copy-on-write; the mapping stays valid after the trainer unlinks the file."""
    path = Path(str(descriptor["path"]))
    nbytes = int(descriptor["nbytes"])
    if path.parent != SHM_DIR or not path.name.startswith(_PREFIX):
        raise ValueError(f"refusing to map {path}: not a hotweights segment in {SHM_DIR}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, the bucket needs {nbytes}")
        mm = mmap.mmap(fd, max(nbytes, 1), access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer, mm
