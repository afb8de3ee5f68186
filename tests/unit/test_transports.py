"""Transports (registry, shm, bytes) and the worker extension's install sessions, without vLLM or an engine."""

from __future__ import annotations

import gc
import json
import os
import stat
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

import hotweights.transports as transports
from hotweights.core.buckets import Bucket, BucketEntry, plan_buckets, unpack
from hotweights.core.errors import HotWeightsError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import (
    EngineLink,
    WeightTransport,
    available_transports,
    make_transport,
    parse_descriptor,
    receiver_for,
    register_transport,
    shm,
    shm_files,
    shm_writes,
)
from hotweights.transports import bytes as bytes_transport
from hotweights.vllm import compat, fixes
from hotweights.vllm.worker import extension as worker_extension
from hotweights.vllm.worker import ops as worker_ops
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension
from hotweights.vllm.worker.session import PROTOCOL, SessionOptions, session_of

DEAD_PID = 999_999_999  # above any kernel's pid_max (at most 2**22), so never a live process


# ---------------------------------------------------------------------------------------------- helpers
def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),  # 256 bytes
        "layer.0.w": torch.randn(8, 8, generator=g),  # 256 bytes
        "layer.0.b": torch.randn(8, generator=g).to(torch.float16),  # 16 bytes
        "step": torch.tensor(41, dtype=torch.int64),  # 0-d, 8 bytes
        "empty": torch.zeros(0, 3),  # zero elements
        "ids": torch.randint(0, 256, (37,), generator=g, dtype=torch.uint8),  # 37 bytes
        "head.weight": torch.randn(4, 8, generator=g),  # 128 bytes
    }


def _manifest(tensors: dict[str, torch.Tensor], update_id: str | None = None) -> WeightUpdateManifest:
    return WeightUpdateManifest.from_state_dict(tensors, weight_version=1, update_id=update_id)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def _kernel() -> tuple[int, ...]:
    release = os.uname().release.split("-")[0]
    return tuple(int(x) for x in release.split(".")[:2] if x.isdigit())


def _mapped_kib(address: int, field: str = "Rss") -> int:
    """``field`` (KiB) of /proc/self/smaps for the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _own_segments() -> list[Path]:
    return sorted(shm_files.SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))


# ---------------------------------------------------------------------------------------------- registry
class TestRegistry:
    def test_builtins_are_registered(self) -> None:
        names = available_transports()
        assert {"shm", "bytes", "collective"} <= set(names)
        assert names == sorted(names)

    def test_make_transport_by_name(self, tmp_path: Path) -> None:
        b = make_transport("bytes")
        assert isinstance(b, bytes_transport.Transport)
        assert isinstance(b, WeightTransport)
        assert b.name == "bytes"
        s = make_transport("shm")
        assert isinstance(s, shm.Transport)
        assert s.name == "shm"

    def test_unknown_name_lists_the_available_ones(self) -> None:
        with pytest.raises(HotWeightsError, match="unknown transport 'nope'") as info:
            make_transport("nope")
        for name in ("shm", "bytes", "collective"):
            assert repr(name) in str(info.value)

    def test_registering_an_existing_name_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"transport 'shm' is already registered \(by hotweights.transports.shm\)"):
            register_transport("shm", "hotweights.transports.bytes")
        assert isinstance(make_transport("shm"), shm.Transport)  # the original registration stands

    def test_registering_a_new_name(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(transports, "_REGISTRY", transports._REGISTRY.copy())
        register_transport("mine", "hotweights.transports.bytes")
        assert "mine" in available_transports()
        assert isinstance(make_transport("mine"), bytes_transport.Transport)
        assert receiver_for("mine") is bytes_transport.Receiver

    def test_engine_side_by_descriptor(self) -> None:
        assert receiver_for(parse_descriptor({"transport": "shm", "path": "x", "nbytes": 0}).transport) is shm.Receiver
        assert receiver_for("bytes") is bytes_transport.Receiver

    @pytest.mark.parametrize("descriptor", [{}, {"transport": 3}, {"path": "/dev/shm/x"}])
    def test_engine_side_without_a_name(self, descriptor: dict[str, Any]) -> None:
        with pytest.raises(HotWeightsError, match="descriptor has no 'transport' name"):
            parse_descriptor(descriptor)

    def test_engine_side_unknown_name(self) -> None:
        with pytest.raises(HotWeightsError, match="unknown transport 'carrier-pigeon'"):
            parse_descriptor({"transport": "carrier-pigeon"})


# ---------------------------------------------------------------------------------------------- shm, kept segments
class _Worker:
    """A worker object for ``open_bucket`` to keep mappings on."""


class _Link(EngineLink):
    """An EngineLink whose one worker is in this process: ``engine_op`` runs the extension's operation on it."""

    releases_buckets_after_stage = False

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @property
    def num_workers(self) -> int:
        return 1

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        self.calls.append((op, args))
        assert op == "release_segments"
        return [worker_extension.ENGINE_OPS[op](self.worker, **json.loads(json.dumps(args)))]  # as JSON crosses


class TestShmKeptSegments:
    def _install(
        self, transport: shm.Transport, worker: _Worker, tensors: dict[str, torch.Tensor], bucket_bytes: int = 300
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """One "install": every bucket through ``transport``; returns copies of what the worker read, and ids."""
        m = _manifest(tensors)
        received: dict[str, torch.Tensor] = {}
        ids: list[str] = []
        for bucket in plan_buckets(m, bucket_bytes=bucket_bytes):

            def stage(descriptor: dict[str, Any], bucket: Bucket = bucket) -> None:
                descriptor = descriptor.to_wire()  # as it crosses the RPC
                ids.append(descriptor["segment"])
                buffer, _ = shm.Receiver.open(shm.Receiver.parse(descriptor), worker)
                received.update({n: t.clone() for n, t in unpack(buffer, bucket, m)})

            transport.send(bucket, tensors, stage)
        return received, ids

    def test_segments_are_reused_across_installs_and_released_on_close(self) -> None:
        worker = _Worker()
        link = _Link(worker)
        transport = shm.Transport(keep_segments=True)
        transport.connect(link)
        a = _tensors()
        b = {n: t + 1 if t.is_floating_point() else t.clone() for n, t in a.items()}
        got_a, ids_a = self._install(transport, worker, a)
        assert _own_segments() == []  # unlinked once the worker mapped them
        got_b, ids_b = self._install(transport, worker, b)
        assert ids_a == ids_b and len(set(ids_a)) == len(ids_a) > 2  # one segment per bucket, the same ones
        _assert_same(got_a, a)
        _assert_same(got_b, b)  # the worker's shared mapping sees the trainer's new bytes
        assert sorted(shm_files.kept_segments(worker)) == sorted(ids_a)
        transport.close()
        assert link.calls == [("release_segments", {"ids": ids_a})]
        assert shm_files.kept_segments(worker) == {}

    def test_one_segment_for_every_bucket_when_the_engine_keeps_no_view(self) -> None:
        worker = _Worker()
        link = _Link(worker)
        link.releases_buckets_after_stage = True  # type: ignore[attr-defined]
        transport = shm.Transport(keep_segments=True)
        transport.connect(link)
        tensors = _tensors()
        got, first = self._install(transport, worker, tensors)  # the stage copies every bucket out
        _assert_same(got, tensors)
        got, ids = self._install(transport, worker, tensors)
        assert len(ids) > 2 and set(ids) == {first[-1]}  # grown once to the largest bucket, then one segment
        _assert_same(got, tensors)
        assert len(shm_files.kept_segments(worker)) == 1  # the outgrown segment was released in the worker too
        transport.close()

    def test_a_failed_stage_drops_the_segment(self) -> None:
        worker = _Worker()
        transport = shm.Transport(keep_segments=True)
        transport.connect(_Link(worker))
        tensors = _tensors()
        _, first = self._install(transport, worker, tensors, bucket_bytes=1 << 20)
        bucket = plan_buckets(_manifest(tensors), bucket_bytes=1 << 20)[0]
        with pytest.raises(RuntimeError, match="worker died"):
            transport.send(bucket, tensors, lambda d: (_ for _ in ()).throw(RuntimeError("worker died")))
        assert shm_files.kept_segments(worker) == {}  # released in the worker too
        _, second = self._install(transport, worker, tensors, bucket_bytes=1 << 20)
        assert first != second
        transport.close()

    def test_a_larger_bucket_gets_a_new_segment(self) -> None:
        worker = _Worker()
        transport = shm.Transport(keep_segments=True)
        transport.connect(_Link(worker))
        _, small = self._install(transport, worker, {"w": torch.ones(4)})
        got, large = self._install(transport, worker, {"w": torch.ones(4), "v": torch.ones(64)})
        assert small != large
        _assert_same(got, {"w": torch.ones(4), "v": torch.ones(64)})
        assert list(shm_files.kept_segments(worker)) == large
        transport.close()

    def test_segment_id_must_match_the_file_name(self) -> None:
        path = f"{shm_files.SHM_DIR}/hotweights-{os.getpid()}-{'a' * 32}"
        for sid in ["b" * 32, "../x", "A" * 32]:
            with pytest.raises(ValueError, match="refusing segment"):
                shm.Receiver.open(
                    shm.Receiver.parse({"transport": "shm", "path": path, "nbytes": 8, "segment": sid}), _Worker()
                )

    def test_segments_of_a_trainer_that_is_gone_are_released(self) -> None:
        worker = _Worker()
        transport = shm.Transport(keep_segments=True)
        _, ids = self._install(transport, worker, {"w": torch.ones(4)})
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)  # a pid that no longer exists
        segments = shm_files.kept_segments(worker)
        segments[ids[0]] = (child, segments[ids[0]][1])
        assert shm_files.release_segments(worker, []) == 1
        assert segments == {}
        transport.close()


# ---------------------------------------------------------------------------------------------- shm
class TestShm:
    def test_round_trip_and_cleanup(self) -> None:
        tensors = _tensors()
        m = _manifest(tensors)
        plan = plan_buckets(m, bucket_bytes=300)
        assert len(plan) > 2
        received: dict[str, torch.Tensor] = {}
        keep: list[Any] = []
        paths: list[Path] = []

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            assert descriptor["transport"] == "shm"
            path = Path(descriptor["path"])
            paths.append(path)
            assert path.parent == shm_files.SHM_DIR
            assert path.name.startswith(f"hotweights-{os.getpid()}-")
            st_ = path.stat()
            assert stat.S_IMODE(st_.st_mode) == 0o600
            assert st_.st_size == max(bucket.nbytes, 1)
            assert descriptor["nbytes"] == bucket.nbytes
            buffer, keepalive = shm.Receiver.open(shm.Receiver.parse(descriptor))
            assert buffer.dtype == torch.uint8
            assert buffer.numel() == bucket.nbytes
            keep.append(keepalive)
            received.update(unpack(buffer, bucket, m))  # views into the mapping, read after the unlink

        with shm.Transport(keep_segments=False) as transport:  # a fresh file per bucket, none reused
            for bucket in plan:
                transport.send(bucket, tensors, stage)
                assert not paths[-1].exists()
        assert len(paths) == len(plan) == len(set(paths))
        assert _own_segments() == []
        assert not set(paths) & shm_files._LIVE
        _assert_same(received, tensors)  # the mappings outlived the files

    @pytest.mark.parametrize("how", ["gathered", "short writes", "copied"])
    def test_every_way_of_writing_a_bucket_gives_the_same_bytes(self, how: str, monkeypatch: Any) -> None:
        tensors = _tensors()
        if how == "copied":  # a non-contiguous tensor: the bucket is copied into a mapping instead of gathered
            tensors["layer.0.w"] = tensors["layer.0.w"].t()
        if how == "short writes":  # 2 views per call, and each call writes at most 100 bytes
            monkeypatch.setattr(shm_writes, "_IOV_MAX", 2)
            real = os.pwritev

            def short(fd: int, views: list[memoryview], off: int) -> int:
                joined = b"".join(bytes(v) for v in views)[:100]
                return real(fd, [memoryview(joined)], off)

            monkeypatch.setattr(shm.os, "pwritev", short)
        m = _manifest(tensors)
        (bucket,) = plan_buckets(m, bucket_bytes=1 << 20)
        received: dict[str, torch.Tensor] = {}

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            buffer, _ = shm.Receiver.open(shm.Receiver.parse(descriptor))
            received.update((n, t.clone()) for n, t in unpack(buffer, bucket, m))

        shm.Transport().send(bucket, tensors, stage)
        _assert_same(received, tensors)

    def test_small_buckets_reuse_their_files_within_the_budget(self, monkeypatch: Any) -> None:
        first, second = _tensors(), {n: t + 1 if t.is_floating_point() else t for n, t in _tensors().items()}
        m = _manifest(first)
        plan = plan_buckets(m, bucket_bytes=300)
        assert len(plan) >= 3
        budget = plan[0].nbytes + plan[1].nbytes  # room for the first two buckets' files, not the third's
        monkeypatch.setattr(shm, "REUSE_BUDGET", budget)

        def install(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[Path]]:
            received: dict[str, torch.Tensor] = {}
            paths: list[Path] = []

            def stage(descriptor: dict[str, Any]) -> None:
                descriptor = descriptor.to_wire()  # as it crosses the RPC
                paths.append(Path(descriptor["path"]))
                buffer, _ = shm.Receiver.open(shm.Receiver.parse(descriptor))
                bucket = plan[len(paths) - 1]
                received.update((n, t.clone()) for n, t in unpack(buffer, bucket, m))

            for bucket in plan:
                transport.send(bucket, tensors, stage)
            return received, paths

        transport = shm.Transport()
        got, paths = install(first)
        _assert_same(got, first)
        kept = [p for p in paths if p.exists()]
        assert kept == paths[:2]  # the first buckets, within the budget
        assert sum(p.stat().st_size for p in kept) == budget
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in kept)
        got, again = install(second)
        _assert_same(got, second)  # rewritten in place with the new values
        assert again[: len(kept)] == kept and not set(again[len(kept) :]) & set(paths)
        transport.close()
        assert _own_segments() == []

    def test_reused_files_go_with_a_failed_stage_and_with_the_transport(self) -> None:
        tensors = _tensors()
        (bucket,) = plan_buckets(_manifest(tensors), bucket_bytes=1 << 20)
        transport = shm.Transport()
        transport.send(bucket, tensors, lambda d: None)
        assert len(_own_segments()) == 1

        def boom(descriptor: dict[str, Any]) -> None:
            raise RuntimeError("worker died")

        with pytest.raises(RuntimeError):
            transport.send(bucket, tensors, boom)
        assert _own_segments() == []  # the worker may have been reading it: not reused
        transport.send(bucket, tensors, lambda d: None)
        assert len(_own_segments()) == 1
        del transport  # garbage-collected: its files go too
        gc.collect()
        assert _own_segments() == []

    def test_a_forked_child_leaves_its_parents_files_alone(self) -> None:
        tensors = _tensors()
        (bucket,) = plan_buckets(_manifest(tensors), bucket_bytes=1 << 20)
        transport = shm.Transport()
        transport.send(bucket, tensors, lambda d: None)
        (kept,) = _own_segments()
        pid = os.fork()
        if pid == 0:  # what a child that inherited the registries runs at its exit (or on close)
            try:
                shm_files._unlink_live()
                transport.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert _own_segments() == [kept]
        transport.close()
        assert _own_segments() == []

    def test_no_reuse_where_shared_memory_is_small(self, monkeypatch: Any) -> None:
        monkeypatch.setattr(shm_files, "SHM_DIR", Path("/nonexistent"))
        assert shm._reuse_budget() == 0

    def test_descriptor_is_plain_data(self) -> None:
        tensors = {"w": torch.ones(4)}
        bucket = plan_buckets(_manifest(tensors), bucket_bytes=1024)[0]
        seen: list[dict[str, Any]] = []
        shm.Transport().send(bucket, tensors, lambda d: seen.append(d.to_wire()))
        (d,) = seen
        assert set(d) == {"transport", "path", "nbytes"}
        assert isinstance(d["path"], str)
        assert d["nbytes"] == 16

    def test_stage_error_propagates_and_removes_the_file(self) -> None:
        tensors = _tensors()
        bucket = plan_buckets(_manifest(tensors), bucket_bytes=1 << 20)[0]
        boom = RuntimeError("worker died")
        paths: list[Path] = []

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            paths.append(Path(descriptor["path"]))
            assert paths[-1].exists()
            raise boom

        with pytest.raises(RuntimeError) as info:
            shm.Transport().send(bucket, tensors, stage)
        assert info.value is boom
        assert len(paths) == 1
        assert not paths[0].exists()
        assert paths[0] not in shm_files._LIVE
        assert _own_segments() == []

    def test_buckets_fit_a_small_shm_filesystem(self, monkeypatch: Any) -> None:
        """128 MiB buckets by default, at most an eighth of SHM_DIR's filesystem (Docker's default 64 MiB
        /dev/shm: 8 MiB, which the adapters' 16 MiB floor raises)."""
        from hotweights.core.buckets import default_bucket_bytes

        real = os.statvfs(shm_files.SHM_DIR)
        assert shm.Transport().preferred_bucket_bytes == min(128 << 20, real.f_blocks * real.f_frsize // 8)

        class Small:
            f_blocks, f_frsize = 64 << 8, 4096  # 64 MiB

        monkeypatch.setattr(shm.os, "statvfs", lambda path: Small())
        small = shm.Transport()
        assert small.preferred_bucket_bytes == 8 << 20
        assert default_bucket_bytes(small.preferred_bucket_bytes) == 16 << 20
        assert shm.Transport.preferred_bucket_bytes == 128 << 20  # the class keeps its own

        class Mine(shm.Transport):
            preferred_bucket_bytes = 4 << 20

        assert Mine().preferred_bucket_bytes == 4 << 20  # a subclass's own size, under the cap

    @pytest.mark.parametrize("kept", [False, True])
    def test_a_bucket_is_mapped_at_its_stage_not_at_the_commit(self, kept: bool) -> None:
        """The worker maps a bucket's pages when it stages it (``MADV_POPULATE_READ``): the commit, inside the
        pause, then reads them without faulting each page in. Read from the mapping's Rss in /proc/self/smaps."""
        if _kernel() < (5, 14):
            pytest.skip("MADV_POPULATE_READ needs Linux 5.14")
        tensors = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB
        m = _manifest(tensors)
        (bucket,) = plan_buckets(m, bucket_bytes=8 << 20)
        rss: list[int] = []

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            buffer, _keepalive = shm.Receiver.open(shm.Receiver.parse(descriptor), _Worker())
            rss.append(_mapped_kib(buffer.data_ptr()))
            assert _mapped_kib(buffer.data_ptr(), "Anonymous") == 0  # mapped, not copied (copy-on-write intact)
            assert torch.equal(dict(unpack(buffer, bucket, m))["w"], tensors["w"])

        with shm.Transport(keep_segments=kept) as transport:
            transport.send(bucket, tensors, stage)
        assert rss == [4096]

    def test_open_bucket_refuses_a_directory_other_than_shm_dir(self, tmp_path: Path) -> None:
        path = tmp_path / f"hotweights-{os.getpid()}-x"
        path.write_bytes(b"\0" * 8)
        with pytest.raises(ValueError, match=r"refusing to map .*: not a hotweights segment in"):
            shm.Receiver.open(shm.Receiver.parse({"transport": "shm", "path": str(path), "nbytes": 8}))

    @pytest.mark.parametrize(
        "name", ["other-file", "xhotweights-1-a", "sub/hotweights-1-a", "../hotweights-1-a", "../tmp/hotweights-1-a"]
    )
    def test_open_bucket_refuses_foreign_paths_before_opening(self, name: str) -> None:
        path = str(shm_files.SHM_DIR) + "/" + name  # none of these exists: opening would raise FileNotFoundError
        with pytest.raises(ValueError, match="refusing to map"):
            shm.Receiver.open(shm.Receiver.parse({"transport": "shm", "path": path, "nbytes": 8}))

    @pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "wrong-name", "outside", "kept-symlink"])
    def test_open_bucket_maps_only_regular_segment_files(self, kind: str, tmp_path: Path) -> None:
        """Engine side: a descriptor names a regular file in SHM_DIR with a segment's own name, or is refused."""
        name = f"hotweights-{os.getpid()}-{'e' * 32}"
        path = shm_files.SHM_DIR / name
        target = tmp_path / "secret"
        target.write_bytes(b"\1" * 64)
        descriptor: dict[str, Any] = {"transport": "shm", "path": str(path), "nbytes": 8}
        try:
            if kind in ("symlink", "kept-symlink"):
                path.symlink_to(target)
                if kind == "kept-symlink":
                    descriptor["segment"] = "e" * 32
            elif kind == "directory":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)  # opening it for reading would block without O_NONBLOCK
            elif kind == "wrong-name":
                descriptor["path"] = str(shm_files.SHM_DIR / f"hotweights-{os.getpid()}-notahexid")
                Path(descriptor["path"]).write_bytes(b"\0" * 8)
            else:
                descriptor["path"] = str(target)
            with pytest.raises(ValueError, match="refusing to map"):
                shm.Receiver.open(shm.Receiver.parse(descriptor), _Worker())
        finally:
            for p in (path, Path(descriptor["path"])):
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()
                elif p != target:
                    p.unlink(missing_ok=True)
        assert target.read_bytes() == b"\1" * 64

    def test_open_bucket_refuses_a_short_file(self) -> None:
        tensors = {"w": torch.arange(10, dtype=torch.int64)}  # 80 bytes
        bucket = plan_buckets(_manifest(tensors), bucket_bytes=1024)[0]

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            shm.Receiver.open(shm.Receiver.parse({**descriptor, "nbytes": 81}))

        with pytest.raises(ValueError, match="holds 80 bytes, the bucket needs 81"):
            shm.Transport().send(bucket, tensors, stage)
        assert _own_segments() == []

    def test_mapping_is_copy_on_write(self) -> None:
        tensors = {"w": torch.arange(16, dtype=torch.uint8)}
        bucket = plan_buckets(_manifest(tensors), bucket_bytes=1024)[0]
        out: list[torch.Tensor] = []

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            first, keep1 = shm.Receiver.open(shm.Receiver.parse(descriptor))
            first.fill_(0xFF)  # a worker writing its copy changes neither the file nor another worker's view
            second, keep2 = shm.Receiver.open(shm.Receiver.parse(descriptor))
            assert Path(descriptor["path"]).read_bytes() == bytes(range(16))
            out.extend([first.clone(), second.clone()])
            del first, second, keep1, keep2

        shm.Transport().send(bucket, tensors, stage)
        assert torch.equal(out[0], torch.full((16,), 0xFF, dtype=torch.uint8))
        assert torch.equal(out[1], tensors["w"])

    def test_zero_byte_bucket(self) -> None:
        tensors = {"big": torch.zeros(100, dtype=torch.uint8), "empty": torch.zeros(0, 4)}
        m = _manifest(tensors)
        plan = plan_buckets(m, bucket_bytes=64)
        assert [b.nbytes for b in plan] == [100, 0]  # the planner really produces an empty bucket
        received: dict[str, torch.Tensor] = {}

        def stage(descriptor: dict[str, Any]) -> None:
            descriptor = descriptor.to_wire()  # as it crosses the RPC
            buffer, _ = shm.Receiver.open(shm.Receiver.parse(descriptor))
            received.update((n, t.clone()) for n, t in unpack(buffer, bucket, m))

        for bucket in plan:
            shm.Transport().send(bucket, tensors, stage)
        _assert_same(received, tensors)

    def test_sweep_stale(self, tmp_path: Path) -> None:
        dead = tmp_path / f"hotweights-{DEAD_PID}-abc"
        mine = tmp_path / f"hotweights-{os.getpid()}-abc"
        odd = tmp_path / "hotweights-notapid-abc"
        other = tmp_path / f"other-{DEAD_PID}-abc"
        for p in (dead, mine, odd, other):
            p.write_bytes(b"x")
        assert shm_files.sweep_stale(tmp_path) == [dead]
        assert not dead.exists()
        assert mine.exists() and odd.exists() and other.exists()
        assert shm_files.sweep_stale(tmp_path) == []


# ---------------------------------------------------------------------------------------------- bytes
class TestBytes:
    def _descriptors(self, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[Bucket, dict[str, Any]]]:
        out: list[tuple[Bucket, dict[str, Any]]] = []
        transport = bytes_transport.Transport()
        for bucket in plan_buckets(_manifest(tensors), bucket_bytes=bucket_bytes):
            transport.send(bucket, tensors, lambda d, b=bucket: out.append((b, d.to_wire())))
        return out

    def test_round_trip(self) -> None:
        tensors = _tensors()
        m = _manifest(tensors)
        sent = self._descriptors(tensors, 300)
        assert len(sent) > 2
        received: dict[str, torch.Tensor] = {}
        for bucket, d in sent:
            assert d["transport"] == "bytes"
            assert d["nbytes"] == bucket.nbytes
            assert isinstance(d["data"], (bytes, bytearray))
            assert len(d["data"]) == bucket.nbytes
            # as msgpack delivers it: immutable bytes
            buffer, _keep = bytes_transport.Receiver.open(
                bytes_transport.Receiver.parse({**d, "data": bytes(d["data"])})
            )
            assert buffer.numel() == bucket.nbytes
            received.update(unpack(buffer, bucket, m))
        _assert_same(received, tensors)

    def test_zero_byte_bucket(self) -> None:
        tensors = {"big": torch.zeros(100, dtype=torch.uint8), "empty": torch.zeros(0, 4)}
        sent = self._descriptors(tensors, 64)
        assert [b.nbytes for b, _ in sent] == [100, 0]
        buffer, _ = bytes_transport.Receiver.open(bytes_transport.Receiver.parse(sent[1][1]))
        assert buffer.numel() == 0
        assert dict(unpack(buffer, sent[1][0], _manifest(tensors)))["empty"].shape == (0, 4)

    @pytest.mark.parametrize(("delta", "got"), [(-1, 87), (1, 89), (-88, 0)])
    def test_refuses_a_payload_of_the_wrong_size(self, delta: int, got: int) -> None:
        tensors = {"w": torch.zeros(11, dtype=torch.int64)}  # 88 bytes
        ((_, d),) = self._descriptors(tensors, 1024)
        data = bytes(d["data"])
        data = data[:delta] if delta < 0 else data + b"\0" * delta
        with pytest.raises(ValueError, match=rf"bytes payload has {got} bytes, the bucket declares 88"):
            bytes_transport.Receiver.open(bytes_transport.Receiver.parse({**d, "data": data}))

    @pytest.mark.parametrize("payload", [None, "x" * 88, list(range(88))])
    def test_refuses_a_payload_that_is_not_bytes(self, payload: Any) -> None:
        d = {"transport": "bytes", "data": payload, "nbytes": 88}
        expected = rf"bytes payload has {type(payload).__name__} bytes, the bucket declares 88"
        with pytest.raises(ValueError, match=expected):
            bytes_transport.Receiver.open(bytes_transport.Receiver.parse(d))


# ---------------------------------------------------------------------------------------------- worker extension
class _Recorder:
    def __init__(self, refreshed: int = 2) -> None:
        self.calls: list[tuple[Any, list[tuple[str, torch.Tensor]]]] = []
        self.refreshed = refreshed

    def __call__(self, worker: Any, items: Any) -> int:
        self.calls.append((worker, [(n, t.clone()) for n, t in items]))
        return self.refreshed


def _core(result: dict[str, int]) -> tuple[int, int, int]:
    """The counts every commit reports (it may report more)."""
    return result["tensors"], result["bytes"], result["tied_layers_refreshed"]


def _options(manifest: WeightUpdateManifest, commit: str = "atomic", method: str = "reload") -> str:
    """``begin``'s options for ``manifest`` (``reload``: these workers have no model for ``auto`` to plan on)."""
    return SessionOptions(manifest=manifest.to_json(), commit=commit, method=method).model_dump_json()  # type: ignore[arg-type]


def _begin(ext: HotWeightsWorkerExtension, manifest: WeightUpdateManifest, **options: str) -> str:
    """Open a session for ``manifest``; its update id."""
    opened = ext.hotweights_begin(_options(manifest, **options))
    assert opened["ok"] is True
    return str(opened["update_id"])


class TestWorkerExtension:
    """Only the public ``hotweights_*`` methods: the session's internals are free to change."""

    @pytest.fixture
    def recorder(self, monkeypatch: pytest.MonkeyPatch) -> _Recorder:
        rec = _Recorder()
        monkeypatch.setattr(worker_ops, "reload_checkpoint_tensors", rec)
        return rec

    @staticmethod
    def _stage(ext: HotWeightsWorkerExtension, update_id: str, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> int:
        results: list[int] = []
        bytes_transport.Transport().send(
            bucket, tensors, lambda d: results.append(ext.hotweights_stage(update_id, bucket.model_dump_json(), d))
        )
        (n,) = results
        return n

    @staticmethod
    def _assert_closed(ext: HotWeightsWorkerExtension, update_id: str) -> None:
        with pytest.raises(RuntimeError, match=rf"no open install session '{update_id}'"):
            ext.hotweights_prepare(update_id)
        with pytest.raises(RuntimeError, match=rf"no open install session '{update_id}'"):
            ext.hotweights_commit(update_id)
        assert ext.hotweights_abort(update_id) is False

    def test_status(self) -> None:
        assert HotWeightsWorkerExtension().hotweights_engine("status") == {
            "hotweights": "hotweights",
            "protocol": PROTOCOL,
            "weights_asleep": False,  # no sleep mode in this process
            "pause_owner": "",
            "delta_copy_bytes": 0,  # no delta copy yet
            "delta_shared_base": "",
            "session": "",  # no install session open
            "expired": [],  # none dropped by a staging expiry
            "architecture": "",  # no model in this process
            "vllm": compat.vllm_version(),
            "device": compat.device_kind(),
            "fixes": list(fixes.apply_vllm_fixes()),
            "vllm_nccl": {},
        }

    def test_full_session_installs_every_tensor_once_in_manifest_order(self, recorder: _Recorder) -> None:
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        plan = plan_buckets(m, bucket_bytes=300)
        assert len(plan) > 2
        ext = HotWeightsWorkerExtension()
        opened = ext.hotweights_begin(_options(m))
        assert opened == {"ok": True, "update_id": "u1", "method": "reload", "reason": opened["reason"]}
        staged = [self._stage(ext, "u1", b, tensors) for b in reversed(plan)]  # any bucket order
        assert staged == [b.nbytes for b in reversed(plan)]
        assert recorder.calls == []  # nothing installed before commit
        result = ext.hotweights_commit("u1")
        assert _core(result) == (len(tensors), sum(b.nbytes for b in plan), 2)
        assert result["install_method"] == "reload"
        ((worker, items),) = recorder.calls
        assert worker is ext
        assert [n for n, _ in items] == list(m.tensors)  # manifest order, each exactly once
        _assert_same(dict(items), tensors)
        self._assert_closed(ext, "u1")
        assert len(recorder.calls) == 1

    def test_prepare_writes_nothing_and_commit_installs_what_it_prepared(self, recorder: _Recorder) -> None:
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        plan = plan_buckets(m, bucket_bytes=300)
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        for b in plan:
            self._stage(ext, "u1", b, tensors)
        assert ext.hotweights_prepare("u1") == []
        assert ext.hotweights_prepare("u1") == []  # prepared once: ready, still nothing written
        assert recorder.calls == []
        with pytest.raises(RuntimeError, match=r"no open install session 'other' on this worker \(open: 'u1'\)"):
            ext.hotweights_prepare("other")
        assert _core(ext.hotweights_commit("u1")) == (len(tensors), sum(b.nbytes for b in plan), 2)
        ((_, items),) = recorder.calls
        assert [n for n, _ in items] == list(m.tensors)
        _assert_same(dict(items), tensors)
        self._assert_closed(ext, "u1")

    def test_session_is_cleared_when_the_reload_fails(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def failing(worker: Any, items: Any) -> int:
            raise RuntimeError("reload failed")

        monkeypatch.setattr(worker_ops, "reload_checkpoint_tensors", failing)
        tensors = {"w": torch.ones(3)}
        m = _manifest(tensors, update_id="u1")
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        self._stage(ext, "u1", plan_buckets(m, bucket_bytes=1024)[0], tensors)
        with pytest.raises(RuntimeError, match="reload failed"):
            ext.hotweights_commit("u1")
        self._assert_closed(ext, "u1")

    def test_stage_for_an_unknown_update_raises(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(3)}
        m = _manifest(tensors, update_id="u1")
        bucket = plan_buckets(m, bucket_bytes=1024)[0]
        ext = HotWeightsWorkerExtension()
        with pytest.raises(RuntimeError, match=r"no open install session 'u1' on this worker \(open: None\)"):
            self._stage(ext, "u1", bucket, tensors)
        _begin(ext, m)
        with pytest.raises(RuntimeError, match=r"no open install session 'other' on this worker \(open: 'u1'\)"):
            self._stage(ext, "other", bucket, tensors)
        with pytest.raises(RuntimeError, match="no open install session 'other'"):
            ext.hotweights_commit("other")
        assert self._stage(ext, "u1", bucket, tensors) == 12  # the real session is unaffected
        assert _core(ext.hotweights_commit("u1")) == (1, 12, 2)

    def test_a_bucket_repeating_staged_tensors_raises(self, recorder: _Recorder) -> None:
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        plan = plan_buckets(m, bucket_bytes=300)
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        self._stage(ext, "u1", plan[0], tensors)
        first_names = [e.name for e in plan[0].entries]
        with pytest.raises(ValueError, match=r"^bucket 0\b.*already staged") as info:
            self._stage(ext, "u1", plan[0], tensors)
        for name in first_names:
            assert repr(name) in str(info.value)
        for b in plan[1:]:
            self._stage(ext, "u1", b, tensors)
        result = ext.hotweights_commit("u1")
        assert result["bytes"] == sum(b.nbytes for b in plan)  # the refused bucket was not counted
        assert [n for n, _ in recorder.calls[0][1]] == list(m.tensors)

    def test_a_bucket_the_manifest_does_not_describe_is_refused_without_staging(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(4), "v": torch.ones(2)}
        m = _manifest(tensors, update_id="u1")
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        bad = Bucket(
            index=0,
            nbytes=72,
            entries=(BucketEntry(name="w", offset=0, nbytes=16), BucketEntry(name="ghost", offset=64, nbytes=8)),
        )
        with pytest.raises(ValueError, match="'ghost' is not in the manifest"):
            self._stage(ext, "u1", bad, {"w": tensors["w"], "ghost": torch.zeros(2)})
        for b in plan_buckets(m, bucket_bytes=1024):  # "w" was not staged by the refused bucket: no "repeat"
            self._stage(ext, "u1", b, tensors)
        assert _core(ext.hotweights_commit("u1")) == (2, 72, 2)

    def test_a_short_buffer_is_refused(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(4)}
        m = _manifest(tensors, update_id="u1")
        bucket = plan_buckets(m, bucket_bytes=1024)[0]
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        short = {"transport": "bytes", "data": b"\0" * 8, "nbytes": 8}  # consistent, but smaller than the bucket
        with pytest.raises(ValueError, match=r"^bucket 0\b.* 8 bytes.* 16"):
            ext.hotweights_stage("u1", bucket.model_dump_json(), short)

    @pytest.mark.parametrize("step", ["prepare", "commit"])
    def test_finish_with_missing_tensors_names_them(self, recorder: _Recorder, step: str) -> None:
        """Both ``prepare`` and ``commit`` (which prepares first) refuse an update that is not all there."""
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        plan = plan_buckets(m, bucket_bytes=300)
        ext = HotWeightsWorkerExtension()
        _begin(ext, m)
        self._stage(ext, "u1", plan[0], tensors)
        missing = [e.name for b in plan[1:] for e in b.entries]
        with pytest.raises(ValueError, match=rf"update u1 is incomplete: {len(missing)} tensors never arrived") as info:
            getattr(ext, f"hotweights_{step}")("u1")
        for name in missing[:5]:
            assert repr(name) in str(info.value)
        for e in plan[0].entries:
            assert repr(e.name) not in str(info.value)
        assert recorder.calls == []  # the model was not touched

    def test_begin_while_open_replaces_the_session(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(4), "v": torch.full((2,), 3.0)}
        m1 = _manifest(tensors, update_id="u1")
        m2 = _manifest(tensors, update_id="u2")
        plan = plan_buckets(m1, bucket_bytes=16)
        assert len(plan) == 2
        ext = HotWeightsWorkerExtension()
        _begin(ext, m1)
        self._stage(ext, "u1", plan[0], tensors)
        assert ext.hotweights_begin(_options(m2))["update_id"] == "u2"
        with pytest.raises(RuntimeError, match=r"no open install session 'u1' on this worker \(open: 'u2'\)"):
            self._stage(ext, "u1", plan[1], tensors)
        assert ext.hotweights_abort("u1") is False
        assert self._stage(ext, "u2", plan[0], tensors) == 16  # not a "repeat": what u1 staged did not carry over
        assert self._stage(ext, "u2", plan[1], tensors) == 8
        assert _core(ext.hotweights_commit("u2")) == (2, 24, 2)
        assert [n for n, _ in recorder.calls[0][1]] == ["w", "v"]
        self._assert_closed(ext, "u1")

    def test_begin_replacing_drops_what_was_staged(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(4), "v": torch.full((2,), 3.0)}
        plan = plan_buckets(_manifest(tensors), bucket_bytes=16)
        ext = HotWeightsWorkerExtension()
        _begin(ext, _manifest(tensors, update_id="u1"))
        self._stage(ext, "u1", plan[0], tensors)
        _begin(ext, _manifest(tensors, update_id="u2"))
        with pytest.raises(ValueError, match=r"2 tensors never arrived: \['w', 'v'\]"):
            ext.hotweights_commit("u2")
        assert recorder.calls == []

    def test_abort(self, recorder: _Recorder) -> None:
        tensors = {"w": torch.ones(4)}
        m = _manifest(tensors, update_id="u1")
        bucket = plan_buckets(m, bucket_bytes=1024)[0]
        ext = HotWeightsWorkerExtension()
        assert ext.hotweights_abort() is False
        assert ext.hotweights_abort("u1") is False
        _begin(ext, m)
        self._stage(ext, "u1", bucket, tensors)
        assert ext.hotweights_abort("other") is False  # another id leaves the session open
        assert ext.hotweights_abort("u1") is True
        self._assert_closed(ext, "u1")
        _begin(ext, m)
        assert ext.hotweights_abort() is True  # no id: whatever is open
        assert ext.hotweights_abort() is False
        assert recorder.calls == []

    def test_sessions_are_per_instance(self) -> None:
        m = _manifest({"w": torch.ones(1)}, update_id="u1")
        a, b = HotWeightsWorkerExtension(), HotWeightsWorkerExtension()
        _begin(a, m)
        assert b.hotweights_abort("u1") is False
        assert a.hotweights_abort("u1") is True


class _RecordingStream:
    """Stands in for a model stream: records what the session hands it (pure session logic, no engine)."""

    builds_aside = False

    def __init__(self) -> None:
        self.fed: list[list[str]] = []
        self.events: list[str] = []

    def feed(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fed.append(list(tensors))

    def prepare(self) -> None:
        pass

    def finish(self) -> int:
        self.events.append("finish")
        return 7

    def abort(self) -> None:
        self.events.append("abort")


class TestStreamingSession:
    @pytest.fixture
    def stream(self, monkeypatch: pytest.MonkeyPatch) -> _RecordingStream:
        from hotweights.vllm.worker import streaming

        stream = _RecordingStream()
        opened: list[tuple[Any, str]] = []

        def open_stream(worker: Any, manifest: WeightUpdateManifest, method: str, **_: Any) -> _RecordingStream:
            opened.append((worker, method))
            return stream

        monkeypatch.setattr(streaming, "open_stream", open_stream)
        stream.opened = opened  # type: ignore[attr-defined]
        return stream

    def test_each_bucket_is_fed_when_staged_and_finish_closes(
        self, stream: _RecordingStream, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        recorder = _Recorder()
        monkeypatch.setattr(worker_ops, "reload_checkpoint_tensors", recorder)
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        plan = plan_buckets(m, bucket_bytes=300)
        ext = HotWeightsWorkerExtension()
        _begin(ext, m, commit="streaming", method="direct")
        assert stream.opened == [(ext, "direct")]  # type: ignore[attr-defined]
        for b in plan:
            TestWorkerExtension._stage(ext, "u1", b, tensors)
        assert stream.fed == [[e.name for e in b.entries] for b in plan]  # bucket by bucket, nothing kept aside
        staging = session_of(ext).staging
        assert staging.session is not None and staging.session.staged == {}
        result = ext.hotweights_commit("u1")
        assert result["tied_layers_refreshed"] == 7 and result["tensors"] == len(tensors)
        assert stream.events == ["finish"]
        assert recorder.calls == []  # the staged path's reload never ran
        TestWorkerExtension._assert_closed(ext, "u1")

    def test_finish_with_missing_tensors_refuses_and_abort_reaches_the_stream(self, stream: _RecordingStream) -> None:
        tensors = _tensors()
        m = _manifest(tensors, update_id="u1")
        first = plan_buckets(m, bucket_bytes=300)[0]
        ext = HotWeightsWorkerExtension()
        _begin(ext, m, commit="streaming")
        TestWorkerExtension._stage(ext, "u1", first, tensors)
        with pytest.raises(ValueError, match="incomplete"):
            ext.hotweights_prepare("u1")
        with pytest.raises(ValueError, match="incomplete"):
            ext.hotweights_commit("u1")
        assert stream.events == []  # still open: the trainer aborts it
        assert ext.hotweights_abort("u1") is True
        assert stream.events == ["abort"]
        TestWorkerExtension._assert_closed(ext, "u1")

    def test_a_new_begin_aborts_an_open_stream(self, stream: _RecordingStream) -> None:
        ext = HotWeightsWorkerExtension()
        _begin(ext, _manifest({"w": torch.ones(2)}, update_id="u1"), commit="streaming")
        _begin(ext, _manifest({"w": torch.ones(2)}, update_id="u2"))
        assert stream.events == ["abort"]

    def test_unknown_commit_mode_is_refused(self) -> None:
        ext = HotWeightsWorkerExtension()
        with pytest.raises(pydantic.ValidationError):  # the trainer's side cannot even build such options
            SessionOptions(manifest=_manifest({"w": torch.ones(2)}).to_json(), commit="eventual")  # type: ignore[arg-type]
        options = json.dumps({"manifest": _manifest({"w": torch.ones(2)}).to_json(), "commit": "eventual"})
        with pytest.raises(
            ValueError, match=r"malformed session options: 1 error\(s\): .*'commit'.*'atomic' or 'streaming'"
        ) as info:
            ext.hotweights_begin(options)
        assert not isinstance(info.value, pydantic.ValidationError)  # a refusal, not a raw library error
        assert "'eventual'" in str(info.value)
        assert session_of(ext).staging.session is None
