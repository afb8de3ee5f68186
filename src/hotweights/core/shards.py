"""Where each rank's rows are, in a sharded install (pure geometry over the ranks' tensors; no collective here).

A sharded trainer's tensors are FSDP2 ``DTensor`` shards (cut along dim 0 over the group's ranks, in order, as
``torch.chunk`` cuts) or plain tensor-parallel chunks (equal cuts along one dimension, the last one padded). The
functions here say which rows a rank holds and take views of its own; :class:`ShardMap` keeps the leader's
placeholders (``meta`` tensors of the global shapes, which the install validates and plans with) and answers, for
each placeholder or view of one, whose rows it is and whether it may be read in parts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hotweights.core.errors import Mismatch

__all__ = [
    "ShardMap",
    "chunk_rows",
    "cut_of",
    "device_of",
    "dtensor_class",
    "last_element",
    "local_of",
    "local_rows",
    "local_view",
    "rows_per_rank",
    "shares",
]

Items = Sequence[tuple[str, torch.Tensor]]


def dtensor_class() -> type[Any] | None:
    """torch's ``DTensor`` (None: a torch without it)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return None
    return DTensor


def device_of(group: Any) -> torch.device:
    """Where ``group``'s messages live: the current CUDA device on NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rows_per_rank(tensor: Any, group: Any) -> int | None:
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


def chunk_rows(tensor: Any, group: Any, dim: int = 0) -> int:
    """Rows of each rank's chunk of a dim-0 shard: an FSDP2 ``DTensor`` (:func:`rows_per_rank`), or a plain
    tensor-parallel chunk cut along ``dim`` (every rank's as large, the last one padded)."""
    cls = dtensor_class()
    if cls is None or not isinstance(tensor, cls):
        return int(tensor.shape[dim])
    chunk = rows_per_rank(tensor, group)
    assert chunk is not None
    return chunk


def local_of(tensor: Any) -> torch.Tensor:
    """This rank's own tensor: a ``DTensor``'s local shard, or a plain chunk itself."""
    cls = dtensor_class()
    local: torch.Tensor = tensor.to_local() if cls is not None and isinstance(tensor, cls) else tensor
    return local


def shares(tensor: Any, start: int, stop: int, group: Any, dim: int = 0) -> list[tuple[int, int, int]]:
    """Who holds rows ``[start, stop)`` (global rows of ``dim``, ``stop`` at most the tensor's) of a dim-0 shard or
    of a chunk: (group rank, first row, end row)."""
    chunk = chunk_rows(tensor, group, dim)
    world = dist.get_world_size(group)
    spans = [(r, max(start, r * chunk), min(stop, (r + 1) * chunk)) for r in range(world)]
    return [(r, lo, hi) for r, lo, hi in spans if lo < hi]


def local_rows(tensor: Any, start: int, stop: int, group: Any, dim: int = 0) -> torch.Tensor:
    """Rows ``[start, stop)`` (global rows of ``dim``) of a dim-0 shard or of a chunk that this rank holds, as a
    view of its own tensor; ``ValueError`` when it does not hold them all."""
    first = dist.get_rank(group) * chunk_rows(tensor, group, dim)
    local = local_of(tensor)
    if not first <= start < stop <= first + local.shape[dim]:
        held = f"[{first}, {first + local.shape[dim]})"
        raise ValueError(f"rows [{start}, {stop}) of dim {dim} are not this rank's (it holds {held})")
    return local.narrow(dim, start - first, stop - start)


def last_element(size: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """The last element (storage offset) a view of ``size`` and ``stride`` from ``offset`` reaches."""
    return offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n > 0)


def local_view(tensor: Any, view: Sequence[Sequence[int]]) -> torch.Tensor:
    """A view ``[size, stride, [offset]]`` (:meth:`ShardMap.view_of_rank`) of this rank's local shard of ``tensor``;
    ``ValueError`` when it does not lie inside that shard."""
    size, stride, (offset,) = view
    local: torch.Tensor = tensor.to_local()
    if not local.is_contiguous() or offset < 0 or last_element(size, stride, offset) >= local.numel():
        raise ValueError(f"the view {list(view)} is not inside this rank's shard (shape {tuple(local.shape)})")
    return local.as_strided(list(size), list(stride), local.storage_offset() + offset)


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


class ShardMap:
    """The leader's placeholders of the ranks' tensors, and where each one's rows are.

    Every ``DTensor`` of ``items`` becomes a ``meta`` tensor of its global shape (its *placeholder*); plain tensors
    stay as they are until :meth:`cut` takes them as tensor-parallel chunks. A placeholder, or a view of one, leads
    back to its index in ``items`` (:meth:`source`), the same on every rank.
    """

    def __init__(self, items: Items, group: Any = None) -> None:
        cls = dtensor_class()
        self.group = group
        self.sources = list(items)
        """The ``(name, tensor)`` pairs every rank passed, in the same order on every rank (``DTensor`` values)."""
        self._index: dict[int, int] = {}  # id(placeholder) -> index of its DTensor in items
        self._placeholders: list[tuple[str, torch.Tensor]] = []
        for i, (name, t) in enumerate(self.sources):
            if cls is not None and isinstance(t, cls):
                meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                self._index[id(meta)] = i
                t = meta
            self._placeholders.append((name, t))
        self.cuts: dict[int, tuple[int, tuple[int, ...]]] = {}
        """Index -> (dim, full shape) of each plain tensor-parallel chunk."""
        self.sharded = sorted(self._index.values())
        """The indices of the tensors every rank holds a share of, in the order an install reads them."""
        self.split: set[int] = set()
        """Tensors read in parts, or written by the ranks holding them: never gathered whole."""
        self.part_bytes: int | None = None
        """Views of a dim-0 shard larger than this are read from parts of it (``Gatherer.parts_at_most``)."""

    def placeholders(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` with every ``DTensor`` as a ``meta`` tensor of its global shape and dtype."""
        return list(self._placeholders)

    def rows(self, index: int) -> int:
        """Rows (dim 0) of tensor ``index``'s placeholder: its global shape."""
        return int(self._placeholders[index][1].shape[0])

    def source(self, tensor: torch.Tensor) -> int | None:
        """The index in ``items`` behind a placeholder or a view of one; None for any other tensor."""
        base = tensor._base if tensor._base is not None else tensor
        return self._index.get(id(base))

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
                self.cuts[i] = (dim, tuple(full[name]))
                self._placeholders[i] = (name, meta)
        self.sharded = sorted(self._index.values())
        return problems

    def unresolved(self, items: Items) -> list[str]:
        """Names in ``items`` (the placeholders as the engine will load them) whose data cannot be found: a
        ``meta`` tensor that is neither a placeholder nor a view of one (a conversion that copied)."""
        return [n for n, t in items if t.is_meta and self.source(t) is None]

    def in_parts(self, index: int) -> bool:
        """Whether views of tensor ``index`` are read from parts (:attr:`part_bytes`)."""
        if self.part_bytes is None or index in self.cuts:
            return False
        source = self.sources[index][1]
        nbytes = source.numel() * source.element_size()  # global: a DTensor's shape is the whole tensor's
        return nbytes > self.part_bytes and rows_per_rank(source, self.group) is not None

    def splits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a placeholder, not a view of one) is a dim-0 shard, or a tensor-parallel chunk cut
        along dim 0, whose rows can be gathered alone: then a tensor larger than a bucket travels in parts and the
        leader never holds it whole."""
        index = self.source(tensor) if tensor.is_meta and tensor._base is None else None
        if index is None:
            return False
        if index in self.cuts:
            if self.cuts[index][0] != 0:
                return False
        elif rows_per_rank(self.sources[index][1], self.group) is None:
            return False
        self.split.add(index)
        return True

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        """For a placeholder of a dim-0 shard or of a tensor-parallel chunk: its index, who holds which rows (group
        rank, first row, end row) and of which dimension (a chunk's cut); None for any other tensor."""
        index = self.source(tensor) if tensor.is_meta and tensor._base is None else None
        if index is None:
            return None
        dim = self.cuts[index][0] if index in self.cuts else 0
        if dim == 0 and not self.splits(tensor):
            return None
        self.split.add(index)  # read by the ranks holding it: never gathered whole
        return index, shares(self.sources[index][1], 0, int(tensor.shape[dim]), self.group, dim), dim

    def view_of_rank(self, tensor: torch.Tensor) -> tuple[int, int, list[list[int]]] | None:
        """For a view of a dim-0 shard whose rows one rank holds (an expert of fused MoE experts): its tensor's
        index, that rank, and the view as ``[size, stride, [offset]]`` into the rank's local shard; None for any
        other tensor."""
        index = self.source(tensor) if tensor.is_meta and tensor._base is not None else None
        if index is None or index in self.cuts or tensor.numel() == 0:
            return None
        source = self.sources[index][1]
        chunk = rows_per_rank(source, self.group)
        if chunk is None:
            return None
        row = math.prod(source.shape[1:])  # elements per row (never index a DTensor: that is a collective)
        first = int(tensor.storage_offset())
        rank = first // row // chunk
        if last_element(tensor.size(), tensor.stride(), first) // row // chunk != rank:
            return None  # across two ranks' rows: gathered
        return index, rank, [[int(n) for n in tensor.size()], list(tensor.stride()), [first - rank * chunk * row]]
