"""Who owns a shm bucket file, and when it goes: the creating process holds a lock on it for as long as it may be
in use; the sweep every new transport runs removes only files nobody holds (a SIGKILLed trainer's), never one a
live process holds, whatever pid its name carries; close(), the engine's shutdown, dropping the transport and exit
release everything it made."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import mmap
import os
import signal
import stat
import subprocess
import sys
import textwrap
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import EngineLink, shm, shm_files
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension

DEAD_PID = 999_999_999  # above any kernel's pid_max (at most 2**22): a pid no process here has


# ---------------------------------------------------------------------------------------------- helpers
def _bucket(tensors: dict[str, torch.Tensor], index: int = 0) -> Bucket:
    """The one bucket of ``tensors``, as the ``index``-th of an update (a kept segment per index)."""
    (bucket,) = plan_buckets(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), bucket_bytes=1 << 20)
    return bucket.model_copy(update={"index": index})


TENSORS = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}


def _locked(path: Path) -> bool:
    """Whether some open file description holds a lock on ``path`` (as the sweep tests it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _ours() -> list[Path]:
    return sorted(shm_files.SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))


#: The start of a subprocess that sends one small bucket through the shm transport (``paths``: what it sent).
_ONE_BUCKET = """
        import json, os, time, torch
        from hotweights.core.buckets import plan_buckets
        from hotweights.core.manifest import WeightUpdateManifest
        from hotweights.transports import shm
        tensors = {"w": torch.ones(8)}
        (bucket,) = plan_buckets(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), bucket_bytes=1 << 20)
        paths = []
"""


@contextmanager
def _process(code: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """Run ``code`` in a Python subprocess; it prints one JSON line (handed over) and then sleeps until killed."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the subprocess died before reporting"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)  # reaped: its descriptors (and locks) are gone with it


class _Link(EngineLink):
    """An engine link whose operations (``release_segments``) succeed, or raise ``fails``; each is recorded with its
    arguments as the workers would read them (a JSON object)."""

    num_workers = 1

    def __init__(self, fails: BaseException | None = None) -> None:
        self.fails = fails
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        self.calls.append((op, json.loads(json.dumps(args))))
        if self.fails is not None:
            raise self.fails
        return [0]


def _unshared_segment(transport: shm.Transport) -> Path:
    """A kept segment created and then left unshared (its pack failed before the stage): its file is still named."""
    with pytest.raises(KeyError):
        transport.send(_bucket(TENSORS), {"w": TENSORS["w"]}, lambda d: None)  # "b" is missing
    seg = transport._kept[0]
    assert seg.path.exists() and not seg.shared
    return seg.path


def _kept_file(transport: shm.Transport) -> Path:
    """A file a default transport keeps for the next install."""
    paths: list[Path] = []
    transport.send(_bucket(TENSORS), TENSORS, lambda d: paths.append(Path(d.path)))
    assert paths[0].exists()
    return paths[0]


# ---------------------------------------------------------------------------------------------- the sweep
def test_a_sigkilled_trainers_files_go_with_the_next_transport() -> None:
    """Its kept file and a segment in flight: locked while it lives (no sweep touches them), gone at the next
    Transport() right after the kill, although the kill skipped every clean-up."""
    code = """
        import json, sys, time, torch
        from hotweights.core.buckets import plan_buckets
        from hotweights.core.manifest import WeightUpdateManifest
        from hotweights.transports import shm
        tensors = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}
        (bucket,) = plan_buckets(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), bucket_bytes=1 << 20)
        paths = []
        shm.Transport().send(bucket, tensors, lambda d: paths.append(d.path))
        keep = shm.Transport()  # kept alive below, with its file
        keep.send(bucket, tensors, lambda d: paths.append(d.path))
        def in_flight(d):
            paths.append(d.path)
            print(json.dumps({"paths": paths[1:]}), flush=True)
            time.sleep(3600)  # killed here, mid-install
        shm.Transport(keep_segments=True).send(bucket, tensors, in_flight)
    """
    with _process(code) as (proc, report):
        paths = [Path(p) for p in report["paths"]]
        assert len(paths) == 2
        shm_files.sweep_stale()
        shm.Transport()
        assert all(p.exists() for p in paths)  # its owner is alive
        _kill(proc)
        shm.Transport()  # at once: no age margin
        assert not any(p.exists() for p in paths)


def test_a_file_a_live_process_holds_is_never_swept_whatever_its_pid() -> None:
    """A file named after a pid that does not exist here (its owner runs in another PID namespace), old, held by
    a live process: kept by every sweep; a worker's open mapping does not count as an owner once that process is
    gone."""
    path = shm_files.SHM_DIR / f"hotweights-{DEAD_PID}-{uuid.uuid4().hex}"
    code = f"""
        import fcntl, json, os, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime({str(path)!r}, (0, 0))  # as old as it gets
        print(json.dumps({{"ready": True}}), flush=True)
        time.sleep(3600)
    """
    try:
        with _process(code) as (proc, _):
            for sweep in (shm_files.sweep_stale, lambda: shm_files.sweep_stale(min_age=60.0), shm.Transport):
                sweep()
                assert path.exists()
            fd = os.open(path, os.O_RDWR)  # what a worker does: open and map it, without a lock
            mapping = mmap.mmap(fd, 4096)
            os.close(fd)
            shm_files.sweep_stale()
            assert path.exists()
            _kill(proc)
            assert shm_files.sweep_stale() == [path]  # the mapping holds the pages, not the file
            mapping.close()
    finally:
        path.unlink(missing_ok=True)


def test_an_unlocked_file_is_kept_while_the_process_it_names_runs(tmp_path: Path) -> None:
    """A file nobody locks (an older hotweights wrote it) is kept while its process runs, and goes with it; a
    file named after a pid that a later process reuses (this one) is not protected by that process."""
    code = """
        import json, os, time
        print(json.dumps({"pid": os.getpid()}), flush=True)
        time.sleep(3600)
    """
    with _process(code) as (proc, report):
        older = tmp_path / f"hotweights-{report['pid']}-{uuid.uuid4().hex}"
        older.write_bytes(b"x")
        reused = tmp_path / f"hotweights-{os.getpid()}-{uuid.uuid4().hex}"
        reused.write_bytes(b"x")
        os.utime(reused, (0, 0))  # written long before this process started
        assert shm_files.sweep_stale(tmp_path) == [reused]
        assert older.exists()
        _kill(proc)
        assert shm_files.sweep_stale(tmp_path) == [older]


def test_a_sweep_between_creation_and_lock_makes_the_creator_start_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one window a sweep can win: a file created and not yet locked. The creator sees it unlinked (or locked
    by the sweep) and takes a new name, locked before anyone can remove it."""
    real = fcntl.flock
    raced: list[Path] = []

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_SH and len(raced) < 2:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            raced.append(path)
            if len(raced) == 1:
                path.unlink()  # the sweep removed it first
            else:
                raise BlockingIOError  # the sweep holds it right now
        real(fd, op)

    monkeypatch.setattr(shm_files.fcntl, "flock", flock)
    _, path, fd = shm_files.new_file(64)
    try:
        assert len(raced) == 2 and path not in raced and not any(p.exists() for p in raced)
        assert path.exists() and _locked(path)
    finally:
        os.close(fd)
        shm_files.remove(path)
    assert not path.exists()


def test_a_forked_child_does_not_keep_a_killed_parents_files() -> None:
    """A child forked by the trainer (a data loader worker) and still running does not hold the files of a trainer
    killed with SIGKILL: it closed the inherited lock descriptors at the fork."""
    code = (
        _ONE_BUCKET
        + """
        transport = shm.Transport()
        transport.send(bucket, tensors, lambda d: paths.append(d.path))
        ready, said = os.pipe()
        child = os.fork()
        if child == 0:  # the fork's handlers ran before this line: the inherited descriptors are closed
            os.write(said, b"1")
            time.sleep(3600)
            os._exit(0)
        os.read(ready, 1)  # not before the child got that far (a loaded machine may run it late)
        print(json.dumps({"paths": paths, "child": child}), flush=True)
        time.sleep(3600)
    """
    )
    with _process(code) as (proc, report):
        child = int(report["child"])
        try:
            (path,) = [Path(p) for p in report["paths"]]
            _kill(proc)
            assert shm_files.sweep_stale() == [path]
        finally:
            os.kill(child, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- this process's own
def test_files_are_private_whatever_the_umask() -> None:
    """Created 0600 (read-write for the workers' shared mappings, nobody else), even under a umask that would take
    the owner's write bit."""
    old = os.umask(0o377)
    try:
        transport = shm.Transport()
        path = _kept_file(transport)
        kept = shm.Transport(keep_segments=True)
        segment = _unshared_segment(kept)
    finally:
        os.umask(old)
    try:
        for p in (path, segment):
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
            assert p.stat().st_uid == os.getuid()
    finally:
        transport.close()
        kept.close()


@pytest.mark.parametrize("kept", [False, True])
def test_a_worker_refuses_a_file_of_another_user(kept: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = uuid.uuid4().hex
    path = shm_files.SHM_DIR / f"hotweights-{os.getpid()}-{sid}"
    path.write_bytes(b"\0" * 8)
    descriptor: dict[str, Any] = {"transport": "shm", "path": str(path), "nbytes": 8}
    if kept:
        descriptor["segment"] = sid
    worker = HotWeightsWorkerExtension()
    try:
        buffer, _ = shm.Receiver.open(shm.Receiver.parse(descriptor), worker)  # this worker's own user's file: mapped
        assert buffer.numel() == 8
        assert worker.hotweights_engine("release_segments", json.dumps({"ids": None})) == int(kept)
        monkeypatch.setattr(shm.os, "geteuid", lambda: path.stat().st_uid + 4242)  # a worker of another user
        with pytest.raises(ValueError, match=r"refusing to map .*: owned by uid \d+, not this worker's"):
            shm.Receiver.open(shm.Receiver.parse(descriptor), worker)
    finally:
        path.unlink()


def test_close_removes_everything_even_when_the_workers_cannot_be_told(caplog: pytest.LogCaptureFixture) -> None:
    """close(): the kept file, the kept segments (shared and not) and their locks go; the workers are asked to
    unmap theirs; a failure to reach them is a warning, and an interrupt during that call leaves nothing behind."""
    caplog.set_level(logging.WARNING, logger="hotweights")
    for fails in (None, RuntimeError("engine gone"), KeyboardInterrupt()):
        caplog.clear()
        transport = shm.Transport()
        _kept_file(transport)
        segments = shm.Transport(keep_segments=True)
        link = _Link(fails)
        assert isinstance(link, EngineLink)
        segments.connect(link)
        segments.send(_bucket({"w": torch.ones(4)}, 1), {"w": torch.ones(4)}, lambda d: None)  # shared: unlinked
        _unshared_segment(segments)
        assert len(_ours()) == 2
        ids = sorted(seg.id for seg in segments._kept.values())
        assert len(ids) == 2
        transport.close()
        if isinstance(fails, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                segments.close()
        else:
            segments.close()
        assert [op for op, _ in link.calls] == ["release_segments"]
        assert sorted(link.calls[0][1]["ids"]) == ids and set(link.calls[0][1]) == {"ids"}
        assert _ours() == [] and segments._kept == {}
        warned = [r for r in caplog.records if "could not ask the engine's workers to unmap 2" in r.getMessage()]
        assert len(warned) == (isinstance(fails, RuntimeError))
        transport.close()  # twice: nothing left to do
        segments.close()
    assert not [p for p in shm_files._LOCKS if p.name.startswith(f"hotweights-{os.getpid()}-")]  # locks released


def test_a_dropped_transport_takes_its_files_and_segments() -> None:
    """Dropped with the adapter that links it to the engine (a reference cycle, as adapter and handle make):
    collected, its files, segments and locks go, with no call to the workers."""
    link = _Link()
    transport = shm.Transport()
    transport.connect(link)
    link.transport = transport  # type: ignore[attr-defined]  # the adapter holds its transport
    _kept_file(transport)
    kept = shm.Transport(keep_segments=True)
    kept.connect(link)
    link.kept = kept  # type: ignore[attr-defined]
    _unshared_segment(kept)
    assert len(_ours()) == 2
    del transport, kept, link
    gc.collect()
    assert _ours() == []
    assert not [p for p in shm_files._LOCKS if p.name.startswith(f"hotweights-{os.getpid()}-")]


def test_the_engines_shutdown_releases_the_files() -> None:
    """A link with ``on_shutdown(callback)`` (an installer: its engine handle's hook): the transport registers a
    release that holds no reference to it; the shutdown removes its files without calling the (gone) workers."""
    hooks: list[Callable[[], None]] = []

    class Handle:
        def on_shutdown(self, callback: Callable[[], None]) -> None:
            hooks.append(callback)

    link = _Link()
    link.on_shutdown = Handle().on_shutdown  # type: ignore[attr-defined]
    transport = shm.Transport()
    transport.connect(link)
    kept = shm.Transport(keep_segments=True)
    kept.connect(link)
    _kept_file(transport)
    kept.send(_bucket({"w": torch.ones(4)}, 1), {"w": torch.ones(4)}, lambda d: None)
    _unshared_segment(kept)
    assert len(hooks) == 2 and len(_ours()) == 2
    for hook in hooks:
        hook()
    assert _ours() == [] and kept._kept == {}
    assert link.calls == []
    dropped = shm.Transport()
    dropped.connect(link)
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None  # the engine's hook did not keep it alive
    hooks[-1]()  # and runs harmlessly after it went
    transport.close()
    kept.close()


def test_exit_removes_the_kept_files() -> None:
    """A trainer that exits without close() (os._exit skips nothing of interest here: a plain exit)."""
    code = (
        _ONE_BUCKET
        + """
        transport = shm.Transport()
        transport.send(bucket, tensors, lambda d: paths.append(d.path))
        kept = shm.Transport(keep_segments=True)
        try:
            kept.send(bucket, {}, lambda d: None)
        except KeyError:
            paths.extend(str(s.path) for s in kept._kept.values())
        print(json.dumps({"paths": paths}), flush=True)
    """
    )
    with _process(code) as (proc, report):
        assert proc.wait(30) == 0
        paths = [Path(p) for p in report["paths"]]
        assert len(paths) == 2 and not any(p.exists() for p in paths)
