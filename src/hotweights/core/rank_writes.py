"""Rank-parallel writes of a sharded install: every rank writes its own rows, nobody gathers them.

On one host, the engine's workers can read any rank's shared-memory files. So a rank can write the rows of an
FSDP2 (``Shard(0)``) tensor it holds, or of a tensor-parallel chunk cut along dim 0, into a bucket file of its
own. The leader (the rank holding the engine) stages that bucket like its own, from the descriptor the rank sends
back. Only descriptors (JSON) and acknowledgements cross the process group; the bytes go from each rank's memory
to the engine.

The leader's plan (:meth:`RankWrites.plan`) cuts every such tensor at the ranks' boundaries (and at the bucket
size) and gives each rank buckets of its own rows. A view of rows one rank holds (an expert of fused MoE experts)
is that rank's to write whole: the payload carries its size, stride and offset in the rank's shard. Tensors in any
other layout are gathered as before, first.
:meth:`RankWrites.transfer` then interleaves: while the leader writes and stages a bucket of its own rows, another
rank writes its next bucket. Protocol, per bucket of rank ``r``:

1. the leader broadcasts ``(WRITE, r, n)`` and the ``n``-byte payload ``{"bucket": ..., "sources": {name: index},
   "views": {name: [size, stride, [offset]]}}``;
2. rank ``r`` writes the bucket (the ``write`` it was given: :func:`hotweights._install` passes the shm transport)
   and sends the descriptor (or ``{"error": ...}``) to the leader;
3. the leader stages it on the engine and acknowledges (0: staged; 1: failed, the rank drops its file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hotweights.core.buckets import Bucket, Packer, row_cuts
from hotweights.core.errors import InstallError
from hotweights.core.manifest import WeightUpdateManifest

if TYPE_CHECKING:
    from hotweights.core.sharded import Gatherer

__all__ = ["WRITE", "RankWrites", "Write", "write_for_leader"]

#: The leader's command: a rank writes a bucket of its own rows.
WRITE = -2
#: How a rank writes one bucket: ``write(bucket, tensors, stage)`` (a transport's ``send``).
Write = Callable[[Bucket, Mapping[str, torch.Tensor], Callable[[dict[str, Any]], None]], None]
_GATHERED = -1  # the owner key of tensors gathered to the leader


class RankWrites:
    """The leader's side (made by :meth:`Gatherer.rank_writes`)."""

    def __init__(self, gatherer: Gatherer, items: Mapping[str, torch.Tensor]) -> None:
        self.gatherer = gatherer
        self.items = items  # checkpoint name -> placeholder
        self.me = dist.get_rank(gatherer._group)
        self.owner: dict[int, int] = {}  # bucket index -> group rank writing it (_GATHERED: the leader gathers)
        self.sources: dict[str, int] = {}  # checkpoint name -> index of its tensor in every rank's items
        self.views: dict[str, list[list[int]]] = {}  # checkpoint name -> [size, stride, [offset]] in a local shard
        self.buckets = 0
        """Buckets other ranks wrote in the last transfer."""

    def plan(self, manifest: WeightUpdateManifest, bucket_bytes: int) -> list[Bucket]:
        """Buckets of one writer each: gathered tensors first, then each rank's rows (cut at ``bucket_bytes``)."""
        groups: dict[int, list[tuple[str, tuple[int, int] | None, int, int]]] = {}
        for name, spec in manifest.tensors.items():
            shares = self.gatherer.shares_of(self.items[name])
            viewed = self.gatherer.view_of_rank(self.items[name]) if shares is None else None
            if viewed is not None:  # a view of rows one rank holds: that rank writes it whole
                self.sources[name], rank, self.views[name] = viewed
                groups.setdefault(rank, []).append((name, None, spec.expected_nbytes, 0))
                continue
            if shares is None:
                groups.setdefault(_GATHERED, []).append((name, None, spec.expected_nbytes, 0))
                continue
            self.sources[name], spans, dim = shares
            row = spec.expected_nbytes // spec.shape[dim]  # bytes per row (column) of the cut dimension
            for rank, lo, hi in spans:
                for a, b in row_cuts(lo, hi, row, bucket_bytes):
                    groups.setdefault(rank, []).append((name, (a, b), (b - a) * row, dim))
        plan: list[Bucket] = []
        for rank in sorted(groups, key=lambda r: (r != _GATHERED, r)):
            packer = Packer(bucket_bytes, first=len(plan))
            for entry in groups[rank]:
                packer.add(*entry)
            for bucket in packer.done():
                self.owner[bucket.index] = rank
                plan.append(bucket)
        return plan

    def transfer(
        self,
        plan: list[Bucket],
        deliver: Callable[[Bucket], Callable[[dict[str, Any]], None]],
        local: Callable[[Bucket], None],
    ) -> None:
        """Every bucket of ``plan`` staged: gathered ones first (they need every rank), then the leader's own rows,
        each while another rank writes its next bucket. ``local(bucket)`` sends one through the leader's
        transport; ``deliver(bucket)`` is what stages a descriptor."""
        self.buckets = 0
        for bucket in plan:
            if self.owner[bucket.index] == _GATHERED:
                local(bucket)
        own = [b for b in plan if self.owner[b.index] == self.me]
        remote: Iterator[Bucket] = iter(b for b in plan if self.owner[b.index] not in (_GATHERED, self.me))
        outstanding = self._post(next(remote, None))
        try:
            for bucket in own:
                local(bucket)  # the other rank writes meanwhile
                if outstanding is not None:
                    self._stage(outstanding, deliver(outstanding))
                    outstanding = self._post(next(remote, None))
            while outstanding is not None:
                self._stage(outstanding, deliver(outstanding))
                outstanding = self._post(next(remote, None))
        except BaseException:
            if outstanding is not None:  # the rank writing it waits for an answer: end its write
                self._settle(outstanding)
            raise

    def _post(self, bucket: Bucket | None) -> Bucket | None:
        if bucket is None:
            return None
        sources = {e.name: self.sources[e.name] for e in bucket.entries}
        views = {e.name: self.views[e.name] for e in bucket.entries if e.name in self.views}
        message = {"bucket": bucket.model_dump_json(), "sources": sources, "views": views}
        self.gatherer._announce(WRITE, self.owner[bucket.index], message)
        return bucket

    def _stage(self, bucket: Bucket, stage: Callable[[dict[str, Any]], None]) -> None:
        rank = self.owner[bucket.index]
        answer = _receive(rank, self.gatherer)
        if "error" in answer:
            raise InstallError(f"rank {rank} could not write bucket {bucket.index}: {answer['error']}")
        try:
            stage(answer)
        except BaseException:
            _send(_ack(1, self.gatherer._device), rank, self.gatherer)
            raise
        _send(_ack(0, self.gatherer._device), rank, self.gatherer)
        self.buckets += 1

    def _settle(self, bucket: Bucket) -> None:
        """Answer a rank whose bucket will not be staged (the install failed meanwhile)."""
        rank = self.owner[bucket.index]
        try:
            answer = _receive(rank, self.gatherer)
            if "error" not in answer:
                _send(_ack(1, self.gatherer._device), rank, self.gatherer)
        except Exception:  # the group broke: the other ranks learn it from the next collective
            pass


def _ack(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def _send(tensor: torch.Tensor, rank: int, g: Any) -> None:
    dist.send(tensor, dst=dist.get_global_rank(g._group, rank) if g._group is not None else rank, group=g._group)


def _receive(rank: int, g: Any) -> dict[str, Any]:
    src = dist.get_global_rank(g._group, rank) if g._group is not None else rank
    size = torch.empty(1, dtype=torch.int64, device=g._device)
    dist.recv(size, src=src, group=g._group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=g._device)
    dist.recv(data, src=src, group=g._group)
    answer: dict[str, Any] = json.loads(data.cpu().numpy().tobytes().decode())
    return answer


# ---------------------------------------------------------------------------------------------- the other ranks
class _OwnRows(Mapping[str, torch.Tensor]):
    """This rank's rows of the tensors a bucket names, and the views of them it names whole (an expert of fused
    experts): views of its shards, nothing is copied before the write."""

    def __init__(
        self,
        sources: Mapping[str, int],
        items: list[tuple[str, Any]],
        group: Any,
        views: Mapping[str, list[list[int]]] | None = None,
    ) -> None:
        self._sources, self._items, self._group = sources, items, group
        self._views = dict(views or {})

    def rows(self, name: str, start: int, stop: int, dim: int = 0) -> torch.Tensor:
        from hotweights.core.sharded import local_rows

        try:
            return local_rows(self._items[self._sources[name]][1], start, stop, self._group, dim)
        except ValueError as exc:
            raise ValueError(f"{name!r}: {exc}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        from hotweights.core.sharded import local_view

        if name not in self._views:
            raise KeyError(f"{name!r}: a rank writes rows of its shards and views of them only")
        try:
            return local_view(self._items[self._sources[name]][1], self._views[name])
        except ValueError as exc:
            raise ValueError(f"{name!r}: {exc}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def write_for_leader(
    payload: bytes, items: list[tuple[str, Any]], leader: int, group: Any, write: Write | None
) -> None:
    """Rank ``r``'s step 2: write the bucket the leader named, hand it the descriptor, wait for its answer."""
    device = _device_of(group)
    src = dist.get_global_rank(group, leader) if group is not None else leader
    sent = False

    def reply(answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=src, group=group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=src, group=group)

    def stage(descriptor: dict[str, Any]) -> None:
        nonlocal sent
        reply(descriptor)
        sent = True
        ack = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(ack, src=src, group=group)
        if int(ack.item()):
            raise InstallError("the leading rank did not stage this rank's bucket")

    try:
        if write is None:
            raise InstallError("this rank was given nothing to write buckets with")
        message = json.loads(payload.decode())
        bucket = Bucket.model_validate_json(message["bucket"])
        write(bucket, _OwnRows(message["sources"], items, group, message.get("views")), stage)
    except Exception as exc:
        if not sent:
            reply({"error": f"{type(exc).__name__}: {exc}"})


def _device_of(group: Any) -> torch.device:
    from hotweights.core.sharded import _device

    return _device(group)
