"""Shared-memory transport: the trainer writes each bucket into a private file in ``/dev/shm``; the workers map it
(copy-on-write, so nothing is copied unless written) for the install.

By default the files of an install's first buckets (up to ``REUSE_BUDGET``, 1 GiB) are kept and rewritten by the
next install: rewriting pages is 2-3x faster than having the kernel allocate fresh ones. The workers hold nothing
between installs. Every other file is unlinked as soon as the workers staged it. Kept files go at
:meth:`Transport.close`, when the engine the transport is connected to shuts down (where the engine link offers
``on_shutdown``), when the transport is garbage-collected, and at exit.

The files themselves (their names, creation, the creator's lock, the workers' checks before they map one, and the
sweep of a dead trainer's files) are :mod:`hotweights.transports.shm_files`'; every new :class:`Transport` sweeps
first.

With ``Transport(keep_segments=True)`` every bucket's shared memory stays mapped, here and in the workers (the file
itself is unlinked once every worker has mapped it), and the next install writes into the same pages: no page
faults on either side, and the segments are held until :meth:`Transport.close`: one per bucket (one update's
worth), or a single one when the engine keeps no view of a bucket after its stage.

The engine side, :class:`Receiver`, maps the file a :class:`ShmDescriptor` names (only a hotweights file of this
user in ``SHM_DIR``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.core.buckets import Bucket, byte_views, pack_into
from hotweights.transports import shm_files
from hotweights.transports.shm_files import SHM_DIR, sweep_stale
from hotweights.transports.shm_writes import BucketFile, ShmDescriptor, write_views
from hotweights.transports.transport import BucketReceiver, EngineLink, Opened, Stage, WeightTransport

__all__ = ["REUSE_BUDGET", "REUSE_ENV", "Receiver", "ShmDescriptor", "Transport", "published"]

logger = logging.getLogger("hotweights")

_HELD: set[Path] = set()  # the files live transports keep for reuse (of those shm_files removes at exit)
os.register_at_fork(after_in_child=_HELD.clear)  # a forked child keeps none of its parent's files

#: Most bytes of bucket files a default shm transport keeps for reuse (see ``Transport(keep_segments=None)``):
#: 1 GiB, so a model up to that size is rewritten in place by every install (no fresh pages: 612 MB took 0.46 s
#: to write into fresh pages, as long as the rest of the install). ``HOTWEIGHTS_SHM_REUSE_BYTES`` overrides it
#: (``0``: a fresh file per bucket).
REUSE_BUDGET = 1 << 30
#: Environment variable that overrides :data:`REUSE_BUDGET` (bytes).
REUSE_ENV = "HOTWEIGHTS_SHM_REUSE_BYTES"


def _bucket_bytes(preferred: int) -> int:
    """``preferred``, at most an eighth of ``SHM_DIR``'s filesystem: a streaming commit then keeps its few live
    buckets within a small ``/dev/shm``."""
    size = shm_files.shm_bytes()
    return preferred if size is None else min(preferred, size // 8)


def _reuse_budget() -> int:
    """:data:`REUSE_BUDGET` (or ``$HOTWEIGHTS_SHM_REUSE_BYTES``), at most a sixteenth of ``SHM_DIR``'s filesystem
    (Docker's default /dev/shm, 64 MiB: 4 MiB)."""
    budget = REUSE_BUDGET
    text = os.environ.get(REUSE_ENV, "").strip()
    if text:
        try:
            budget = max(0, int(text))
        except ValueError:
            logger.warning("hotweights: %s=%r is not a number of bytes; using %d", REUSE_ENV, text, budget)
    size = shm_files.shm_bytes()
    return 0 if size is None else min(budget, size // 16)


@dataclass
class _File:
    """A bucket file kept for reuse: its path and an open descriptor to rewrite it through."""

    path: Path
    fd: int
    size: int


def _close_files(files: dict[int, _File], index: int | None = None) -> None:
    """Remove the reused files (only the ``index``-th when given)."""
    for i in list(files) if index is None else [index]:
        file = files.pop(i, None)
        if file is not None:
            shm_files.remove(file.path)
            _HELD.discard(file.path)
            with contextlib.suppress(OSError):
                os.close(file.fd)


def _fill(fd: int, size: int, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write the bucket into the file behind ``fd`` (``size`` bytes) from offset 0."""
    views = byte_views(bucket, tensors)
    if views is not None:
        write_views(fd, views)
        return
    with mmap.mmap(fd, size) as mm:  # a GPU or non-contiguous tensor: copied into a mapping of the file
        buffer = torch.frombuffer(mm, dtype=torch.uint8)
        pack_into(buffer, bucket, tensors)
        del buffer


@dataclass
class _Segment:
    """A kept segment: mapped here (and, once ``shared``, by every worker); its file unlinked once shared."""

    id: str
    path: Path
    mm: mmap.mmap
    shared: bool = False

    def close(self) -> None:
        try:
            with contextlib.suppress(BufferError):  # a tensor still viewing it keeps the pages until it is freed
                self.mm.close()
        finally:
            shm_files.remove(self.path)


def _release(files: dict[int, _File], kept: dict[int, _Segment]) -> None:
    """Everything a transport holds in this process: its reused files and kept segments (the workers' mappings of
    these go with the engine, or with :func:`release_segments`)."""
    try:
        _close_files(files)
    finally:
        while kept:
            kept.popitem()[1].close()


#: Kept segments released per worker call (their ids travel as one small JSON object).
_RELEASE_CHUNK = 512


class Transport(WeightTransport):
    """Same-host transport through shared memory (the default for ``vllm.LLM`` multiprocess engines).

    Args:
        keep_segments: ``None`` (default): the bucket files of an install are kept in ``SHM_DIR`` and rewritten in
            place by the next install while they fit in :data:`REUSE_BUDGET` (1 GiB, at most a sixteenth of the
            shared-memory filesystem): updates up to that size, and the first buckets of larger ones, skip the
            kernel's allocation of fresh pages (15 MB: 4 ms instead of 10 ms). The workers map them for each install, as
            any bucket, and hold nothing between installs; the files go at :meth:`close`, when the engine shuts
            down (an engine link with ``on_shutdown``), when the transport is garbage-collected, at exit, or,
            after a SIGKILL, by the next transport's :func:`sweep_stale`. ``False``: a fresh file per
            bucket, removed as soon as the workers staged it. ``True``: keep the shared memory mapped between installs,
            here and in the workers, with no limit, until :meth:`close`: an install uses one segment per bucket
            (an atomic install keeps every bucket until it commits: one update's worth of shared memory), or a
            single segment for every bucket when the engine keeps no view of a bucket after its stage
            (``EngineLink.releases_buckets_after_stage``: a streaming direct install).

    A file is only rewritten by the next install, which starts once the previous one is over: every install path
    copies what it needs out of a bucket by then (the direct setter copies slices, vLLM's loaders copy into the
    parameters), and a session left open is dropped by the next ``begin``, before the first write.
    """

    name = "shm"
    # measured (150m, 612 MB, one engine): 128 MiB buckets 0.34-0.35 s against 0.38-0.39 s for 32 MiB (each bucket is
    # one stage round trip through the engine), with reused files and with fresh ones (0.56 s against 0.62 s); at most
    # an eighth of SHM_DIR's filesystem per instance (Docker's default 64 MiB /dev/shm: the 16 MiB floor)
    preferred_bucket_bytes = 128 << 20

    def __init__(self, keep_segments: bool | None = None) -> None:
        # Files of senders that died (SIGKILL skips every clean-up) go first: those no live process holds locked.
        sweep_stale()
        self.keep_segments = keep_segments is True
        """True: segments stay mapped in the workers between installs (``keep_segments=True``)."""
        self.keeps_segments = self.keep_segments
        self.shareable = not self.keep_segments  # one file, mapped by every engine on this host
        self._kept: dict[int, _Segment] = {}  # bucket index (or 0 for all) -> its segment, reused by every install
        self._engine: EngineLink | None = None
        self._one_segment = False
        self._budget = _reuse_budget() if keep_segments is None else 0
        self.preferred_bucket_bytes = _bucket_bytes(type(self).preferred_bucket_bytes)  # a subclass's own, capped
        self._files: dict[int, _File] = {}  # bucket index -> its file, rewritten by every install
        self._lock = threading.Lock()  # sends may run on several threads (a pipelined install): the two dicts
        # Dropped (with its adapter, handle or engine): the files and segments go; the finalizer holds no reference
        # to the transport, only to what it releases.
        self._finalizer = weakref.finalize(self, _release, self._files, self._kept)

    @property
    def overlaps(self) -> bool:
        """Sends may run at once: each bucket has a file (or kept segment) of its own, except where one kept
        segment carries every bucket."""
        return not (self.keep_segments and self._one_segment)

    def connect(self, engine: EngineLink) -> None:
        """Keep ``engine`` to release the workers' segments through; everything this transport holds goes when
        the engine stops (``engine.on_shutdown``)."""
        self._engine = engine
        # An engine that keeps no view of a bucket after its stage lets one segment carry every bucket.
        self._one_segment = engine.releases_buckets_after_stage
        engine.on_shutdown(_released_by(self))

    def close(self) -> None:
        """Remove the reused bucket files; unmap the kept segments here and ask the workers to unmap theirs (a
        failure to reach them is logged as a warning: they then hold that memory until they map a new segment or
        stop)."""
        try:
            self._forget(list(self._kept.values()), logging.WARNING)
        finally:
            _release(self._files, self._kept)

    def _release_here(self) -> None:
        """What the engine's shutdown runs: everything this process holds, without a call to the (gone) workers."""
        _release(self._files, self._kept)

    def _forget(self, segments: list[_Segment], level: int = logging.DEBUG) -> None:
        """Ask the workers to unmap ``segments``; a failure is logged at ``level`` (DEBUG while another error is
        being raised: a failed stage), never raised."""
        if segments and self._engine is not None:
            try:  # a worker also drops the segments of trainers that are gone when it maps a new one
                ids = [seg.id for seg in segments]
                for start in range(0, len(ids), _RELEASE_CHUNK):  # each call's arguments stay small
                    self._engine.engine_op("release_segments", ids=ids[start : start + _RELEASE_CHUNK])
            except Exception:
                logger.log(
                    level,
                    "could not ask the engine's workers to unmap %d kept shm segment(s)",
                    len(segments),
                    exc_info=True,
                )

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self.keep_segments:
            self._send_kept(bucket, tensors, stage)
            return
        with self.written(bucket) as file:
            _fill(file.fd, file.size, bucket, tensors)
            stage(file.descriptor)

    def rank_writable(self) -> Callable[[Bucket], contextlib.AbstractContextManager[BucketFile]] | None:
        """:meth:`written`: the ranks of a sharded install write their rows into each bucket's file (not with
        ``keep_segments=True``, where this transport writes its one kept segment itself)."""
        return None if self.keep_segments else self.written

    @contextlib.contextmanager
    def written(self, bucket: Bucket) -> Iterator[BucketFile]:
        """The file ``bucket`` goes into, open for writes; stage it with ``file.descriptor`` inside the block.
        ``file.path`` may be handed to other processes of this user on this host that write parts of it (the ranks
        of a sharded install). A fresh file is removed at the block's end; a reused one is dropped if the block
        fails (a worker may still be reading it). Not with ``keep_segments=True``."""
        if self.keep_segments:
            raise RuntimeError("a transport keeping its segments mapped writes its buckets itself (send)")
        size = max(bucket.nbytes, 1)
        reused = self._reusable(bucket.index, size)
        if reused is not None:
            try:
                yield BucketFile(reused.path, reused.fd, size, bucket.nbytes)
            except BaseException:
                with self._lock:  # a worker may still be reading it: start afresh next time
                    _close_files(self._files, bucket.index)
                raise
            return
        _, path, fd = shm_files.new_file(size)  # locked (so never swept) until removed
        try:
            yield BucketFile(path, fd, size, bucket.nbytes)
        finally:
            os.close(fd)
            shm_files.remove(path)

    def _reusable(self, index: int, size: int) -> _File | None:
        """The file the ``index``-th bucket of every install is written to, while the files fit in the budget;
        None: a fresh file for this bucket."""
        with self._lock:
            return self._reusable_locked(index, size)

    def _reusable_locked(self, index: int, size: int) -> _File | None:
        file = self._files.get(index)
        if file is not None and file.size >= size:
            return file
        _close_files(self._files, index)  # too small for this bucket (the update grew)
        if sum(f.size for f in self._files.values()) + size > self._budget:
            return None
        _, path, fd = shm_files.new_file(size)
        file = self._files[index] = _File(path, fd, size)
        _HELD.add(path)
        return file

    def _send_kept(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        # The i-th bucket of every install goes into the i-th segment (or every bucket into one, when the engine
        # holds no view of a bucket after its stage). A new install only starts once the previous one is over
        # (committed, or aborted and its session dropped by the next begin), so the pages are free to rewrite.
        size = max(bucket.nbytes, 1)
        slot = 0 if self._one_segment else bucket.index
        with self._lock:
            seg = self._kept.get(slot)
            if seg is not None and len(seg.mm) < size:
                self._drop(slot)
                seg = None
            if seg is None:
                seg = self._kept[slot] = self._create(size)
        buffer = torch.frombuffer(seg.mm, dtype=torch.uint8, count=size)
        pack_into(buffer, bucket, tensors)
        del buffer
        try:
            stage(ShmDescriptor(path=str(seg.path), nbytes=bucket.nbytes, segment=seg.id))
        except BaseException:
            self._drop(slot)  # a worker may or may not have mapped it: start afresh next time
            raise
        if not seg.shared:
            seg.shared = True
            shm_files.unlink(
                seg.path
            )  # every worker mapped it; the mappings keep the pages (and this process the lock)

    def _create(self, size: int) -> _Segment:
        return _Segment(*shm_files.new_segment(size))

    def _drop(self, index: int) -> None:
        seg = self._kept.pop(index)
        try:
            self._forget([seg])
        finally:
            seg.close()


@contextlib.contextmanager
def published(data: memoryview) -> Iterator[dict[str, Any]]:
    """``data`` (one packed bucket, e.g. fetched from elsewhere) in a fresh private file that this host's workers
    map; its descriptor's wire form (for a caller below the wire, such as an engine actor), and the file removed on
    exit."""
    _, path, fd = shm_files.new_file(max(data.nbytes, 1))
    try:
        try:
            if data.nbytes:
                write_views(fd, [data.cast("B")])
        finally:
            os.close(fd)
        yield ShmDescriptor(path=str(path), nbytes=data.nbytes).to_wire()
    finally:
        shm_files.remove(path)


_SEGMENT_ID = re.compile(r"[0-9a-f]{32}")


def _released_by(transport: Transport) -> Callable[[], None]:
    """A callback releasing what ``transport`` holds in this process, holding no reference to it (an engine's
    shutdown hooks must not keep a dropped transport alive)."""
    ref = weakref.ref(transport)

    def release() -> None:
        live = ref()
        if live is not None:
            live._release_here()

    return release


def _open_kept(sid: str, path: Path, nbytes: int, worker: Any) -> Opened:
    if not _SEGMENT_ID.fullmatch(sid) or not path.name.endswith(f"-{sid}"):
        raise ValueError(f"refusing segment {sid!r}: not the id in {path.name}")
    segments = shm_files.kept_segments(worker)
    if sid not in segments:
        shm_files.release_segments(worker, [])  # drop segments of trainers that are gone before mapping a new one
        fd = shm_files.open_segment(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)  # shared: the trainer's next writes are seen here
        finally:
            os.close(fd)
        _populate(mm, len(mm))  # once: the trainer rewrites the same pages, so they stay mapped
        pid = shm_files.creator(path)
        segments[sid] = (pid if Path(f"/proc/{pid}").exists() else None, mm)
    mm = segments[sid][1]
    if len(mm) < nbytes:
        raise ValueError(f"segment {sid} holds {len(mm)} bytes, the bucket needs {nbytes}")
    buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer, mm


#: ``madvise`` advice that maps a range's pages without copying them (Linux 5.14; not named by Python's ``mmap``).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _populate(mm: mmap.mmap, nbytes: int) -> None:
    """Map the first ``nbytes`` of ``mm`` now, at the bucket's stage, so that the commit does not fault each page
    in (612 MB: ~0.045 s of one core). Copy-on-write pages stay shared. Older kernels refuse it: then the pages
    fault in when read, as before."""
    if nbytes:
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(_MADV_POPULATE_READ, 0, nbytes)


class Receiver(BucketReceiver):
    """Map a bucket file copy-on-write; the mapping stays valid after the trainer unlinks the file.

    A descriptor with a ``segment`` id is a kept segment: mapped shared the first time, kept on ``worker`` and
    reused by later installs (see :class:`Transport`'s ``keep_segments``).
    """

    descriptor = ShmDescriptor

    @classmethod
    def open(cls, descriptor: ShmDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None) -> Opened:
        path = Path(descriptor.path)
        nbytes = descriptor.nbytes
        if not shm_files.is_segment(path):
            raise ValueError(f"refusing to map {path}: not a hotweights segment in {SHM_DIR}")
        path = SHM_DIR / path.name
        if descriptor.segment is not None:
            if worker is None:
                raise ValueError("a kept shm segment needs a worker to keep its mapping on")
            return _open_kept(descriptor.segment, path, nbytes, worker)
        fd = shm_files.open_segment(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, the bucket needs {nbytes}")
            mm = mmap.mmap(fd, max(nbytes, 1), access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        _populate(mm, nbytes)
        empty = torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else empty, mm
