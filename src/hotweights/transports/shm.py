"""Shared-memory transport: the trainer writes each bucket into a private file in ``/dev/shm``; the workers map it
(copy-on-write, so nothing is copied unless written) for the install.

By default the files of an install's first buckets (up to ``REUSE_BUDGET``, 1 GiB) are kept and rewritten by the
next install: rewriting pages is 2-3x faster than having the kernel allocate fresh ones. The workers hold nothing
between installs. Every other file is unlinked as soon as the workers staged it. Kept files go at
:meth:`Transport.close`, when the engine the transport is connected to shuts down (where the engine link offers
``on_shutdown``), when the transport is garbage-collected, and at exit.

Ownership: the creating process holds a shared ``flock`` on every file it creates, on a descriptor of its own, for
as long as the file may be in use; the engine workers open and map the files but never lock them. A SIGKILL (which
skips every clean-up) releases the lock, so :func:`sweep_stale` (run by every new :class:`Transport`) removes a
``hotweights-<pid>-<id>`` file only when it can take the exclusive lock: never one in use by a live process, in
any PID namespace or container that shares this ``/dev/shm`` (the kernel keeps the locks per file).

With ``Transport(keep_segments=True)`` every bucket's shared memory stays mapped, here and in the workers (the file
itself is unlinked once every worker has mapped it), and the next install writes into the same pages: no page
faults on either side, and the segments are held until :meth:`Transport.close`: one per bucket (one update's
worth), or a single one when the engine keeps no view of a bucket after its stage.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import logging
import math
import mmap
import os
import re
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.core import attach
from hotweights.core.buckets import Bucket, byte_views, pack_into
from hotweights.transports.transport import Descriptor, EngineLink, Stage, WeightTransport

__all__ = [
    "REUSE_BUDGET",
    "REUSE_ENV",
    "SHM_DIR",
    "BucketFile",
    "Transport",
    "open_bucket",
    "opened_for_writes",
    "published",
    "release_segments",
    "sweep_stale",
]

logger = logging.getLogger("hotweights")

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
_PREFIX = "hotweights-"
_LIVE: set[Path] = set()  # the files this process created and has not removed yet (unlinked at exit)
_HELD: set[Path] = set()  # the files live transports keep for reuse (a subset of _LIVE)
_LOCKS: dict[Path, int] = {}  # path -> the descriptor through which this process holds the file's shared lock
#: Directories (the weights-path adapter's private checkpoints, ``hotweights-<pid>-ckpt-*``) carry no lock: they go
#: when their pid's process is gone here and they are at least this old (a live owner in another PID namespace).
_DIR_MIN_AGE = 60.0


@atexit.register
def _unlink_live() -> None:
    for path in list(_LIVE):
        _remove(path)


def _forget_inherited() -> None:
    """In a forked child: drop the parent's registries and close its lock descriptors (never ``LOCK_UN``, which
    would release the parent's lock: the descriptors share its open file descriptions), so that a child outliving a
    SIGKILLed parent (a data loader worker, an engine process forked later) does not keep the parent's files."""
    for fd in _LOCKS.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKS.clear()
    _LIVE.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_inherited)


def sweep_stale(directory: Path = SHM_DIR, min_age: float = 0.0) -> list[Path]:
    """Remove this user's ``hotweights-<pid>-...`` files whose owner is gone (no process holds their lock) and that
    are at least ``min_age`` seconds old, and private checkpoint directories of pids that are gone (at least a
    minute old); returns what was removed.

    A file is removed only under an exclusive lock taken without waiting, so never one a live process, in any PID
    namespace, holds (the workers' descriptors hold no lock). An unlocked file is kept too while the process its name
    carries runs here and started before the file was last written: an older hotweights, which locked nothing,
    may still be using it (a later process that reused the pid does not protect it)."""
    removed = []
    now = time.time()
    for path in directory.glob(f"{_PREFIX}*"):
        m = _OWNED_NAME.match(path.name)
        if not m or path in _LOCKS:
            continue
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        age = now - st.st_mtime
        if st.st_uid != os.getuid() or age < min_age:
            continue
        started = _process_start(int(m.group(1)))
        if started is not None and started <= st.st_mtime + _CLOCK_SLACK:
            continue  # its own process may still use it
        if stat.S_ISDIR(st.st_mode):  # a private checkpoint directory (the weights-path adapter): no lock on it
            if age >= _DIR_MIN_AGE:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        elif stat.S_ISREG(st.st_mode) and _unlink_unlocked(path, st):
            removed.append(path)
    return removed


#: What a sweep looks at: ``hotweights-<pid>-`` names (the pid of the creating process, in its namespace).
_OWNED_NAME = re.compile(rf"{_PREFIX}([0-9]+)-")
#: Seconds of error in a process's start time as :func:`_process_start` computes it (``btime`` is whole seconds).
_CLOCK_SLACK = 5.0


@functools.cache
def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _process_start(pid: int) -> float | None:
    """When the process ``pid`` started (seconds since the epoch), if it runs and this process can see it (None
    for a zombie, a pid that is gone, or one in another PID namespace)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()  # after the command's name
        if fields[0] == b"Z":
            return None
        ticks = int(fields[19])  # field 22: start time, in clock ticks after boot
    except (OSError, IndexError, ValueError):
        return None
    boot = _boot_time()
    return 0.0 if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")  # no boot time: "since ever"


def _unlink_unlocked(path: Path, st: os.stat_result) -> bool:
    """Unlink ``path`` (the file ``st`` describes) if no process holds a lock on it; True if it did."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, or replaced by something this sweep does not touch
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner is alive (EWOULDBLOCK), or the filesystem cannot lock: left alone
        if os.lstat(path).st_ino != st.st_ino:
            return False
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the exclusive lock


def _lock_created(fd: int) -> bool:
    """Take this process's shared lock on a file it just created; False when a sweep got there first (it holds the
    file, or unlinked it between the creation and the lock): the creator then takes another name."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
            return True  # a filesystem without locks (an odd TMPDIR): unlocked, and no sweep can lock it either
        raise
    return os.fstat(fd).st_nlink > 0


def _new_file(size: int) -> tuple[str, Path, int]:
    """A new private file of ``size`` bytes in ``SHM_DIR``, mode 0600, locked by this process until :func:`_remove`
    (or exit): its id, path and an open descriptor (on a description of its own: closing it keeps the lock)."""
    for _ in range(8):
        sid = uuid.uuid4().hex
        path = SHM_DIR / f"{_PREFIX}{os.getpid()}-{sid}"
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if _lock_created(lock):
                break
        except BaseException:
            os.close(lock)
            path.unlink(missing_ok=True)
            raise
        os.close(lock)
        path.unlink(missing_ok=True)
    else:
        raise OSError(errno.EAGAIN, f"could not create and lock a segment in {SHM_DIR}")
    _LIVE.add(path)
    _LOCKS[path] = lock
    try:
        os.fchmod(lock, 0o600)  # exactly: a umask must not take the owner's write bit (the workers map it shared)
        os.ftruncate(lock, size)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BaseException:
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


#: Most bytes of bucket files a default shm transport keeps for reuse (see ``Transport(keep_segments=None)``):
#: 1 GiB, so a model up to that size is rewritten in place by every install (no fresh pages: 612 MB took 0.46 s
#: to write into fresh pages, as long as the rest of the install). ``HOTWEIGHTS_SHM_REUSE_BYTES`` overrides it
#: (``0``: a fresh file per bucket).
REUSE_BUDGET = 1 << 30
#: Environment variable that overrides :data:`REUSE_BUDGET` (bytes).
REUSE_ENV = "HOTWEIGHTS_SHM_REUSE_BYTES"


def _shm_bytes() -> int | None:
    """The size of ``SHM_DIR``'s filesystem (None: it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _bucket_bytes(preferred: int) -> int:
    """``preferred``, at most an eighth of ``SHM_DIR``'s filesystem: a streaming commit then keeps its few live
    buckets within a small ``/dev/shm``."""
    size = _shm_bytes()
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
    size = _shm_bytes()
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
            _remove(file.path)
            _HELD.discard(file.path)
            with contextlib.suppress(OSError):
                os.close(file.fd)


def _fill(fd: int, size: int, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write the bucket into the file behind ``fd`` (``size`` bytes) from offset 0."""
    views = byte_views(bucket, tensors)
    if views is not None:
        _write(fd, views)
        return
    with mmap.mmap(fd, size) as mm:  # a GPU or non-contiguous tensor: copied into a mapping of the file
        buffer = torch.frombuffer(mm, dtype=torch.uint8)
        pack_into(buffer, bucket, tensors)
        del buffer


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
            _write_at(fd, view[n:], offset + n)
            offset += view.nbytes


class BucketFile:
    """A bucket's file, open for writes at offsets (``fd`` stays the opener's to close). The ranks of a sharded
    install write the rows they hold straight into the leader's bucket (:mod:`hotweights.core.rank_writes`)."""

    def __init__(self, path: Path, fd: int, size: int, nbytes: int | None = None) -> None:
        self.path, self.fd, self.size = str(path), fd, size
        nbytes = size if nbytes is None else nbytes
        self.descriptor: Descriptor = {"transport": "shm", "path": self.path, "nbytes": nbytes}
        """What stages the bucket written into this file."""

    def write(self, data: torch.Tensor, offset: int, shape: Sequence[int], dim: int = 0, start: int = 0) -> None:
        """``data``: the slice ``[start, start + data.shape[dim])`` along ``dim`` of a row-major tensor of
        ``shape`` (of ``data``'s dtype) that begins ``offset`` bytes into the file, written with ``pwrite``: rows in
        one call, columns in one call per row."""
        full = tuple(int(n) for n in shape)
        whole = tuple(data.shape) == full and start == 0
        count = int(data.shape[dim]) if 0 <= dim < min(data.dim(), len(full)) else -1
        if not whole and (
            data.dim() != len(full)
            or tuple(data.shape) != (*full[:dim], count, *full[dim + 1 :])
            or start < 0
            or start + count > full[dim]
        ):
            raise ValueError(
                f"a slice of shape {tuple(data.shape)} at {start} along dim {dim} does not fit a tensor of shape {full}"
            )
        step = math.prod(full[dim + 1 :]) * data.element_size()  # bytes of one index along dim
        end = offset + math.prod(full) * data.element_size()
        if offset < 0 or end > self.size:
            raise ValueError(f"bytes [{offset}, {end}) lie outside the bucket file ({self.size} bytes)")
        raw = memoryview(data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        outer = math.prod(full[:dim])
        if whole or outer == 1 or not data.numel():  # one run of bytes
            _write_at(self.fd, raw, offset + start * step)
            return
        # One run per index of the dimensions before ``dim`` (a row of columns): a system call each, on this thread
        # (a mapping's strided copy ran on torch's threads, against the other ranks' writes: 4-6x slower here).
        length, stride = count * step, full[dim] * step
        at = offset + start * step
        for i in range(outer):
            _write_at(self.fd, raw[i * length : (i + 1) * length], at + i * stride)


@contextlib.contextmanager
def opened_for_writes(path: str) -> Iterator[BucketFile]:
    """Another process's bucket file (``file.path`` of its :meth:`Transport.written`), open for this
    process's writes: only a hotweights segment in ``SHM_DIR``, a regular file of this user."""
    where = Path(path)
    if where.parent != SHM_DIR or not _SEGMENT_NAME.fullmatch(where.name):
        raise ValueError(f"refusing to write {path}: not a hotweights segment in {SHM_DIR}")
    fd = _open_segment(SHM_DIR / where.name, os.O_RDWR)
    try:
        yield BucketFile(where, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset`` of the file behind ``fd`` (``pwrite`` again after a short write: tmpfs does not
    make them, but the call may)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _unlink(path: Path) -> None:
    """Unlink a file this process created, keeping its lock (a kept segment stays in use once unlinked). A forked
    child leaves its parent's files alone: the name carries the creating pid."""
    if path.name.startswith(f"{_PREFIX}{os.getpid()}-"):
        path.unlink(missing_ok=True)
    _LIVE.discard(path)


def _remove(path: Path) -> None:
    """Unlink a file this process created, then release its lock."""
    _unlink(path)
    lock = _LOCKS.pop(path, None)
    if lock is not None:
        os.close(lock)


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
            _remove(self.path)


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
        """Keep ``engine`` to release the workers' segments through; where the link offers
        ``on_shutdown(callback)``, everything this transport holds goes when the engine stops."""
        self._engine = engine
        # An engine that keeps no view of a bucket after its stage lets one segment carry every bucket.
        self._one_segment = bool(getattr(engine, "releases_buckets_after_stage", False))
        on_shutdown = getattr(engine, "on_shutdown", None)
        if callable(on_shutdown):
            on_shutdown(_released_by(self))

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
        _, path, fd = _new_file(size)  # locked (so never swept) until _remove
        try:
            yield BucketFile(path, fd, size, bucket.nbytes)
        finally:
            os.close(fd)
            _remove(path)

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
        _, path, fd = _new_file(size)
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
            stage({"transport": self.name, "path": str(seg.path), "nbytes": bucket.nbytes, "segment": seg.id})
        except BaseException:
            self._drop(slot)  # a worker may or may not have mapped it: start afresh next time
            raise
        if not seg.shared:
            seg.shared = True
            _unlink(seg.path)  # every worker mapped it; the mappings keep the pages (and this process the lock)

    def _create(self, size: int) -> _Segment:
        return _Segment(*_new_segment(size))

    def _drop(self, index: int) -> None:
        seg = self._kept.pop(index)
        try:
            self._forget([seg])
        finally:
            seg.close()


@contextlib.contextmanager
def published(data: memoryview) -> Iterator[Descriptor]:
    """``data`` (one packed bucket, e.g. fetched from elsewhere) in a fresh private file that this host's workers
    map; its descriptor, and the file removed on exit."""
    _, path, fd = _new_file(max(data.nbytes, 1))
    try:
        try:
            if data.nbytes:
                _write(fd, [data.cast("B")])
        finally:
            os.close(fd)
        yield {"transport": "shm", "path": str(path), "nbytes": data.nbytes}
    finally:
        _remove(path)


_SEGMENT_ID = re.compile(r"[0-9a-f]{32}")
#: The names :func:`_new_file` gives (``hotweights-<pid>-<uuid4 hex>``): the only files a worker maps.
_SEGMENT_NAME = re.compile(rf"{_PREFIX}[0-9]+-[0-9a-f]{{32}}")


def _released_by(transport: Transport) -> Callable[[], None]:
    """A callback releasing what ``transport`` holds in this process, holding no reference to it (an engine's
    shutdown hooks must not keep a dropped transport alive)."""
    ref = weakref.ref(transport)

    def release() -> None:
        live = ref()
        if live is not None:
            live._release_here()

    return release


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
    st = os.fstat(fd)
    why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _foreign_owner(st)
    if why:
        os.close(fd)
        raise ValueError(f"refusing to map {path}: {why}")
    return fd


def _foreign_owner(st: os.stat_result) -> str:
    """Why a worker refuses a file by its owner: it must be this worker's user (the trainer creates them 0600, so
    only that user reads them); a root worker reads any user's. Empty when it may be mapped."""
    euid = os.geteuid()
    if euid != 0 and st.st_uid != euid:
        return f"owned by uid {st.st_uid}, not this worker's {euid}"
    return ""


def _kept_segments(worker: Any) -> dict[str, tuple[int | None, mmap.mmap]]:
    """This worker's kept segments: id -> (trainer pid if this process can see it, mapping)."""
    segments: dict[str, tuple[int | None, mmap.mmap]] = attach.value(worker, "shm_segments", dict)
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
        _populate(mm, len(mm))  # once: the trainer rewrites the same pages, so they stay mapped
        pid = int(path.name[len(_PREFIX) :].split("-", 1)[0])
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
    _populate(mm, nbytes)
    buffer = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer, mm
