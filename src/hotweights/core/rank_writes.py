"""Rank-parallel writes of a sharded install: every rank writes the rows it holds into the leader's buckets.

On one host, every rank can open the leader's shared-memory bucket files. So the leader (the rank holding the
engine) plans buckets of whole tensors, as an install from one process would, and each rank writes what it holds
of them straight into the bucket, at the tensor's offset: the rows of an FSDP2 (``Shard(0)``) tensor, the rows or
columns of a tensor-parallel chunk, or a view of its rows whole (an expert of fused MoE experts). The engine's
workers then map whole tensors: nothing is gathered, nothing is assembled on the engine's side, and the ranks
write at once. Only descriptions (JSON) and answers cross the process group; the bytes go from each rank's memory
into the bucket file. Tensors in any other layout are gathered as before, first, in buckets of their own.

Protocol, per bucket the ranks write (:meth:`RankWrites.transfer`):

1. the leader broadcasts ``(WRITE, -1, n)`` and the ``n``-byte payload ``{"path": ..., "pieces": {rank: [piece,
   ...]}}``, where a piece is ``{"source": index, "offset": bytes, "shape": [...], "rows": [start, stop, dim]}``
   or, for a view, ``{..., "view": [size, stride, [offset]]}``;
2. every rank named writes its pieces (the ``open_file`` it was given: :mod:`hotweights._install` passes
   :func:`hotweights.transports.shm_writes.opened_for_writes`) while the leader writes its own, and answers
   ``{"written": bytes}`` or ``{"error": ...}``;
3. with every answer in, the leader stages the bucket.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hotweights.core.buckets import Bucket, Packer
from hotweights.core.errors import InstallError
from hotweights.core.manifest import WeightUpdateManifest, dtype_from_str
from hotweights.core.shards import device_of, local_rows, local_view

__all__ = [
    "WRITE",
    "Channel",
    "OpenFile",
    "PieceFile",
    "RankWrites",
    "ShardedSource",
    "write_for_leader",
    "write_pieces",
]

#: The leader's command: the ranks named in the payload write their pieces of a bucket.
WRITE = -2
_GATHERED = -1  # the owner key of tensors gathered to the leader
_RANKS = -3  # the owner key of buckets the ranks write


class PieceFile(Protocol):
    """A bucket's file open for writes at offsets (:class:`hotweights.transports.shm_writes.BucketFile`)."""

    path: str
    descriptor: Any
    """What stages the bucket once it is written (the transport's descriptor: opaque here)."""

    def write(self, data: torch.Tensor, offset: int, shape: Sequence[int], dim: int = 0, start: int = 0) -> None: ...


#: How a rank opens the leader's bucket file by its path (:func:`hotweights.transports.shm_writes.opened_for_writes`).
OpenFile = Callable[[str], AbstractContextManager[PieceFile]]
#: The leader's file for a bucket the ranks write: ``with written(bucket) as file`` (the shm transport's).
Written = Callable[[Bucket], AbstractContextManager[PieceFile]]


class Channel(Protocol):
    """The leader's commands to every rank of the group (:class:`hotweights.core.gathers.Gathers`)."""

    @property
    def group(self) -> Any:
        """The process group (None: the default one)."""

    @property
    def device(self) -> torch.device:
        """Where the group's messages live."""

    @property
    def sources(self) -> Sequence[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs every rank passed, in the same order on every rank."""

    def announce(self, value: int, start: int, message: dict[str, Any]) -> None:
        """A command with a JSON ``message``, to every rank."""


class ShardedSource(Protocol):
    """What the leader's side asks of a sharded install's source (:class:`hotweights.core.sharded.Gatherer`)."""

    @property
    def channel(self) -> Channel:
        """Its commands to every rank."""

    def shares_of(self, tensor: torch.Tensor) -> tuple[int, list[tuple[int, int, int]], int] | None:
        """A placeholder's index, who holds which rows (group rank, first row, end row) and of which dimension."""

    def view_of_rank(self, tensor: torch.Tensor) -> tuple[int, int, list[list[int]]] | None:
        """A view's tensor index, the one rank holding its rows, and the view into that rank's shard."""


class RankWrites:
    """The leader's side (made by :meth:`hotweights.core.sharded.Gatherer.rank_writes`)."""

    def __init__(self, gatherer: ShardedSource, items: Mapping[str, torch.Tensor]) -> None:
        self.gatherer = gatherer
        self.channel = gatherer.channel
        self.items = items  # checkpoint name -> placeholder
        self.me = dist.get_rank(self.channel.group)
        self.owner: dict[int, int] = {}  # bucket index -> _GATHERED (the leader gathers) or _RANKS
        self.pieces: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # checkpoint name -> (rank, piece) each

    def plan(self, manifest: WeightUpdateManifest, bucket_bytes: int) -> list[Bucket]:
        """Buckets of whole tensors: gathered ones first, then those the ranks write (each cut at the ranks'
        boundaries into pieces, one per rank holding some of it)."""
        gathered: list[tuple[str, int]] = []
        written: list[tuple[str, int]] = []
        for name, spec in manifest.tensors.items():
            shares = self.gatherer.shares_of(self.items[name])
            viewed = self.gatherer.view_of_rank(self.items[name]) if shares is None else None
            common: dict[str, Any] = {"shape": list(spec.shape)}
            if spec.torch_dtype != self.items[name].dtype:  # cast by the rank writing it, piece by piece
                common["dtype"] = spec.dtype
            if viewed is not None:  # a view of rows one rank holds: that rank writes it whole
                index, rank, view = viewed
                self.pieces[name] = [(rank, {"source": index, **common, "view": view})]
            elif shares is not None:
                index, spans, dim = shares
                self.pieces[name] = [
                    (rank, {"source": index, **common, "rows": [lo, hi, dim]}) for rank, lo, hi in spans
                ]
            else:
                gathered.append((name, spec.expected_nbytes))
                continue
            written.append((name, spec.expected_nbytes))
        plan: list[Bucket] = []
        for owner, entries in ((_GATHERED, gathered), (_RANKS, written)):
            packer = Packer(bucket_bytes, first=len(plan))
            for name, nbytes in entries:
                packer.add(name, None, nbytes)
            for bucket in packer.done():
                self.owner[bucket.index] = owner
                plan.append(bucket)
        return plan

    def transfer(
        self,
        plan: list[Bucket],
        local: Callable[[Bucket], None],
        written: Written,
        stage: Callable[[Bucket, Any], None],
    ) -> None:
        """Every bucket of ``plan`` staged: gathered ones first (they need every rank), through ``local(bucket)``;
        then those the ranks write, each into ``written(bucket)`` and staged with ``stage(bucket, descriptor)``
        while every rank writes the next one."""
        for bucket in plan:
            if self.owner[bucket.index] == _GATHERED:
                local(bucket)
        with contextlib.ExitStack() as files:  # a file stays open until every bucket is staged (or the install fails)
            previous: tuple[Bucket, PieceFile] | None = None
            for bucket in plan:
                if self.owner[bucket.index] != _RANKS:
                    continue
                file = files.enter_context(written(bucket))
                staged = None if previous is None else functools.partial(stage, previous[0], previous[1].descriptor)
                self._fill(bucket, file, staged)
                previous = bucket, file
            if previous is not None:
                stage(previous[0], previous[1].descriptor)

    def _fill(self, bucket: Bucket, file: PieceFile, meanwhile: Callable[[], None] | None = None) -> None:
        """Every rank's pieces of ``bucket`` written into ``file``: the others' announced first, then the leader's
        own written while ``meanwhile()`` (the previous bucket's stage) runs on another thread; returns once every
        rank answered (raises if one could not write, or ``meanwhile`` raised)."""
        mine: list[dict[str, Any]] = []
        theirs: dict[str, list[dict[str, Any]]] = {}
        for entry in bucket.entries:
            for rank, piece in self.pieces[entry.name]:
                piece = {**piece, "offset": entry.offset}
                (mine if rank == self.me else theirs.setdefault(str(rank), [])).append(piece)
        if theirs:
            self.channel.announce(WRITE, -1, {"path": file.path, "pieces": theirs})
        failed: list[BaseException] = []
        aside = None
        if meanwhile is not None:
            aside = threading.Thread(target=_catching, args=(meanwhile, failed), name="hotweights-stage", daemon=True)
            aside.start()
        try:
            write_pieces(file, mine, self.channel.sources, self.channel.group)
        finally:  # every rank named answers, whatever happened here: none is left waiting
            if aside is not None:
                aside.join()
            answers = {int(r): _receive(int(r), self.channel) for r in theirs}
        if failed:
            raise failed[0]
        for rank, answer in answers.items():
            if "error" in answer:
                raise InstallError(
                    f"rank {rank} could not write its rows of bucket {bucket.index}: {answer['error']}. Every rank "
                    f"writes into the leader's bucket files ({file.path}), so each must see the same shared-memory "
                    "directory as the leader, as the same user; set HOTWEIGHTS_RANK_WRITES=0 on every rank to have the "
                    "leader gather instead."
                )


def _catching(call: Callable[[], None], failed: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:
        failed.append(exc)


def write_pieces(file: PieceFile, pieces: list[dict[str, Any]], items: Sequence[tuple[str, Any]], group: Any) -> int:
    """This rank's ``pieces`` (views of its shards: nothing is copied before the write, except a piece cast to the
    engine's ``dtype``, one piece at a time) written into ``file``; returns the bytes written."""
    written = 0
    for piece in pieces:
        name, source = items[piece["source"]]
        try:
            if "view" in piece:
                data, dim, start = local_view(source, piece["view"]), 0, 0
            else:
                start, stop, dim = piece["rows"]
                data = local_rows(source, start, stop, group, dim)
            if "dtype" in piece:
                data = data.to(dtype_from_str(piece["dtype"]))
            file.write(data, piece["offset"], piece["shape"], dim, start)
        except ValueError as exc:
            raise ValueError(f"{name!r}: {exc}") from None
        written += data.nbytes
    return written


def _receive(rank: int, g: Channel) -> dict[str, Any]:
    """Rank ``rank``'s answer (JSON: its length, then its bytes)."""
    src = dist.get_global_rank(g.group, rank) if g.group is not None else rank
    size = torch.empty(1, dtype=torch.int64, device=g.device)
    dist.recv(size, src=src, group=g.group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=g.device)
    dist.recv(data, src=src, group=g.group)
    answer: dict[str, Any] = json.loads(data.cpu().numpy().tobytes().decode())
    return answer


# ---------------------------------------------------------------------------------------------- the other ranks
def write_for_leader(
    message: Mapping[str, Any], items: Sequence[tuple[str, Any]], leader: int, group: Any, open_file: OpenFile | None
) -> None:
    """Rank ``r``'s step 2: write its pieces of the bucket the leader named into the leader's file, then answer."""
    device = device_of(group)
    try:
        if open_file is None:
            raise InstallError("this rank was given nothing to open the leader's bucket files with")
        with open_file(str(message["path"])) as file:
            answer: dict[str, Any] = {
                "written": write_pieces(file, message["pieces"][str(dist.get_rank(group))], items, group)
            }
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    data = json.dumps(answer).encode()
    dst = dist.get_global_rank(group, leader) if group is not None else leader
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=dst, group=group)
