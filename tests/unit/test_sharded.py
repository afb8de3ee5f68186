"""The sharded-install protocol (``hotweights.core.sharded``) on two real gloo processes, without an engine.

The leader reads placeholders through :class:`Gatherer.load` the way an install does (views of a fused tensor
included) and ends with a report or an error; the other rank follows. Real ``DTensor`` shards, a real process group.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hotweights.core.errors import (
    InstallError,
    NonFiniteWeightsError,
    StaleWeightVersionError,
    WeightManifestValidationError,
)
from hotweights.core.report import InstallReport
from hotweights.core.sharded import Gatherer, agree, follow, is_sharded
from hotweights.core.shards import cut_of
from hotweights.transports.shm_writes import opened_for_writes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state() -> list[tuple[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    fused = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    rows = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)  # chunks of 4 and 3 rows: padded to 4
    cols = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)  # sharded on dim 1: through full_tensor()
    return [
        ("fused", distribute_tensor(fused, mesh, [Shard(0)])),
        ("rows", distribute_tensor(rows, mesh, [Shard(0)])),
        ("cols", distribute_tensor(cols, mesh, [Shard(1)])),
        ("plain", torch.ones(5)),
    ]


def _report(version: int) -> InstallReport:
    return InstallReport(
        update_id="u",
        weight_version=version,
        previous_version=None,
        adapter="test",
        num_tensors=3,
        num_bytes=0,
        prefix_cache_reset=True,
    )


def _run(rank: int, port: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: dict[str, Any] = {}
    items = _state()
    out["sharded"] = is_sharded(items) and not is_sharded([("plain", torch.ones(2))])

    # 1. An install that reads views of the fused tensor, then the rows, then a report: same on both ranks.
    leader = agree(items, 5, rank == 0)
    if rank == 0:
        g = Gatherer(items, leader)
        ph = dict(g.placeholders())
        views = [("e1.up", ph["fused"][1].chunk(2, dim=0)[1]), ("e2.t", ph["fused"][2].t()), ("rows", ph["rows"])]
        views.append(("cols", ph["cols"]))
        assert g.unresolved(views) == []
        assert g.unresolved([("copy", ph["fused"].transpose(0, 1).contiguous())]) == ["copy"]
        full = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
        got = [g.load(n, t) for n, t in views] + [g.load("plain", ph["plain"])]
        out["values"] = [
            torch.equal(got[0], full[1].chunk(2, dim=0)[1]),
            torch.equal(got[1], full[2].t()),
            torch.equal(got[2], torch.arange(21, dtype=torch.float32).reshape(7, 3)),
            torch.equal(got[3], torch.arange(24, dtype=torch.float32).reshape(4, 6)),
            got[4] is ph["plain"],
        ]
        out["gathers"] = g.gathers
        g.finish(_report(5))
        out["report"] = 5
    else:
        out["report"] = follow(items, leader).weight_version

    # 1b. Views of a fused tensor larger than the parts bound: read from parts of the rows they span (one row of
    # 192 bytes here, two for the view across the ranks), each gathered alone; never the whole tensor.
    from hotweights.core import gathers

    parts: list[tuple[int, int]] = []
    original = gathers.gather_rows

    def gather_rows(tensor: Any, start: int, stop: int, group: Any, index: int) -> Any:
        parts.append((start, stop))
        return original(tensor, start, stop, group, index)

    gathers.gather_rows = gather_rows  # type: ignore[assignment]
    leader = agree(items, 6, rank == 0)
    if rank == 0:
        g = Gatherer(items, leader)
        g.parts_at_most(200)
        fused = dict(g.placeholders())["fused"]
        views = [fused[e, h * 3 : h * 3 + 3] for e in range(4) for h in (0, 1)] + [fused[1:3].transpose(1, 2)]
        full = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
        wanted = [full[e, h * 3 : h * 3 + 3] for e in range(4) for h in (0, 1)] + [full[1:3].transpose(1, 2)]
        out["parts_values"] = [
            torch.equal(g.load(f"v{i}", v), w) for i, (v, w) in enumerate(zip(views, wanted, strict=True))
        ]
        g.finish(_report(6))
    else:
        follow(items, leader)
    gathers.gather_rows = original  # type: ignore[assignment]
    out["parts"] = parts

    # 2. The leader's typed error reaches the other rank as the same class and message.
    for error in (StaleWeightVersionError(7, 9), ValueError("bad option; nothing was written")):
        leader = agree(items, 7, rank == 0)
        try:
            if rank == 0:
                Gatherer(items, leader).finish(error)
                raise error
            follow(items, leader)
        except Exception as exc:
            out.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")

    # 3. Disagreement and a missing leader: the same refusal on both ranks.
    for version, leads in ((8 + rank, rank == 0), (8, False)):
        try:
            agree(items, version, leads)
        except (WeightManifestValidationError, ValueError) as exc:
            out.setdefault("refusals", []).append(type(exc).__name__)
    # 3b. A NaN in the other rank's shard: found where it lives, the same refusal on both ranks; allowed, it agrees.
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = torch.zeros(7, 3)
    rows[6, 0] = float("nan")  # in rank 1's chunk (rows 4-6)
    poisoned = [items[0], ("rows", distribute_tensor(rows, items[0][1].device_mesh, [Shard(0)])), *items[2:]]
    try:
        agree(poisoned, 9, rank == 0)
    except NonFiniteWeightsError as exc:
        out["nonfinite"] = [(m.kind, m.name) for m in exc.mismatches]
    out["allowed"] = agree(poisoned, 9, rank == 0, finite=False)
    # 4. Tensor-parallel chunks (plain tensors): rows cut on dim 0 (4 and 3 + 1 padding row), cols cut on dim 1.
    full_rows = torch.arange(21, dtype=torch.float32).reshape(7, 3)
    full_cols = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows = torch.cat([full_rows, torch.full((1, 3), -1.0)])[4 * rank : 4 * rank + 4]
    chunks = [("rows", rows), ("cols", full_cols[:, 3 * rank : 3 * rank + 3]), ("norm", torch.ones(3))]
    leader = agree(chunks, 9, rank == 0, tp=(rank, 2))
    if rank == 0:
        g = Gatherer(chunks, leader)
        problems = g.cut({"rows": (7, 3), "cols": (4, 6), "norm": (3,)}, 2)
        ph = dict(g.placeholders())
        got = [g.load(n, ph[n]) for n in ("rows", "cols", "norm")]
        # a chunk cut along dim 0 is read in rows like a dim-0 shard (rows 2-3 its own, 4-6 from rank 1)
        shares = g.shares_of(ph["rows"]), g.shares_of(ph["cols"])
        part = g.load_rows(ph["rows"], 2, 7)
        out["cut"] = [
            problems == [],
            torch.equal(got[0], full_rows),
            torch.equal(got[1], full_cols),
            got[2] is ph["norm"],
            shares == ((0, [(0, 0, 4), (1, 4, 7)], 0), (1, [(0, 0, 3), (1, 3, 6)], 1)),
            torch.equal(part, full_rows[2:7]),
        ]
        g.finish(_report(9))
    else:
        follow(chunks, leader)
    try:
        agree(chunks, 9, rank == 0, tp=(0, 2))  # both ranks claim tp_rank 0
    except ValueError as exc:
        out["misplaced"] = str(exc)

    # 5. Rank writes: every rank writes what it holds of whole tensors straight into the leader's bucket files
    # (experts of the fused tensor, a dim-0 shard, chunks cut along dim 0 and dim 1); the rest is gathered.
    truth = {"e1": torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)[1], "rows": full_rows}
    truth.update(e2=truth["e1"] + 48, cols=torch.arange(24, dtype=torch.float32).reshape(4, 6), plain=torch.ones(5))
    # Version 14: cast to bfloat16 by the ranks as they write (``cast="engine"`` into a bfloat16 engine), into fresh
    # files (a transport that reuses none: each removed once every bucket is staged).
    runs = [(10, items, ("e1", "e2", "rows", "cols", "plain"), None), (11, chunks, ("rows", "cols"), None)]
    for version, source, names, dtype in [*runs, (14, items, ("e1", "e2", "rows"), torch.bfloat16)]:
        leader = agree(source, version, rank == 0, tp=(rank, 2) if source is chunks else None)
        if rank == 0:
            cut = {"rows": (7, 3), "cols": (4, 6)} if source is chunks else None
            expected = {**truth, "cols": full_cols}
            if dtype is not None:
                expected = {n: t.to(dtype) for n, t in expected.items()}
            fresh = dtype is not None
            out[f"writes{version}"] = _lead_rank_writes(source, leader, names, expected, cut, dtype=dtype, fresh=fresh)
        else:
            follow(source, leader, open_file=opened_for_writes)
    # ... a rank that cannot write fails the leader's install at that bucket, typed; and an engine that refuses a
    # bucket (staged while the ranks write the next one) fails it too: every rank ends alike, nobody left waiting.
    for version, names, refuse in ((12, ("rows",), False), (13, ("e1", "e2", "rows"), True)):
        leader = agree(items, version, rank == 0)
        try:
            if rank == 0:
                _lead_rank_writes(items, leader, names, truth, refuse_stage=refuse)
            else:
                follow(items, leader, open_file=opened_for_writes if refuse else _refused)
        except (InstallError, ValueError) as exc:
            out.setdefault("write_errors", []).append(f"{type(exc).__name__}: {exc}")
    results[rank] = out
    dist.destroy_process_group()


def _refused(path: str) -> Any:
    raise PermissionError(f"no write access to {path}")


def _lead_rank_writes(
    source: Any,
    leader: int,
    names: Any,
    full: dict[str, torch.Tensor],
    cut: dict[str, Any] | None = None,
    *,
    refuse_stage: bool = False,
    dtype: torch.dtype | None = None,
    fresh: bool = False,
) -> list[Any]:
    """The leader's side of a rank-writes install of ``names`` (views of the placeholders; ``cut``: the full shapes
    of tensor-parallel chunks), read back from each bucket file at its stage: (name, equal to the whole tensor,
    bucket written by the ranks) each, in order. ``refuse_stage``: the engine refuses the first bucket; ``dtype``:
    the engine's, the tensors cast to it; ``fresh``: a file per bucket, none kept (then none is left either)."""
    from hotweights.core.buckets import unpack
    from hotweights.core.manifest import WeightUpdateManifest
    from hotweights.core.rank_writes import RankWrites
    from hotweights.transports.shm import Receiver, Transport
    from hotweights.transports.shm_files import SHM_DIR

    g = Gatherer(source, leader)
    if cut is not None:
        g.cut(cut, 2)
    ph = dict(g.placeholders())
    views = {"e1": lambda: ph["fused"][1], "e2": lambda: ph["fused"][2]}
    tensors = {n: views[n]() if n in views else ph[n] for n in names}
    manifest = WeightUpdateManifest.from_state_dict(
        {n: torch.empty(t.shape, dtype=dtype or t.dtype) for n, t in tensors.items()}, weight_version=1
    )
    writes = RankWrites(g, tensors)
    plan = writes.plan(manifest, bucket_bytes=200)
    seen: list[Any] = []
    transport = Transport(keep_segments=False if fresh else None)

    def stage(bucket: Any) -> Any:
        def staged(descriptor: Any) -> None:
            if refuse_stage:
                raise ValueError(f"bucket {bucket.index} refused before receiving")
            buffer, _ = Receiver.open(Receiver.parse(descriptor))
            for name, tensor in unpack(buffer, bucket, manifest):
                seen.append((name, torch.equal(tensor, full[name]), writes.owner[bucket.index] != -1))

        return staged

    try:
        writes.transfer(
            plan,
            lambda b: transport.send(b, {e.name: g.load(e.name, tensors[e.name]) for e in b.entries}, stage(b)),
            transport.written,
            lambda b, descriptor: stage(b)(descriptor),
        )
        g.finish(_report(1))
    except BaseException as exc:
        g.finish(exc)
        raise
    finally:
        transport.close()
    if fresh:  # every bucket file was removed once the transfer ended
        seen.append(("left", sorted(p.name for p in SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))))
    return seen


def test_leader_gathers_views_and_every_rank_ends_alike() -> None:
    pytest.importorskip("torch.distributed.tensor")
    results = mp.Manager().dict()
    mp.spawn(_run, args=(_port(), results), nprocs=2, join=True)
    lead, other = results[0], results[1]
    assert lead["sharded"] and other["sharded"]
    assert lead["values"] == [True, True, True, True, True]
    assert lead["gathers"] == 3  # fused (read twice in a row: gathered once), rows, cols; never the plain tensor
    assert lead["report"] == other["report"] == 5
    assert lead["parts_values"] == [True] * 9
    # rows 0-1 are the leader's own (views of its shard); rows 2, then 3 (posted while row 2 was read), then 1-3 for
    # the view across the ranks, then 3 again (posted as the next part, unused): never a whole-tensor gather
    assert lead["parts"] == [(2, 3), (3, 4), (1, 3), (3, 4)], lead["parts"]
    assert lead["errors"] == other["errors"]
    assert other["errors"][0].startswith("StaleWeightVersionError: weight_version 7 is not newer")
    assert other["errors"][1] == "ValueError: bad option; nothing was written"
    assert lead["refusals"] == other["refusals"] == ["WeightManifestValidationError", "ValueError"]
    assert lead["nonfinite"] == other["nonfinite"] == [("nonfinite", "rank 1")]
    assert lead["allowed"] == other["allowed"] == 0
    assert lead["cut"] == [True] * 6
    assert lead["misplaced"] == other["misplaced"] and "rank(s) [1]" in other["misplaced"]
    # rank writes: the shards', views' and dim-0/dim-1 chunks' bytes land whole in the leader's files; only the
    # dim-1 DTensor and the plain tensor travel as gathered (by the leader, first)
    assert lead["writes10"] == [
        ("cols", True, False),
        ("plain", True, False),
        ("e1", True, True),
        ("e2", True, True),
        ("rows", True, True),
    ], lead["writes10"]
    assert lead["writes11"] == [("rows", True, True), ("cols", True, True)], lead["writes11"]
    assert lead["writes14"] == [("e1", True, True), ("e2", True, True), ("rows", True, True), ("left", [])]
    assert lead["write_errors"] == other["write_errors"]
    assert lead["write_errors"][0].startswith(
        "InstallError: rank 1 could not write its rows of bucket 0: PermissionError: no write"
    )
    assert "set HOTWEIGHTS_RANK_WRITES=0 on every rank" in lead["write_errors"][0]  # what to do
    assert lead["write_errors"][1] == "ValueError: bucket 0 refused before receiving"


def test_a_chunk_shape_names_its_cut() -> None:
    assert cut_of((4, 3), (7, 3), 2) == 0  # the last chunk padded
    assert cut_of((4, 3), (4, 6), 2) == 1
    assert cut_of((3,), (3,), 2) is None  # replicated
    for local in ((2, 3), (4, 2), (8, 3)):
        with pytest.raises(ValueError, match="tensor-parallel chunks"):
            cut_of(local, (7, 3) if local[1] == 3 else (4, 6), 2)


def test_which_calls_are_collective() -> None:
    """A call joins the other ranks when it has no engine, a group, a tensor-parallel layout or DTensor values; a
    plain install from the engine's process never waits for other ranks."""
    from hotweights import WeightLayout
    from hotweights._install import _collective

    plain = [("w", torch.ones(2))]
    engine = object()
    assert not _collective(engine, plain, {})
    assert not _collective(engine, plain, {"layout": WeightLayout()})
    assert _collective(None, plain, {})
    assert _collective(engine, plain, {"group": object()})
    assert _collective(engine, plain, {"layout": WeightLayout(tp_rank=1, tp_size=2)})
