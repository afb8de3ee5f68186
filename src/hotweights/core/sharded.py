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
Nothing here imports vLLM.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import socket
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

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
from hotweights.core.manifest import ExpectedWeights, MetadataValue, TensorSpec, WeightUpdateManifest
from hotweights.core.rank_writes import WRITE, OpenFile, RankWrites, write_for_leader
from hotweights.core.report import InstallReport
from hotweights.core.sources import TensorSource, checkpoint_names

log = logging.getLogger("hotweights")

__all__ = ["Gatherer", "agree", "follow", "gathering", "is_sharded", "same_host"]

Items = Sequence[tuple[str, torch.Tensor]]

_END = -1  # the leader's last command: the outcome follows
_BUILTIN = {"ValueError": ValueError, "TypeError": TypeError}  # raised again as themselves on every rank


def _dtensor() -> type[Any] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return None
    return DTensor


def is_sharded(items: Items) -> bool:
    """Whether any value of ``items`` is a ``DTensor`` (a sharded trainer's state dict)."""
    cls = _dtensor()
    return cls is not None and any(isinstance(t, cls) for _, t in items)


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(items: Items, weight_version: int) -> bytes:
    cls = _dtensor()
    rows = [
        [name, list(t.shape), str(t.dtype), repr(t.placements) if cls is not None and isinstance(t, cls) else None]
        for name, t in items
    ]
    return hashlib.sha256(json.dumps([weight_version, rows]).encode()).digest()


def _rows_per_rank(tensor: Any, group: Any) -> int | None:
    """Rows of each rank's chunk when ``tensor`` is sharded on dim 0 over exactly ``group``'s ranks in order (FSDP2's
    layout): then the leader gathers the chunks alone. None: any other layout, gathered with ``full_tensor()``."""
    mesh, placements = tensor.device_mesh, tensor.placements
    world = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, i) for i in range(world)] if group is not None else list(range(world))
    if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != ranks or len(placements) != 1:
        return None
    if not placements[0].is_shard(dim=0) or tensor.dim() == 0:
        return None
    rows: int = tensor.shape[0]
    return -(-rows // world)  # torch.chunk's chunk size, which Shard(0) and FSDP2 follow


class _Posted(NamedTuple):
    """A gather the leader started: the tensor it fills (ready once ``work`` is done; None: already ready)."""

    source: int
    full: torch.Tensor
    work: Any
    local: torch.Tensor | None  # this rank's padded chunk, kept alive until the gather is done
    assemble: Callable[[], torch.Tensor] | None = None  # the tensor from the chunks, once they are in

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.full if self.assemble is None else self.assemble()


def _gather(tensor: Any, dst: int, group: Any, index: int = -1, *, leads: bool) -> _Posted | None:
    """Start gathering ``tensor``'s full value on the leader (returned there, None elsewhere). A dim-0 shard goes to
    the leader alone, asynchronously, into one buffer whose first rows are the tensor (the other ranks allocate
    nothing and wait for their send); any other layout: ``full_tensor()``, at once."""
    chunk = _rows_per_rank(tensor, group)
    if chunk is None:
        full = tensor.full_tensor()
        return _Posted(index, full.contiguous(), None, None) if leads else None
    local = tensor.to_local().contiguous()
    if local.shape[0] < chunk:  # the last ranks' chunks are shorter (or empty): pad to the common size
        local = torch.cat([local, local.new_zeros((chunk - local.shape[0], *local.shape[1:]))])
    if not leads:
        dist.gather(local, None, dst=dst, group=group)
        return None
    world = dist.get_world_size(group)
    buffer = torch.empty((world * chunk, *tensor.shape[1:]), dtype=tensor.dtype, device=local.device)
    work = dist.gather(local, list(torch.split(buffer, chunk)), dst=dst, group=group, async_op=True)
    return _Posted(index, buffer[: tensor.shape[0]], work, local)  # torch.chunk fills the first ranks first


def _chunk_rows(tensor: Any, group: Any, dim: int = 0) -> int:
    """Rows of each rank's chunk of a dim-0 shard: an FSDP2 ``DTensor`` (:func:`_rows_per_rank`), or a plain
    tensor-parallel chunk cut along ``dim`` (every rank's as large, the last one padded)."""
    cls = _dtensor()
    if cls is None or not isinstance(tensor, cls):
        return int(tensor.shape[dim])
    chunk = _rows_per_rank(tensor, group)
    assert chunk is not None
    return chunk


def _local(tensor: Any) -> torch.Tensor:
    """This rank's own tensor: a ``DTensor``'s local shard, or a plain chunk itself."""
    cls = _dtensor()
    local: torch.Tensor = tensor.to_local() if cls is not None and isinstance(tensor, cls) else tensor
    return local


def _shares(tensor: Any, start: int, stop: int, group: Any, dim: int = 0) -> list[tuple[int, int, int]]:
    """Who holds rows ``[start, stop)`` (global rows of ``dim``, ``stop`` at most the tensor's) of a dim-0 shard or
    of a chunk: (group rank, first row, end row)."""
    chunk = _chunk_rows(tensor, group, dim)
    world = dist.get_world_size(group)
    spans = [(r, max(start, r * chunk), min(stop, (r + 1) * chunk)) for r in range(world)]
    return [(r, lo, hi) for r, lo, hi in spans if lo < hi]


def local_rows(tensor: Any, start: int, stop: int, group: Any, dim: int = 0) -> torch.Tensor:
    """Rows ``[start, stop)`` (global rows of ``dim``) of a dim-0 shard or of a chunk that this rank holds, as a
    view of its own tensor; ``ValueError`` when it does not hold them all."""
    first = dist.get_rank(group) * _chunk_rows(tensor, group, dim)
    local = _local(tensor)
    if not first <= start < stop <= first + local.shape[dim]:
        held = f"[{first}, {first + local.shape[dim]})"
        raise ValueError(f"rows [{start}, {stop}) of dim {dim} are not this rank's (it holds {held})")
    return local.narrow(dim, start - first, stop - start)


def _last(size: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """The last element (storage offset) a view of ``size`` and ``stride`` from ``offset`` reaches."""
    return offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n > 0)


def local_view(tensor: Any, view: Sequence[Sequence[int]]) -> torch.Tensor:
    """A view ``[size, stride, [offset]]`` (:meth:`Gatherer.view_of_rank`) of this rank's local shard of ``tensor``;
    ``ValueError`` when it does not lie inside that shard."""
    size, stride, (offset,) = view
    local: torch.Tensor = tensor.to_local()
    if not local.is_contiguous() or offset < 0 or _last(size, stride, offset) >= local.numel():
        raise ValueError(f"the view {list(view)} is not inside this rank's shard (shape {tuple(local.shape)})")
    return local.as_strided(list(size), list(stride), local.storage_offset() + offset)


def _send_rows(tensor: Any, start: int, stop: int, dst: int, group: Any) -> None:
    """A non-leading rank's share of rows ``[start, stop)``, sent to the leader (nothing when it holds none)."""
    me = dist.get_rank(group)
    for r, lo, hi in _shares(tensor, start, stop, group):
        if r == me:
            dist.send(local_rows(tensor, lo, hi, group).contiguous(), dst=dst, group=group)


def _gather_rows(tensor: Any, start: int, stop: int, group: Any, index: int) -> _Posted:
    """Start gathering rows ``[start, stop)`` of a dim-0 shard on the leader (this rank): each rank's share is
    received into its place, so the leader holds that part and nothing more."""
    me = dist.get_rank(group)
    out = torch.empty((stop - start, *tensor.shape[1:]), dtype=tensor.dtype, device=_local(tensor).device)
    works = []
    for r, lo, hi in _shares(tensor, start, stop, group):
        if r == me:
            out[lo - start : hi - start].copy_(local_rows(tensor, lo, hi, group))
        else:
            src = dist.get_global_rank(group, r) if group is not None else r
            works.append(dist.irecv(out[lo - start : hi - start], src=src, group=group))
    return _Posted(index, out, _Works(works), None)


class _Works:
    """Several receives, waited for together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _gather_cut(local: torch.Tensor, dim: int, shape: tuple[int, ...], dst: int, group: Any, index: int) -> _Posted:
    """Start gathering equal per-rank chunks of a tensor cut along ``dim`` (a tensor-parallel shard, the last
    chunk padded) on the leader: the chunks side by side along ``dim``, the padding cut off."""
    local = local.contiguous()
    world = dist.get_world_size(group)
    buffer = torch.empty((world, *local.shape), dtype=local.dtype, device=local.device)
    work = dist.gather(local, list(buffer.unbind(0)), dst=dst, group=group, async_op=True)
    if dim == 0:  # the chunks are already side by side
        return _Posted(index, buffer.view(world * local.shape[0], *local.shape[1:])[: shape[0]], work, local)

    def assemble() -> torch.Tensor:
        return torch.cat(list(buffer.unbind(0)), dim=dim).narrow(dim, 0, shape[dim]).contiguous()

    return _Posted(index, buffer, work, local, assemble)


def cut_of(local: tuple[int, ...], full: tuple[int, ...], size: int) -> int | None:
    """The dimension along which a tensor of shape ``full`` was cut into ``size`` equal chunks of shape ``local``
    (the last one padded), or None where it was not cut (``local == full``).

    Raises:
        ValueError: ``local`` is no such chunk of ``full``.
    """
    if local == full:
        return None
    cut = [d for d, (a, b) in enumerate(zip(local, full, strict=False)) if a != b]
    if len(local) == len(full) and len(cut) == 1:
        d = cut[0]
        if local[d] * (size - 1) < full[d] <= local[d] * size:
            return d
    raise ValueError(f"shape {local} is not one of {size} tensor-parallel chunks of the engine's {full}")


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
    bad = nonfinite([(n, _local(t)) for n, t in items]) if finite else []
    if bad:
        log.warning("hotweights: this rank's shards hold NaN or Inf: %s", "; ".join(map(str, bad[:20])))
    mine = torch.tensor([*digest, int(bool(bad)), int(leads), int(placed)], dtype=torch.uint8, device=_device(group))
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
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=_device(group))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return bool(boot) and all(torch.equal(r, mine) for r in rows)


class Gatherer:
    """The leader's side: placeholders to validate and plan with, and the gather of each tensor when it is read."""

    def __init__(
        self, items: Items, leader: int, group: Any = None, tp_size: int | None = None, *, same_host: bool = False
    ) -> None:
        cls = _dtensor()
        self.same_host = same_host
        """Every rank runs on this host (:func:`same_host`): the ranks can write their own rows (rank writes)."""
        self._items: CastItems | None = None
        self._tp_size = tp_size
        self._sources = list(items)
        self._group = group
        self._src = dist.get_global_rank(group, leader) if group is not None else leader
        self._device = _device(group)
        self._index: dict[int, int] = {}  # id(placeholder) -> index of its DTensor in items
        self._placeholders: list[tuple[str, torch.Tensor]] = []
        for i, (name, t) in enumerate(self._sources):
            if cls is not None and isinstance(t, cls):
                meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                self._index[id(meta)] = i
                t = meta
            self._placeholders.append((name, t))
        self._cuts: dict[int, tuple[int, tuple[int, ...]]] = {}  # index -> (dim, full shape) of a plain chunk
        self._sharded = sorted(self._index.values())
        self._held: tuple[int, torch.Tensor] | None = None
        self._ahead: _Posted | None = None
        self._ahead_rows: tuple[int, int] | None = None  # the part ``_ahead`` holds (None: a whole tensor)
        self._split: set[int] = set()  # tensors read in parts
        self._part_bytes: int | None = None  # views of a dim-0 shard larger than this are read in parts
        self._held_part: tuple[int, int, int, torch.Tensor] | None = None  # the part read last
        self._lock = threading.Lock()
        self.gathers = 0
        """How many gathers were started (one per tensor when the install reads them in order)."""

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
        return list(self._placeholders)

    def cut(self, full: Mapping[str, tuple[int, ...]], size: int) -> list[Mismatch]:
        """Take the plain tensors as tensor-parallel chunks (``WeightLayout(tp_rank, tp_size=size)``): each one whose
        shape is a ``1/size`` cut of the engine's ``full`` shape along one dimension becomes a placeholder of the
        full shape, gathered from every rank's chunk; a tensor of the full shape is used as it is (replicated).
        Returns the tensors that fit no cut (nothing is gathered then)."""
        problems = []
        for i, (name, t) in enumerate(self._placeholders):
            if t.is_meta or name not in full:
                continue  # a DTensor, or a name validation will report
            try:
                dim = cut_of(tuple(t.shape), tuple(full[name]), size)
            except ValueError as exc:
                problems.append(Mismatch("shape", name, expected=str(tuple(full[name])), actual=str(exc)))
                continue
            if dim is not None:
                meta = torch.empty(full[name], dtype=t.dtype, device="meta")
                self._index[id(meta)] = i
                self._cuts[i] = (dim, tuple(full[name]))
                self._placeholders[i] = (name, meta)
        self._sharded = sorted(self._index.values())
        return problems

    def unresolved(self, items: Items) -> list[str]:
        """Names in ``items`` (the placeholders as the engine will load them) whose data :meth:`load` cannot
        find: a ``meta`` tensor that is neither a placeholder nor a view of one (a conversion that copied)."""
        return [n for n, t in items if t.is_meta and self._source(t) is None]

    def _source(self, tensor: torch.Tensor) -> int | None:
        base = tensor._base if tensor._base is not None else tensor
        return self._index.get(id(base))

    def load(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The data behind ``tensor``: itself unless it is a placeholder or a view of one; then its ``DTensor`` is
        gathered on every rank (once for consecutive reads of the same one) and the same view is taken of it.
        While the caller packs it, the next sharded tensor is already being gathered."""
        index = self._source(tensor) if tensor.is_meta else None
        if index is None:
            return tensor
        if tensor._base is not None:
            mine = self.view_of_rank(tensor)
            if mine is not None and mine[1] == dist.get_rank(self._group):  # rows the leader holds: nothing gathered
                return local_view(self._sources[index][1], mine[2])
            if self._in_parts(index):
                return self._view_of_part(index, tensor)
        with self._lock:
            if self._held is None or self._held[0] != index:
                self._held = self._held_part = None  # drop the previous one before taking the next
                self._held = (index, self._take(index))
                self._post_next(index)
            full = self._held[1]
        if tensor._base is None:
            return full
        return full.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())

    def parts_at_most(self, limit: int) -> None:
        """Read a view of a dim-0 shard larger than ``limit`` bytes (an expert of fused MoE experts) from a part of
        about half ``limit`` holding the view's rows (at least those rows), not from the whole tensor. The
        installer passes its bucket size. The leader holds the part read and the next one, posted meanwhile; the
        bucket being packed may still hold views of the one before: 1.5 buckets at most (three times a view's rows
        where those are larger), never the whole fused tensor."""
        self._part_bytes = limit

    def _in_parts(self, index: int) -> bool:
        """Whether views of tensor ``index`` are read from parts (:meth:`parts_at_most`)."""
        if self._part_bytes is None or index in self._cuts:
            return False
        source = self._sources[index][1]
        nbytes = source.numel() * source.element_size()  # global: a DTensor's shape is the whole tensor's
        return nbytes > self._part_bytes and _rows_per_rank(source, self._group) is not None

    def _view_of_part(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """``view`` (of placeholder ``index``) taken of a part holding the rows it spans, gathered alone."""
        base = view._base
        assert base is not None and self._part_bytes is not None
        row = math.prod(base.shape[1:])  # elements per row of the (contiguous) placeholder
        first = int(view.storage_offset())
        lo, hi = first // row, _last(view.size(), view.stride(), first) // row + 1
        held = self._held_part
        if held is not None and held[0] == index and held[1] <= lo and hi <= held[2]:
            start, part = held[1], held[3]
        else:
            del held  # dropped before the next part is taken: two parts at most
            rows = max(hi - lo, self._part_bytes // 2 // max(1, row * base.element_size()))
            start, part = lo, self.load_rows(base, lo, min(int(base.shape[0]), lo + rows)).contiguous()
        return part.as_strided(view.size(), view.stride(), part.storage_offset() + first - start * row)

    def splits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a placeholder, not a view of one) is a dim-0 shard, or a tensor-parallel chunk cut
        along dim 0, whose rows can be gathered alone: then a tensor larger than a bucket travels in parts and the
        leader never holds it whole."""
        index = self._source(tensor) if tensor.is_meta and tensor._base is None else None
        if index is None:
            return False
        if index in self._cuts:
            if self._cuts[index][0] != 0:
                return False
        elif _rows_per_rank(self._sources[index][1], self._group) is None:
            return False
        self._split.add(index)
        return True

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        """For a placeholder of a dim-0 shard or of a tensor-parallel chunk: its index, who holds which rows (group
        rank, first row, end row) and of which dimension (a chunk's cut); None for any other tensor."""
        index = self._source(tensor) if tensor.is_meta and tensor._base is None else None
        if index is None:
            return None
        dim = self._cuts[index][0] if index in self._cuts else 0
        if dim == 0 and not self.splits(tensor):
            return None
        self._split.add(index)  # read by the ranks holding it: never gathered whole
        return index, _shares(self._sources[index][1], 0, int(tensor.shape[dim]), self._group, dim), dim

    def view_of_rank(self, tensor: torch.Tensor) -> tuple[int, int, list[list[int]]] | None:
        """For a view of a dim-0 shard whose rows one rank holds (an expert of fused MoE experts): its tensor's
        index, that rank, and the view as ``[size, stride, [offset]]`` into the rank's local shard; None for any
        other tensor."""
        index = self._source(tensor) if tensor.is_meta and tensor._base is not None else None
        if index is None or index in self._cuts or tensor.numel() == 0:
            return None
        source = self._sources[index][1]
        chunk = _rows_per_rank(source, self._group)
        if chunk is None:
            return None
        row = math.prod(source.shape[1:])  # elements per row (never index a DTensor: that is a collective)
        first = int(tensor.storage_offset())
        rank = first // row // chunk
        if _last(tensor.size(), tensor.stride(), first) // row // chunk != rank:
            return None  # across two ranks' rows: gathered
        return index, rank, [[int(n) for n in tensor.size()], list(tensor.stride()), [first - rank * chunk * row]]

    def rank_writes(self) -> Any:
        """The leader's side of rank-parallel writes (:mod:`hotweights.core.rank_writes`), where every rank runs on
        this host and the group has more than one rank; else None (every tensor is gathered)."""
        if not self.same_host or self._items is None or dist.get_world_size(self._group) < 2:
            return None
        return RankWrites(self, dict(self._items.source))

    def load_rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a placeholder's tensor, gathered alone (the next part is posted meanwhile);
        rows this rank holds itself are a view of its shard (nothing is gathered, or posted)."""
        index = self._source(tensor)
        assert index is not None
        source: Any = self._sources[index][1]
        me = dist.get_rank(self._group)
        shares = _shares(source, start, stop, self._group)
        if [r for r, _, _ in shares] == [me]:
            return local_rows(source, start, stop, self._group)
        with self._lock:
            held = self._held_part
            if held is not None and held[:3] == (index, start, stop):  # read again (a second way of packing it)
                return held[3]
            del held
            self._held = self._held_part = None  # dropped before the next part is taken: two parts at most
            ahead, self._ahead = self._ahead, None
            rows, self._ahead_rows = self._ahead_rows, None
            if ahead is not None and not (ahead.source == index and rows == (start, stop)):
                ahead.result()  # a posted gather must finish on every rank, used or not: then it is dropped
                ahead = None  # before the next part is taken
            part = (ahead if ahead is not None else self._post_rows(index, start, stop)).result()
            del ahead
            rows_total = int(self._placeholders[index][1].shape[0])
            if stop < rows_total:  # the install reads the parts in order: the next one, as large
                following = (stop, min(rows_total, 2 * stop - start))
                self._ahead, self._ahead_rows = self._post_rows(index, *following), following
            else:
                self._post_next(index)
            self._held_part = (index, start, stop, part)
        return part

    def _post_rows(self, index: int, start: int, stop: int) -> _Posted:
        self._command(index, start, stop)
        self.gathers += 1
        return _gather_rows(self._sources[index][1], start, stop, self._group, index)

    def _take(self, index: int) -> torch.Tensor:
        ahead, self._ahead = self._ahead, None
        rows, self._ahead_rows = self._ahead_rows, None
        if ahead is not None:
            full = ahead.result()  # a posted gather must finish on every rank, used or not
            if ahead.source == index and rows is None:
                return full
        return self._post(index).result()

    def _post(self, index: int) -> _Posted:
        self._command(index)
        self.gathers += 1
        source = self._sources[index][1]
        if index in self._cuts:
            dim, shape = self._cuts[index]
            return _gather_cut(source, dim, shape, self._src, self._group, index)
        posted = _gather(source, self._src, self._group, index, leads=True)
        assert posted is not None
        return posted

    def _command(self, value: int, start: int = -1, stop: int = -1) -> None:
        """Tell every rank what comes next: a tensor's index (with rows ``[start, stop)`` for a part), or
        :data:`_END`."""
        command = torch.tensor([value, start, stop], dtype=torch.int64, device=self._device)
        dist.broadcast(command, src=self._src, group=self._group)

    def _post_next(self, index: int) -> None:
        """Start the gather of the sharded tensor after ``index`` (the order an install reads them in)."""
        at = bisect.bisect_right(self._sharded, index)
        following = self._sharded[at] if at < len(self._sharded) else None
        if following is not None and following not in self._split and not self._in_parts(following):
            self._ahead = self._post(following)  # (a split one, or one whose views are read in parts: in parts)

    def finish(self, outcome: InstallReport | BaseException) -> None:
        """Tell every rank the install ended, and how (the report, or the error's envelope)."""
        self._held = self._held_part = None
        ahead, self._ahead = self._ahead, None
        self._ahead_rows = None
        if ahead is not None:
            ahead.result()
        payload = (
            {"report": outcome.model_dump(mode="json")}
            if isinstance(outcome, InstallReport)
            else {"error": envelope.encode(outcome)}
        )
        self.announce(_END, 0, payload)

    @property
    def group(self) -> Any:
        """The process group (None: the default one)."""
        return self._group

    @property
    def device(self) -> torch.device:
        """Where the group's messages live (CPU for gloo, the current CUDA device for NCCL)."""
        return self._device

    @property
    def sources(self) -> list[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs every rank passed, in the same order on every rank (``DTensor`` values)."""
        return self._sources

    def announce(self, value: int, start: int, message: dict[str, Any]) -> None:
        """A command whose ``stop`` is the length of a JSON ``message`` broadcast right after it."""
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8).to(self._device)
        self._command(value, start, data.numel())
        dist.broadcast(data, src=self._src, group=self._group)


def follow(items: Items, leader: int, group: Any = None, open_file: OpenFile | None = None) -> InstallReport:
    """A non-leading rank's side: join each gather the leader names, then return its report or raise its error.

    Raises:
        the leader's error, rebuilt from its envelope (same class and message).
        InstallError: a collective failed (the leader died, or the group broke); what the engine holds is unknown.
    """
    sources = list(items)
    cls = _dtensor()
    src = dist.get_global_rank(group, leader) if group is not None else leader
    device = _device(group)
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
                _send_rows(source, start, stop, src, group)
            elif cls is not None and isinstance(source, cls):
                _gather(source, src, group, leads=False)
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
