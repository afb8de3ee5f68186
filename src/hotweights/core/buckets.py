"""Cutting an update into buckets: flat byte buffers with each tensor at an aligned offset (pure logic).

A bucket is what one transport message carries and one engine RPC stages. The plan is computed from the manifest
alone, so both ends agree on it and the engine can check every offset against the manifest before reading.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from hotweights.core.manifest import WeightUpdateManifest

__all__ = [
    "ALIGNMENT",
    "Bucket",
    "BucketEntry",
    "Packer",
    "ReadsRows",
    "bucket_problems",
    "byte_views",
    "default_bucket_bytes",
    "layer_key",
    "pack_into",
    "plan_buckets",
    "row_cuts",
    "rows_of",
    "unpack",
    "unpack_parts",
]

#: Byte alignment of every tensor inside a bucket (any dtype can be viewed at such an offset).
ALIGNMENT = 64

#: Upper bound of the default bucket size.
MAX_DEFAULT_BUCKET_BYTES = 512 << 20


class BucketEntry(BaseModel):
    """One tensor's place in a bucket, or one part's: rows ``[start, stop)`` of its first dimension."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    rows: tuple[int, int] | None = None
    """A part of a tensor larger than a bucket (:func:`plan_buckets` with ``split``): its rows ``[start, stop)``."""

    @model_serializer(mode="wrap")
    def _without_whole_rows(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A whole tensor's entry is written as before parts existed (an engine running an older hotweights
        reads it)."""
        data: dict[str, Any] = handler(self)
        if self.rows is None:
            data.pop("rows", None)
        return data


class Bucket(BaseModel):
    """Tensors packed back to back (aligned) into ``nbytes`` bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    entries: tuple[BucketEntry, ...]


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def default_bucket_bytes(preferred: int = MAX_DEFAULT_BUCKET_BYTES) -> int:
    """``preferred`` (a transport's best size), capped at an eighth of the memory available now and at 512 MiB
    (floor 16 MiB)."""
    cap = min(preferred, MAX_DEFAULT_BUCKET_BYTES)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return cap
    return max(16 << 20, min(cap, free // 8))


def layer_key(name: str) -> str:
    """The transformer block a checkpoint name belongs to: the prefix through its first numeric component
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``); a name outside numbered blocks belongs to its
    module (``transformer.ln_f.bias`` -> ``transformer.ln_f``), so a layer's weight and bias stay together (vLLM's
    layerwise reload rebuilds a layer whole: a layer given only some of its tensors keeps uninitialised memory in
    the others)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rpartition(".")[0] or name


def plan_buckets(
    manifest: WeightUpdateManifest,
    bucket_bytes: int | None = None,
    *,
    whole_layers: bool = False,
    split: Callable[[str], bool] | None = None,
) -> list[Bucket]:
    """Greedy, order-preserving cut of the manifest's tensors into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. By default tensors of one layer may land in
    different buckets (the engine stages every bucket and installs once, so a split q/k/v is still correct). With
    ``whole_layers`` a bucket only ends between blocks (:func:`layer_key`) unless one block alone exceeds
    ``bucket_bytes``, so an engine that installs bucket by bucket completes whole layers each time.

    ``split(name)``: whether a tensor larger than ``bucket_bytes`` may travel in parts (rows of its first dimension,
    each part at most ``bucket_bytes`` where one row fits) instead of a bucket of its own; asked of those tensors
    only, in manifest order. The engine assembles the parts (so a sender reading a part never holds more than it).

    Example:
        >>> m = WeightUpdateManifest.from_state_dict({"a": torch.zeros(10), "b": torch.zeros(10)}, weight_version=1)
        >>> [[e.name for e in b.entries] for b in plan_buckets(m, bucket_bytes=64)]
        [['a'], ['b']]
    """
    limit = default_bucket_bytes() if bucket_bytes is None else bucket_bytes
    if limit <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {limit}")
    packer = Packer(limit)
    for group in _groups(manifest, whole_layers):
        if not packer.fits(_span(n for _, n in group)):
            packer.close()  # the whole block fits in a fresh bucket, or nowhere: never start it at the end of this one
        for name, n in group:
            for rows, size in _parts(manifest, name, n, limit, split):
                packer.add(name, rows, size)
    return packer.done()


class Packer:
    """Greedy, order-preserving packing of entries (a tensor, or rows of one) into buckets of at most ``limit``
    bytes, each entry at an aligned offset; an entry larger than ``limit`` gets a bucket of its own. Buckets are
    numbered from ``first``."""

    def __init__(self, limit: int, first: int = 0) -> None:
        self.limit = limit
        self.buckets: list[Bucket] = []
        self._first = first
        self._entries: list[BucketEntry] = []
        self._used = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the open bucket (always, when it is empty)."""
        return not self._entries or _align(self._used) + nbytes <= self.limit

    def add(self, name: str, rows: tuple[int, int] | None, nbytes: int) -> None:
        if not self.fits(nbytes):
            self.close()
        start = _align(self._used)
        self._entries.append(BucketEntry(name=name, offset=start, nbytes=nbytes, rows=rows))
        self._used = start + nbytes

    def close(self) -> None:
        """End the open bucket, if it holds anything."""
        if self._entries:
            index = self._first + len(self.buckets)
            self.buckets.append(Bucket(index=index, nbytes=self._used, entries=tuple(self._entries)))
            self._entries, self._used = [], 0

    def done(self) -> list[Bucket]:
        self.close()
        return self.buckets


def row_cuts(start: int, stop: int, row_bytes: int, limit: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` cut into runs of at most ``limit`` bytes (one row at least; all of them when a row
    holds no bytes)."""
    step = max(1, limit // row_bytes) if row_bytes else max(1, stop - start)
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def _parts(
    manifest: WeightUpdateManifest, name: str, nbytes: int, limit: int, split: Callable[[str], bool] | None
) -> list[tuple[tuple[int, int] | None, int]]:
    """The tensor whole (``[(None, nbytes)]``), or its parts: (rows, bytes) of at most ``limit`` bytes each."""
    shape = manifest.tensors[name].shape
    if nbytes <= limit or split is None or not shape or shape[0] < 2 or not split(name):
        return [(None, nbytes)]
    row = nbytes // shape[0]
    return [((a, b), (b - a) * row) for a, b in row_cuts(0, shape[0], row, limit)]


def _groups(manifest: WeightUpdateManifest, whole_layers: bool) -> list[list[tuple[str, int]]]:
    """Consecutive (name, bytes) runs of one block each (or one tensor each)."""
    groups: list[list[tuple[str, int]]] = []
    last = None
    for name, spec in manifest.tensors.items():
        key = layer_key(name) if whole_layers else name
        if not groups or key != last:
            groups.append([])
        groups[-1].append((name, spec.expected_nbytes))
        last = key
    return groups


def _span(sizes: Iterable[int]) -> int:
    """Bytes a run of tensors occupies packed from offset 0."""
    used = 0
    for n in sizes:
        used = _align(used) + n
    return used


def pack_into(buffer: torch.Tensor, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy each tensor (or part) of ``bucket`` into the flat ``uint8`` ``buffer`` at its offset (one copy, any
    device)."""
    for e in bucket.entries:
        src = tensors[e.name] if e.rows is None else rows_of(tensors, e.name, *e.rows)
        dst = buffer[e.offset : e.offset + e.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)


@runtime_checkable
class ReadsRows(Protocol):
    """A mapping that reads rows of a tensor alone (a sharded state dict gathers only those rows)."""

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...


def rows_of(tensors: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``tensors[name]``: read alone where the mapping can (:class:`ReadsRows`, e.g. a
    :class:`~hotweights.core.cast.BucketSource` over a sharded state dict), else sliced from the whole tensor."""
    if isinstance(tensors, ReadsRows):
        return tensors.rows(name, start, stop)
    return tensors[name][start:stop]


_PADDING = memoryview(bytes(ALIGNMENT))


def byte_views(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> list[memoryview] | None:
    """The bucket's bytes as consecutive views of the tensors' own memory (and zero padding between them), to be
    written with one gathering call (``os.pwritev``) instead of copied tensor by tensor; None when a tensor is not
    a contiguous CPU tensor (then :func:`pack_into` copies it, from any device)."""
    views: list[memoryview] = []
    used = 0
    for e in bucket.entries:
        src = tensors[e.name] if e.rows is None else rows_of(tensors, e.name, *e.rows)
        if src.device.type != "cpu" or not src.is_contiguous() or src.nbytes != e.nbytes:
            return None
        if e.offset > used:
            views.append(_PADDING[: e.offset - used])
        if e.nbytes:
            views.append(memoryview(src.detach().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        used = e.offset + e.nbytes
    return views


def bucket_problems(bucket: Bucket, manifest: WeightUpdateManifest, size: int) -> list[str]:
    """Every way ``bucket`` (received into ``size`` bytes) disagrees with the manifest; empty when it fits.

    Checked before a receiver allocates or reads anything: a bucket can only claim bytes the manifest accounts for
    (its tensors, with no more than alignment padding between them).
    """
    problems = []
    if not bucket.entries:
        problems.append("bucket lists no tensors")
    if size != bucket.nbytes:
        problems.append(f"payload has {size} bytes, the bucket declares {bucket.nbytes}")
    end = 0
    seen: set[str] = set()
    for e in bucket.entries:
        spec = manifest.tensors.get(e.name)
        if e.offset < end and e.nbytes:
            problems.append(f"{e.name!r} at byte {e.offset} overlaps the previous tensor (ends at {end})")
        end = max(end, e.offset + e.nbytes)
        if e.name in seen:
            problems.append(f"{e.name!r} appears twice in the bucket")
        seen.add(e.name)
        what = f"{e.name!r}" if e.rows is None else f"{e.name!r} rows {e.rows}"
        if spec is None:
            problems.append(f"{e.name!r} is not in the manifest")
        elif e.rows is not None and not (spec.shape and 0 <= e.rows[0] < e.rows[1] <= spec.shape[0]):
            problems.append(f"{what} are not rows of its shape {tuple(spec.shape)}")
        elif e.nbytes != (want := _entry_nbytes(e, spec.shape, spec.expected_nbytes)):
            problems.append(f"{what} has {e.nbytes} bytes, the manifest says {want}")
        elif e.offset % ALIGNMENT or e.offset + e.nbytes > bucket.nbytes:
            problems.append(f"{what} at [{e.offset}, {e.offset + e.nbytes}) is outside the {bucket.nbytes}-byte bucket")
    if end != bucket.nbytes:
        problems.append(f"bucket declares {bucket.nbytes} bytes but its tensors end at byte {end}")
    packed = sum(_align(e.nbytes) for e in bucket.entries)
    if bucket.nbytes > packed:  # gaps between tensors: a bucket claims no bytes beyond its tensors' packing
        problems.append(f"bucket declares {bucket.nbytes} bytes, more than its tensors packed need ({packed})")
    return problems


def _entry_nbytes(e: BucketEntry, shape: tuple[int, ...], nbytes: int) -> int:
    """The bytes ``e`` carries: the tensor's, or its rows' share of them."""
    return nbytes if e.rows is None else (e.rows[1] - e.rows[0]) * (nbytes // shape[0])


def unpack_parts(
    buffer: torch.Tensor, bucket: Bucket, manifest: WeightUpdateManifest
) -> Iterator[tuple[str, tuple[int, int], torch.Tensor]]:
    """Views of the parts of ``bucket`` (entries with ``rows``) inside ``buffer``: (name, rows, view). The caller
    checked the bucket (:func:`bucket_problems`)."""
    for e in bucket.entries:
        if e.rows is not None:
            spec = manifest.tensors[e.name]
            view = buffer[e.offset : e.offset + e.nbytes].view(spec.torch_dtype)
            yield e.name, e.rows, view.view(e.rows[1] - e.rows[0], *spec.shape[1:])


def unpack(
    buffer: torch.Tensor, bucket: Bucket, manifest: WeightUpdateManifest, *, checked: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor of ``bucket`` inside ``buffer`` (no copy), typed and shaped by the manifest.

    ``checked``: the caller already found no :func:`bucket_problems` for this bucket at ``buffer``'s size (only
    the size is checked again).

    Raises:
        ValueError: :func:`bucket_problems` found any (all named), before the first view is made.
    """
    fits = checked and buffer.numel() == bucket.nbytes
    problems = [] if fits else bucket_problems(bucket, manifest, buffer.numel())
    if problems:
        raise ValueError(f"bucket {bucket.index} does not match the manifest: " + "; ".join(problems))
    for e in bucket.entries:
        if e.rows is None:  # parts: unpack_parts
            spec = manifest.tensors[e.name]
            yield e.name, buffer[e.offset : e.offset + e.nbytes].view(spec.torch_dtype).view(spec.shape)
