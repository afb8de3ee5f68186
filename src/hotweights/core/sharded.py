"""One install from every rank of a sharded trainer (FSDP2's ``DTensor`` state dicts), never a full model on one rank.

Every rank calls ``hotweights.install`` with its own ``model.state_dict()``; the rank that passes an engine leads,
the others pass ``engine=None``. The protocol, on one process group:

1. :func:`agree`: every rank all-gathers a digest of its names, global shapes, dtypes and the version, and whether
   it holds the engine. A difference, or not exactly one leader, is the same refusal on every rank, before anything
   is gathered or written.
2. The leader installs from :meth:`Gatherer.placeholders`: ``meta`` tensors of each ``DTensor``'s global shape, so
   names, shapes and dtypes are validated against the engine without reading any data. A tensor is gathered when
   the install reads it (:meth:`Gatherer.load`, bucket by bucket as the transport packs): the leader broadcasts
   its index, then every rank joins the gather. An FSDP2 shard (dim 0, over the group's ranks) is gathered to the
   leader alone (``dist.gather``), so the other ranks allocate nothing; any other layout through ``full_tensor()``.
   The leader keeps the last gathered tensor (the checkpoint tensors a fused one is split into are read one after
   another) and, while the transport packs it, already gathers the next one: two tensors at most. A tensor larger
   than a bucket is gathered in parts of rows instead, and so are the views of one (:meth:`Gatherer.parts_at_most`);
   a view of rows the leader holds is taken of its own shard.
   Because the leader names each gather, the order never has to be agreed in advance, and a gather never
   interleaves with another collective.
3. :meth:`Gatherer.finish` / :func:`follow`: the leader broadcasts the end, then the report (JSON) or the error's
   envelope; every rank returns the same report or raises the same typed error.

Collectives use CPU tensors on a gloo group and the current CUDA device on an NCCL group. Nothing is pickled.
Nothing here imports vLLM. Where each rank's rows are is :mod:`hotweights.core.shards`; the leader's gathers,
:mod:`hotweights.core.gathers`; the ranks' own writes into the leader's buckets, :mod:`hotweights.core.rank_writes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hotweights.core import envelope
from hotweights.core.cast import CastItems
from hotweights.core.errors import (
    HotWeightsError,
    InstallError,
    Mismatch,
    NonFiniteWeightsError,
    UnsupportedLayoutError,
    WeightManifestValidationError,
)
from hotweights.core.finite import nonfinite
from hotweights.core.gathers import Gathers, gather, send_rows
from hotweights.core.manifest import ExpectedWeights, MetadataValue, TensorSpec, WeightUpdateManifest
from hotweights.core.rank_writes import WRITE, OpenFile, RankWrites, write_for_leader
from hotweights.core.report import InstallReport
from hotweights.core.shards import ShardMap, device_of, dtensor_class, local_of, local_view
from hotweights.core.sources import TensorSource, checkpoint_names

log = logging.getLogger("hotweights")

__all__ = ["Gatherer", "agree", "follow", "gathering", "is_sharded", "same_host"]

Items = Sequence[tuple[str, torch.Tensor]]

_END = -1  # the leader's last command: the outcome follows
_BUILTIN = {"ValueError": ValueError, "TypeError": TypeError}  # raised again as themselves on every rank


def is_sharded(items: Items) -> bool:
    """Whether any value of ``items`` is a ``DTensor`` (a sharded trainer's state dict)."""
    cls = dtensor_class()
    return cls is not None and any(isinstance(t, cls) for _, t in items)


def _fingerprint(items: Items, weight_version: int) -> bytes:
    cls = dtensor_class()
    rows = [
        [name, list(t.shape), str(t.dtype), repr(t.placements) if cls is not None and isinstance(t, cls) else None]
        for name, t in items
    ]
    return hashlib.sha256(json.dumps([weight_version, rows]).encode()).digest()


def agree(
    items: Items,
    weight_version: int,
    leads: bool,
    group: Any = None,
    tp: tuple[int, int] | None = None,
    *,
    finite: bool = True,
) -> int:
    """Check, on every rank at once, that all hold the same names, shapes and dtypes and the same version, and that
    exactly one passed an engine; returns that rank (in ``group``). ``tp``: this rank's ``(tp_rank, tp_size)``
    for tensor-parallel chunks, which must be its rank in ``group`` and the group's size. ``finite``: each rank
    also checks its own shards for NaN and Inf, on the device that holds them (no rank gathers anything for it).

    Raises (the same error on every rank, nothing gathered or written):
        WeightManifestValidationError: the ranks' state dicts or versions differ.
        NonFiniteWeightsError: a rank's shards hold NaN or Inf (the ranks named; each logs its own tensors).
        ValueError: no rank, or more than one, passed an engine; or a rank's ``tp`` is not its place in the group.
    """
    world = dist.get_world_size(group)
    placed = tp is None or tp == (dist.get_rank(group), world)
    digest = _fingerprint(items, weight_version)
    bad = nonfinite([(n, local_of(t)) for n, t in items]) if finite else []
    if bad:
        log.warning("hotweights: this rank's shards hold NaN or Inf: %s", "; ".join(map(str, bad[:20])))
    mine = torch.tensor([*digest, int(bool(bad)), int(leads), int(placed)], dtype=torch.uint8, device=device_of(group))
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    misplaced = [i for i, r in enumerate(rows) if not int(r[-1])]
    if misplaced:
        raise ValueError(
            f"WeightLayout(tp_rank, tp_size) must be each rank's place in the group (tp_rank = its rank, tp_size = "
            f"the group's size {world}); rank(s) {misplaced[:8]} passed another. Nothing was written."
        )
    seen = [bytes(r[:-3].cpu().tolist()) for r in rows]
    leaders = [i for i, r in enumerate(rows) if int(r[-2])]
    differ = [i for i, s in enumerate(seen) if s != seen[0]]
    if differ:
        problem = Mismatch(
            "manifest",
            f"rank {differ[0]}",
            expected="the names, global shapes, dtypes and weight_version of rank 0",
            actual=f"other names, shapes, dtypes or weight_version on {len(differ)} rank(s) {differ[:8]}: every rank "
            "passes its state dict of the same model with the same weight_version",
        )
        raise WeightManifestValidationError([problem], context="sharded install")
    if len(leaders) != 1:
        raise ValueError(
            f"a sharded install needs exactly one rank that passes the engine, the others engine=None; "
            f"{len(leaders)} rank(s) passed one ({leaders[:8]}); nothing was written"
        )
    poisoned = [i for i, r in enumerate(rows) if int(r[-3])]
    if poisoned:
        found = [Mismatch("nonfinite", f"rank {i}", "finite values", "NaN or Inf in its shards") for i in poisoned]
        raise NonFiniteWeightsError(found, context="sharded install (each rank's log names its tensors)")
    return leaders[0]


def gathering(
    items: Items, leader: int, group: Any = None, tp_size: int | None = None, *, same_host: bool = False
) -> TensorSource:
    """The leader's source of a sharded install (:class:`Gatherer`): ``items`` as placeholders, each tensor
    gathered from every rank when the install reads it (or written by the rank holding it: ``same_host``)."""
    return Gatherer(items, leader, group, tp_size, same_host=same_host)


def same_host(group: Any = None) -> bool:
    """Whether every rank of ``group`` runs on this host (same host name and boot): a collective, on every rank."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()[:16]
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device_of(group))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return bool(boot) and all(torch.equal(r, mine) for r in rows)


class Gatherer:
    """The leader's source of a sharded install (:class:`~hotweights.core.sources.TensorSource`): placeholders to
    validate and plan with (:class:`~hotweights.core.shards.ShardMap`), and the gather of each tensor when it is
    read (:class:`~hotweights.core.gathers.Gathers`), or its rows written by the ranks holding them
    (:meth:`rank_writes`)."""

    def __init__(
        self, items: Items, leader: int, group: Any = None, tp_size: int | None = None, *, same_host: bool = False
    ) -> None:
        self.same_host = same_host
        """Every rank runs on this host (:func:`same_host`): the ranks can write their own rows (rank writes)."""
        self._items: CastItems | None = None
        self._tp_size = tp_size
        self.shards = ShardMap(items, group)
        """The placeholders, and where each one's rows are."""
        self.channel = Gathers(self.shards, leader, group)
        """The gathers and the commands to every rank."""

    @property
    def gathers(self) -> int:
        """How many gathers were started (one per tensor when the install reads them in order)."""
        return self.channel.gathers

    def update(
        self,
        expected: ExpectedWeights | None,
        weight_version: int,
        *,
        update_id: str | None = None,
        layout: Any = None,
        metadata: Mapping[str, MetadataValue] | None = None,
        digests: bool = False,
    ) -> tuple[CastItems, WeightUpdateManifest]:
        """The update (:class:`~hotweights.core.sources.TensorSource`) of a sharded state dict: names, shapes and
        dtypes from the placeholders, the data gathered when the install reads it. With ``tp_size``, plain tensors
        are tensor-parallel chunks of the engine's checkpoint shapes (each one's cut found from its shape)."""
        if digests:
            raise ValueError(
                "digests=True hashes every tensor before sending, which would gather the whole sharded model first; "
                "install without digests (the engine still checks names, shapes and dtypes). Nothing was written."
            )
        if self._tp_size is not None:
            if expected is None:
                raise UnsupportedLayoutError(
                    "tensor-parallel chunks are gathered into the engine's checkpoint shapes, which are not known "
                    "for this engine; gather them into full tensors (or DTensors) and install those. Nothing was "
                    "written."
                )
            problems = self.cut({n: s.shape for n, s in expected.tensors.items()}, self._tp_size)
            if problems:
                raise WeightManifestValidationError(problems, context="tensor-parallel chunks")
        items = checkpoint_names(expected, self.placeholders())
        lost = self.unresolved(items)
        if lost:
            raise UnsupportedLayoutError(
                f"{len(lost)} tensor(s) of this model ({', '.join(lost[:3])}, ...) are converted to the engine's "
                "names by a copy, not a view, which a sharded install cannot gather tensor by tensor; call "
                "full_tensor() on each DTensor and install from one rank. Nothing was written."
            )
        repeated = sorted(n for n, seen in Counter(n for n, _ in items).items() if seen > 1)
        if repeated:
            raise WeightManifestValidationError(
                [Mismatch("manifest", n, actual="name appears more than once") for n in repeated]
            )
        specs = {n: TensorSpec.of(t) for n, t in items}
        manifest = WeightUpdateManifest.from_specs(
            specs, weight_version=weight_version, update_id=update_id, layout=layout, metadata=metadata
        )
        self._items = CastItems(items, {}, self.load, self)
        return self._items, manifest

    def placeholders(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` with every ``DTensor`` as a ``meta`` tensor of its global shape and dtype."""
        return self.shards.placeholders()

    def cut(self, full: Mapping[str, tuple[int, ...]], size: int) -> list[Mismatch]:
        """Plain tensors as tensor-parallel chunks of ``size`` (:meth:`hotweights.core.shards.ShardMap.cut`); returns
        the tensors that fit no cut."""
        return self.shards.cut(full, size)

    def unresolved(self, items: Items) -> list[str]:
        """Names in ``items`` whose data :meth:`load` cannot find (a conversion that copied)."""
        return self.shards.unresolved(items)

    def load(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The data behind ``tensor``: itself unless it is a placeholder or a view of one; then its ``DTensor`` is
        gathered on every rank (once for consecutive reads of the same one) and the same view is taken of it.
        While the caller packs it, the next sharded tensor is already being gathered."""
        index = self.shards.source(tensor) if tensor.is_meta else None
        if index is None:
            return tensor
        if tensor._base is not None:
            mine = self.shards.view_of_rank(tensor)
            if mine is not None and mine[1] == dist.get_rank(self.channel.group):  # the leader's rows: no gather
                return local_view(self.shards.sources[index][1], mine[2])
            if self.shards.in_parts(index):
                return self.channel.view_of_part(index, tensor)
        full = self.channel.whole(index)
        if tensor._base is None:
            return full
        return full.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())

    def parts_at_most(self, limit: int) -> None:
        """Read a view of a dim-0 shard larger than ``limit`` bytes (an expert of fused MoE experts) from a part of
        about half ``limit`` holding the view's rows (at least those rows), not from the whole tensor. The
        installer passes its bucket size. The leader holds the part read and the next one, posted meanwhile; the
        bucket being packed may still hold views of the one before: 1.5 buckets at most (three times a view's rows
        where those are larger), never the whole fused tensor."""
        self.shards.part_bytes = limit

    def splits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` may travel in parts (:meth:`ShardMap.splits <hotweights.core.shards.ShardMap.splits>`)."""
        return self.shards.splits(tensor)

    def load_rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a placeholder's tensor, gathered alone (:meth:`Gathers.load_rows
        <hotweights.core.gathers.Gathers.load_rows>`)."""
        return self.channel.load_rows(tensor, start, stop)

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        """Who holds which rows of a placeholder (:meth:`ShardMap.shares_of
        <hotweights.core.shards.ShardMap.shares_of>`), for the ranks' writes."""
        return self.shards.shares_of(tensor)

    def view_of_rank(self, tensor: torch.Tensor) -> tuple[int, int, list[list[int]]] | None:
        """The rank whose rows a view holds whole (:meth:`ShardMap.view_of_rank
        <hotweights.core.shards.ShardMap.view_of_rank>`), for the ranks' writes."""
        return self.shards.view_of_rank(tensor)

    def rank_writes(self) -> Any:
        """The leader's side of rank-parallel writes (:mod:`hotweights.core.rank_writes`), where every rank runs on
        this host and the group has more than one rank; else None (every tensor is gathered)."""
        if not self.same_host or self._items is None or dist.get_world_size(self.channel.group) < 2:
            return None
        return RankWrites(self, dict(self._items.source))

    def finish(self, outcome: InstallReport | BaseException) -> None:
        """Tell every rank the install ended, and how (the report, or the error's envelope)."""
        self.channel.drain()
        payload = (
            {"report": outcome.model_dump(mode="json")}
            if isinstance(outcome, InstallReport)
            else {"error": envelope.encode(outcome)}
        )
        self.channel.announce(_END, 0, payload)


def follow(items: Items, leader: int, group: Any = None, open_file: OpenFile | None = None) -> InstallReport:
    """A non-leading rank's side: join each gather the leader names, then return its report or raise its error.

    Raises:
        the leader's error, rebuilt from its envelope (same class and message).
        InstallError: a collective failed (the leader died, or the group broke); what the engine holds is unknown.
    """
    sources = list(items)
    cls = dtensor_class()
    src = dist.get_global_rank(group, leader) if group is not None else leader
    device = device_of(group)
    cmd = torch.empty(3, dtype=torch.int64, device=device)
    try:
        while True:
            dist.broadcast(cmd, src=src, group=group)
            index, start, stop = (int(v) for v in cmd.tolist())
            if index in (_END, WRITE):  # a JSON message of `stop` bytes follows
                data = torch.empty(stop, dtype=torch.uint8, device=device)
                dist.broadcast(data, src=src, group=group)
                if index == _END:
                    break
                message = json.loads(data.cpu().numpy().tobytes().decode())
                if str(dist.get_rank(group)) in message["pieces"]:  # this rank writes its pieces of a bucket
                    write_for_leader(message, sources, leader, group, open_file)
                continue
            source = sources[index][1]  # this rank's part; the leader keeps the tensor
            if start >= 0:  # rows [start, stop) of a dim-0 shard: this rank's share of them
                send_rows(source, start, stop, src, group)
            elif cls is not None and isinstance(source, cls):
                gather(source, src, group, leads=False)
            else:  # a tensor-parallel chunk
                dist.gather(source.contiguous(), None, dst=src, group=group)
    except Exception as exc:
        raise InstallError(
            f"the sharded install broke off: a collective with the leading rank {leader} failed "
            f"({type(exc).__name__}: {exc}). The leader's report says whether anything was written; retry the install "
            "on every rank once the group is whole."
        ) from exc
    outcome = json.loads(data.cpu().numpy().tobytes().decode())
    if "report" in outcome:
        return InstallReport.model_validate(outcome["report"])
    raise _rebuilt(outcome["error"])


def _rebuilt(sealed: dict[str, Any]) -> BaseException:
    """The leader's error on this rank: the same class (hotweights' own, or ValueError/TypeError) and message."""
    builtin = _BUILTIN.get(sealed.get("type", ""))
    if builtin is not None:
        return builtin(sealed.get("message", ""))
    error: HotWeightsError | None = envelope.decode(sealed)
    return error if error is not None else InstallError(f"the leading rank failed: {sealed!r:.300}")
