"""The leader's gathers in a sharded install: each tensor (or part of one) gathered from every rank when the install
reads it, the next one already posted while the current one is packed.

The leader names each gather with a command (a tensor's index, and rows ``[start, stop)`` for a part) broadcast on
the group; the other ranks (:func:`hotweights.core.sharded.follow`) join it. An FSDP2 shard (dim 0, over the
group's ranks) is gathered to the leader alone (``dist.gather``), so the other ranks allocate nothing; a
tensor-parallel chunk likewise, side by side along its cut; any other layout through ``full_tensor()``. The leader
keeps the last gathered tensor (the checkpoint tensors a fused one is split into are read one after another) and,
while the transport packs it, already gathers the next one: two tensors at most (:class:`Gathers`).
"""

from __future__ import annotations

import bisect
import json
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hotweights.core.shards import ShardMap, device_of, last_element, local_of, local_rows, rows_per_rank, shares

__all__ = ["Gathers", "gather", "gather_cut", "gather_rows", "send_rows"]


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


def gather(tensor: Any, dst: int, group: Any, index: int = -1, *, leads: bool) -> _Posted | None:
    """Start gathering ``tensor``'s full value on the leader (returned there, None elsewhere). A dim-0 shard goes to
    the leader alone, asynchronously, into one buffer whose first rows are the tensor (the other ranks allocate
    nothing and wait for their send); any other layout: ``full_tensor()``, at once."""
    chunk = rows_per_rank(tensor, group)
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


def send_rows(tensor: Any, start: int, stop: int, dst: int, group: Any) -> None:
    """A non-leading rank's share of rows ``[start, stop)``, sent to the leader (nothing when it holds none)."""
    me = dist.get_rank(group)
    for r, lo, hi in shares(tensor, start, stop, group):
        if r == me:
            dist.send(local_rows(tensor, lo, hi, group).contiguous(), dst=dst, group=group)


def gather_rows(tensor: Any, start: int, stop: int, group: Any, index: int) -> _Posted:
    """Start gathering rows ``[start, stop)`` of a dim-0 shard on the leader (this rank): each rank's share is
    received into its place, so the leader holds that part and nothing more."""
    me = dist.get_rank(group)
    out = torch.empty((stop - start, *tensor.shape[1:]), dtype=tensor.dtype, device=local_of(tensor).device)
    works = []
    for r, lo, hi in shares(tensor, start, stop, group):
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


def gather_cut(local: torch.Tensor, dim: int, shape: tuple[int, ...], dst: int, group: Any, index: int) -> _Posted:
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


class Gathers:
    """The leader's gathers and commands: what it holds (the tensor read last, or a part), what it posted ahead,
    and the commands that tell every rank what comes next."""

    def __init__(self, shards: ShardMap, leader: int, group: Any = None) -> None:
        self.shards = shards
        self.group = group
        """The process group (None: the default one)."""
        self.device = device_of(group)
        """Where the group's messages live (CPU for gloo, the current CUDA device for NCCL)."""
        self.sources = shards.sources
        """The ``(name, tensor)`` pairs every rank passed, in the same order on every rank (``DTensor`` values)."""
        self._src = dist.get_global_rank(group, leader) if group is not None else leader
        self._held: tuple[int, torch.Tensor] | None = None
        self._ahead: _Posted | None = None
        self._ahead_rows: tuple[int, int] | None = None  # the part ``_ahead`` holds (None: a whole tensor)
        self._held_part: tuple[int, int, int, torch.Tensor] | None = None  # the part read last
        self._lock = threading.Lock()
        self.gathers = 0
        """How many gathers were started (one per tensor when the install reads them in order)."""

    def whole(self, index: int) -> torch.Tensor:
        """Tensor ``index`` gathered on every rank (once for consecutive reads of the same one); the next sharded
        tensor is posted meanwhile."""
        with self._lock:
            if self._held is None or self._held[0] != index:
                self._held = self._held_part = None  # drop the previous one before taking the next
                self._held = (index, self._take(index))
                self._post_next(index)
            return self._held[1]

    def view_of_part(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """``view`` (of placeholder ``index``) taken of a part holding the rows it spans, gathered alone."""
        base = view._base
        part_bytes = self.shards.part_bytes
        assert base is not None and part_bytes is not None
        row = math.prod(base.shape[1:])  # elements per row of the (contiguous) placeholder
        first = int(view.storage_offset())
        lo, hi = first // row, last_element(view.size(), view.stride(), first) // row + 1
        held = self._held_part
        if held is not None and held[0] == index and held[1] <= lo and hi <= held[2]:
            start, part = held[1], held[3]
        else:
            del held  # dropped before the next part is taken: two parts at most
            rows = max(hi - lo, part_bytes // 2 // max(1, row * base.element_size()))
            start, part = lo, self.load_rows(base, lo, min(int(base.shape[0]), lo + rows)).contiguous()
        return part.as_strided(view.size(), view.stride(), part.storage_offset() + first - start * row)

    def load_rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a placeholder's tensor, gathered alone (the next part is posted meanwhile);
        rows this rank holds itself are a view of its shard (nothing is gathered, or posted)."""
        index = self.shards.source(tensor)
        assert index is not None
        source: Any = self.sources[index][1]
        me = dist.get_rank(self.group)
        if [r for r, _, _ in shares(source, start, stop, self.group)] == [me]:
            return local_rows(source, start, stop, self.group)
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
            rows_total = self.shards.rows(index)
            if stop < rows_total:  # the install reads the parts in order: the next one, as large
                following = (stop, min(rows_total, 2 * stop - start))
                self._ahead, self._ahead_rows = self._post_rows(index, *following), following
            else:
                self._post_next(index)
            self._held_part = (index, start, stop, part)
        return part

    def _post_rows(self, index: int, start: int, stop: int) -> _Posted:
        self.command(index, start, stop)
        self.gathers += 1
        return gather_rows(self.sources[index][1], start, stop, self.group, index)

    def _take(self, index: int) -> torch.Tensor:
        ahead, self._ahead = self._ahead, None
        rows, self._ahead_rows = self._ahead_rows, None
        if ahead is not None:
            full = ahead.result()  # a posted gather must finish on every rank, used or not
            if ahead.source == index and rows is None:
                return full
        return self._post(index).result()

    def _post(self, index: int) -> _Posted:
        self.command(index)
        self.gathers += 1
        source = self.sources[index][1]
        if index in self.shards.cuts:
            dim, shape = self.shards.cuts[index]
            return gather_cut(source, dim, shape, self._src, self.group, index)
        posted = gather(source, self._src, self.group, index, leads=True)
        assert posted is not None
        return posted

    def _post_next(self, index: int) -> None:
        """Start the gather of the sharded tensor after ``index`` (the order an install reads them in)."""
        sharded = self.shards.sharded
        at = bisect.bisect_right(sharded, index)
        following = sharded[at] if at < len(sharded) else None
        if following is not None and following not in self.shards.split and not self.shards.in_parts(following):
            self._ahead = self._post(following)  # (a split one, or one whose views are read in parts: in parts)

    def drain(self) -> None:
        """Drop what is held, and finish the gather posted ahead (every rank runs it, used or not)."""
        self._held = self._held_part = None
        ahead, self._ahead = self._ahead, None
        self._ahead_rows = None
        if ahead is not None:
            ahead.result()

    def command(self, value: int, start: int = -1, stop: int = -1) -> None:
        """Tell every rank what comes next: a tensor's index (with rows ``[start, stop)`` for a part), or another
        command of :mod:`hotweights.core.sharded`."""
        command = torch.tensor([value, start, stop], dtype=torch.int64, device=self.device)
        dist.broadcast(command, src=self._src, group=self.group)

    def announce(self, value: int, start: int, message: dict[str, Any]) -> None:
        """A command whose ``stop`` is the length of a JSON ``message`` broadcast right after it."""
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8).to(self.device)
        self.command(value, start, data.numel())
        dist.broadcast(data, src=self._src, group=self.group)
