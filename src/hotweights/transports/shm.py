"""Shared-memory transport: the trainer writes each bucket once into a private file in ``/dev/shm``; the workers
map it (copy-on-write, so nothing is copied unless written) and the trainer unlinks it as soon as they have.

Nothing outlives a send: the file is unlinked after ``stage`` returns or raises, and at interpreter exit for a
send interrupted in between. A SIGKILL between create and unlink can leave one bucket-sized file behind; the
names start with ``hotweights-`` and :func:`sweep_stale` removes those of dead processes.

With ``Transport(keep_segments=True)`` the segments outlive the install instead: the trainer and the workers keep
them mapped (the file itself is still unlinked once every worker has mapped it) and the next install writes into
the same pages. That skips the page faults of fresh shared memory on both sides, and holds the segments between
installs, until :meth:`Transport.close`: one per bucket (one update's worth), or a single one when the engine keeps no
view of a bucket after its stage.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import mmap
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.core.buckets import Bucket, byte_views, pack_into
from hotweights.transports.base import Descriptor, EngineLink, Stage, WeightTransport

__all__ = ["SHM_DIR", "Transport", "open_bucket", "release_segments", "sweep_stale"]

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
            if stat.S_ISDIR(st.st_mode):  # a private checkpoint directory (the weights-path adapter)
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _new_file(size: int) -> tuple[str, Path, int]:
    """A new private file of ``size`` bytes in ``SHM_DIR`` (removed at exit unless :func:`_remove` ran): its id,
    path and an open descriptor."""
    sid = uuid.uuid4().hex
    path = SHM_DIR / f"{_PREFIX}{os.getpid()}-{sid}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # private to this user
    _LIVE.add(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        _remove(path)
        raise
    return sid, path, fd


def _new_segment(size: int) -> tuple[str, Path, mmap.mmap]:
    """:func:`_new_file`, mapped here: its id, path and mapping."""
    sid, path, fd = _new_file(size)
    try:
        return sid, path, mmap.mmap(fd, size)
    except BaseException:
        _remove(path)
        raise
    finally:
        os.close(fd)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def _write(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` back to back from offset 0, gathering up to ``IOV_MAX`` of them per system call.

    Measured on the 291-tensor model (15 MB): 10 ms, against 20 ms for mapping the new file and copying each tensor
    into it (the copies fault in every fresh page one by one; the kernel fills them in bulk here).
    """
    offset = 0
    for i in range(0, len(views), _IOV_MAX):
        chunk = views[i : i + _IOV_MAX]
        done = os.pwritev(fd, chunk, offset)
        for view in chunk:  # a short write (tmpfs does not make them, but the call may): the rest one by one
            n = min(done, view.nbytes)
            done -= n
            while n < view.nbytes:
                n += os.pwrite(fd, view[n:], offset + n)
            offset += view.nbytes


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    _LIVE.discard(path)


@dataclass
class _Segment:
    """A kept segment: mapped here (and, once ``shared``, by every worker); its file unlinked once shared."""

    id: str
    path: Path
    mm: mmap.mmap
    shared: bool = False

    def close(self) -> None:
        _remove(self.path)
        with contextlib.suppress(BufferError):  # a tensor still viewing it keeps the pages until it is freed
            self.mm.close()


class Transport(WeightTransport):
    """Same-host transport through shared memory (the default for ``vllm.LLM`` multiprocess engines).

    Args:
        keep_segments: keep the shared memory mapped between installs (here and in the workers) and write the next
            install into the same pages: faster repeated installs, held until :meth:`close`. An install uses one
            segment per bucket (an atomic install keeps every bucket until it commits: one update's worth of shared
            memory), or a single segment for every bucket when the engine keeps no view of a bucket after its
            stage (``EngineLink.releases_buckets_after_stage``: a streaming direct install).
    """

    name = "shm"
    # measured: 16-32 MiB buckets installed ~2x faster than 512 MiB ones (new shm pages are costly to fill at once)
    preferred_bucket_bytes = 32 << 20

    def __init__(self, keep_segments: bool = False) -> None:
        # Segments of senders that died mid-transfer (SIGKILL skips every cleanup) go first; the age margin spares
        # a live sender whose pid this process cannot see (another PID namespace sharing /dev/shm).
        sweep_stale(min_age=60.0)
        self.keep_segments = keep_segments
        self._kept: dict[int, _Segment] = {}  # bucket index (or 0 for all) -> its segment, reused by every install
        self._engine: EngineLink | None = None
        self._one_segment = False

    def connect(self, engine: EngineLink) -> None:
        self._engine = engine
        # An engine that keeps no view of a bucket after its stage lets one segment carry every bucket.
        self._one_segment = bool(getattr(engine, "releases_buckets_after_stage", False))

    def close(self) -> None:
        """Unmap the kept segments here and ask the workers to unmap theirs."""
        kept, self._kept = list(self._kept.values()), {}
        self._forget(kept)
        for seg in kept:
            seg.close()

    def _forget(self, segments: list[_Segment]) -> None:
        if segments and self._engine is not None:
            with contextlib.suppress(Exception):  # best effort: a worker also drops segments of dead trainers
                self._engine.call("hotweights_release_segments", [seg.id for seg in segments])

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self.keep_segments:
            self._send_kept(bucket, tensors, stage)
            return
        _, path, fd = _new_file(max(bucket.nbytes, 1))
        try:
            try:
                views = byte_views(bucket, tensors)
                if views is not None:
                    _write(fd, views)
                    del views
                else:  # a GPU or non-contiguous tensor: copied into a mapping of the file
                    with mmap.mmap(fd, max(bucket.nbytes, 1)) as mm:
                        buffer = torch.frombuffer(mm, dtype=torch.uint8)
                        pack_into(buffer, bucket, dict(tensors))
                        del buffer
            finally:
                os.close(fd)
            stage({"transport": self.name, "path": str(path), "nbytes": bucket.nbytes})
        finally:
            _remove(path)

    def _send_kept(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        # The i-th bucket of every install goes into the i-th segment (or every bucket into one, when the engine
        # holds no view of a bucket after its stage). A new install only starts once the previous one is over
        # (committed, or aborted and its session dropped by the next begin), so the pages are free to rewrite.
        size = max(bucket.nbytes, 1)
        slot = 0 if self._one_segment else bucket.index
        seg = self._kept.get(slot)
        if seg is not None and len(seg.mm) < size:
            self._drop(slot)
            seg = None
        if seg is None:
            seg = self._kept[slot] = self._create(size)
        buffer = torch.frombuffer(seg.mm, dtype=torch.uint8, count=size)
        pack_into(buffer, bucket, dict(tensors))
        del buffer
        try:
            stage({"transport": self.name, "path": str(seg.path), "nbytes": bucket.nbytes, "segment": seg.id})
        except BaseException:
            self._drop(slot)  # a worker may or may not have mapped it: start afresh next time
            raise
        if not seg.shared:
            seg.shared = True
            _remove(seg.path)  # every worker mapped it; the mappings keep the pages

    def _create(self, size: int) -> _Segment:
        return _Segment(*_new_segment(size))

    def _drop(self, index: int) -> None:
        seg = self._kept.pop(index)
        self._forget([seg])
        seg.close()


_SEGMENT_ID = re.compile(r"[0-9a-f]{32}")
#: The names :func:`_new_segment` gives (``hotweights-<pid>-<uuid4 hex>``): the only files a worker maps.
_SEGMENT_NAME = re.compile(rf"{_PREFIX}[0-9]+-[0-9a-f]{{32}}")


def _open_segment(path: Path, flags: int) -> int:
    """A descriptor of the regular file ``path``, never through a symlink (``O_NOFOLLOW``) and without blocking on
    a FIFO (``O_NONBLOCK``); anything else (a directory, a device, a socket) is refused."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            what = "a symbolic link" if exc.errno == errno.ELOOP else "a directory"
            raise ValueError(f"refusing to map {path}: {what}, not a hotweights segment") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"refusing to map {path}: not a regular file")
    return fd


def _kept_segments(worker: Any) -> dict[str, tuple[int | None, mmap.mmap]]:
    """This worker's kept segments: id -> (trainer pid if this process can see it, mapping)."""
    segments: dict[str, tuple[int | None, mmap.mmap]] | None = getattr(worker, "_hotweights_shm_segments", None)
    if segments is None:
        segments = {}
        worker._hotweights_shm_segments = segments
    return segments


def release_segments(worker: Any, ids: list[str] | None = None) -> int:
    """Unmap the kept segments ``ids`` (all when None) and those of trainers that are gone; returns how many."""
    segments = _kept_segments(worker)

    def gone(pid: int | None) -> bool:  # a trainer in another PID namespace is never seen, so never presumed gone
        return pid is not None and not Path(f"/proc/{pid}").exists()

    drop = [s for s, (pid, _) in segments.items() if ids is None or s in ids or gone(pid)]
    for sid in drop:
        _, mm = segments.pop(sid)
        with contextlib.suppress(BufferError):  # a staged tensor still viewing it keeps the pages until freed
            mm.close()
    return len(drop)


def _open_kept(descriptor: Descriptor, path: Path, nbytes: int, worker: Any) -> tuple[torch.Tensor, Any]:
    sid = str(descriptor["segment"])
    if not _SEGMENT_ID.fullmatch(sid) or not path.name.endswith(f"-{sid}"):
        raise ValueError(f"refusing segment {sid!r}: not the id in {path.name}")
    segments = _kept_segments(worker)
    if sid not in segments:
        release_segments(worker, [])  # drop segments of trainers that are gone before mapping a new one
        fd = _open_segment(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)  # shared: the trainer's next writes are seen here
        finally:
            os.close(fd)
        pid = int(path.name[len(_PREFIX) :].split("-", 1)[0])
        segments[sid] = (pid if Path(f"/proc/{pid}").exists() else None, mm)
    mm = segments[sid][1]
    if len(mm) < nbytes:
        raise ValueError(f"segment {sid} holds {len(mm)} bytes, the bucket needs {nbytes}")
    buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer, mm


def open_bucket(descriptor: Descriptor, worker: Any = None) -> tuple[torch.Tensor, Any]:
    """Map a bucket file copy-on-write; the mapping stays valid after the trainer unlinks the file.

    A descriptor with a ``"segment"`` id is a kept segment: mapped shared the first time, kept on ``worker`` and
    reused by later installs (see :class:`Transport`'s ``keep_segments``).
    """
    path = Path(str(descriptor["path"]))
    nbytes = int(descriptor["nbytes"])
    if path.parent != SHM_DIR or not _SEGMENT_NAME.fullmatch(path.name):
        raise ValueError(f"refusing to map {path}: not a hotweights segment in {SHM_DIR}")
    path = SHM_DIR / path.name
    if "segment" in descriptor:
        if worker is None:
            raise ValueError("a kept shm segment needs a worker to keep its mapping on")
        return _open_kept(descriptor, path, nbytes, worker)
    fd = _open_segment(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, the bucket needs {nbytes}")
        mm = mmap.mmap(fd, max(nbytes, 1), access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer, mm
