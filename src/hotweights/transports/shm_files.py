"""hotweights' private files in ``/dev/shm`` (``hotweights-<pid>-<id>``): created, locked, opened, unlinked and
swept here, for the shm transport (:mod:`hotweights.transports.shm`), the delta base
(:mod:`hotweights.transports.shm_base`), the ranks' writes (:mod:`hotweights.transports.shm_writes`) and the
engine's workers (which map them and release the kept ones).

Ownership: the creating process holds a shared ``flock`` on every file it creates, on a descriptor of its own, for
as long as the file may be in use; the engine workers open and map the files but never lock them. A SIGKILL (which
skips every clean-up) releases the lock, so :func:`sweep_stale` (run by every new shm transport) removes a
``hotweights-<pid>-<id>`` file only when it can take the exclusive lock: never one in use by a live process, in
any PID namespace or container that shares this ``/dev/shm`` (the kernel keeps the locks per file). Files this
process still holds are unlinked at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import mmap
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from hotweights.core import attach

__all__ = [
    "SEGMENT_NAME",
    "SHM_DIR",
    "creator",
    "is_segment",
    "kept_segments",
    "new_file",
    "new_segment",
    "open_segment",
    "release_segments",
    "remove",
    "shm_bytes",
    "sweep_stale",
    "unlink",
]


SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
_PREFIX = "hotweights-"
_LIVE: set[Path] = set()  # the files this process created and has not removed yet (unlinked at exit)
_LOCKS: dict[Path, int] = {}  # path -> the descriptor through which this process holds the file's shared lock
#: Directories (the weights-path adapter's private checkpoints, ``hotweights-<pid>-ckpt-*``) carry no lock: they go
#: when their pid's process is gone here and they are at least this old (a live owner in another PID namespace).
_DIR_MIN_AGE = 60.0


@atexit.register
def _unlink_live() -> None:
    for path in list(_LIVE):
        remove(path)


def _forget_inherited() -> None:
    """In a forked child: drop the parent's registries and close its lock descriptors (never ``LOCK_UN``, which
    would release the parent's lock: the descriptors share its open file descriptions), so that a child outliving a
    SIGKILLed parent (a data loader worker, an engine process forked later) does not keep the parent's files."""
    for fd in _LOCKS.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKS.clear()
    _LIVE.clear()


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


def new_file(size: int) -> tuple[str, Path, int]:
    """A new private file of ``size`` bytes in ``SHM_DIR``, mode 0600, locked by this process until :func:`remove`
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
        remove(path)
        raise
    return sid, path, fd


def new_segment(size: int) -> tuple[str, Path, mmap.mmap]:
    """:func:`new_file`, mapped here: its id, path and mapping."""
    sid, path, fd = new_file(size)
    try:
        return sid, path, mmap.mmap(fd, size)
    except BaseException:
        remove(path)
        raise
    finally:
        os.close(fd)


def shm_bytes() -> int | None:
    """The size of ``SHM_DIR``'s filesystem (None: it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def unlink(path: Path) -> None:
    """Unlink a file this process created, keeping its lock (a kept segment stays in use once unlinked). A forked
    child leaves its parent's files alone: the name carries the creating pid."""
    if path.name.startswith(f"{_PREFIX}{os.getpid()}-"):
        path.unlink(missing_ok=True)
    _LIVE.discard(path)


def remove(path: Path) -> None:
    """Unlink a file this process created, then release its lock."""
    unlink(path)
    lock = _LOCKS.pop(path, None)
    if lock is not None:
        os.close(lock)


#: The names :func:`new_file` gives (``hotweights-<pid>-<uuid4 hex>``): the only files a worker maps.
SEGMENT_NAME = re.compile(rf"{_PREFIX}[0-9]+-[0-9a-f]{{32}}")


def is_segment(path: Path) -> bool:
    """Whether ``path`` names a hotweights file in :data:`SHM_DIR` (checked before any other process's path is
    opened: nothing outside that directory, nothing of another name)."""
    return path.parent == SHM_DIR and SEGMENT_NAME.fullmatch(path.name) is not None


def creator(path: Path) -> int:
    """The pid (in its PID namespace) of the process that created the file :data:`SEGMENT_NAME` names."""
    return int(path.name[len(_PREFIX) :].split("-", 1)[0])


def open_segment(path: Path, flags: int) -> int:
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


def kept_segments(worker: Any) -> dict[str, tuple[int | None, mmap.mmap]]:
    """This worker's kept segments: id -> (trainer pid if this process can see it, mapping)."""
    segments: dict[str, tuple[int | None, mmap.mmap]] = attach.value(worker, "shm_segments", dict)
    return segments


def release_segments(worker: Any, ids: list[str] | None = None) -> int:
    """Unmap the kept segments ``ids`` (all when None) and those of trainers that are gone; returns how many."""
    segments = kept_segments(worker)

    def gone(pid: int | None) -> bool:  # a trainer in another PID namespace is never seen, so never presumed gone
        return pid is not None and not Path(f"/proc/{pid}").exists()

    drop = [s for s, (pid, _) in segments.items() if ids is None or s in ids or gone(pid)]
    for sid in drop:
        _, mm = segments.pop(sid)
        with contextlib.suppress(BufferError):  # a staged tensor still viewing it keeps the pages until freed
            mm.close()
    return len(drop)
