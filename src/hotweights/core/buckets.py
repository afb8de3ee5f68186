"""Cutting an update into buckets: flat byte buffers with each tensor at an aligned offset (pure logic).

A bucket is what one transport message carries and one engine RPC stages. The plan is computed from the manifest
alone, so both ends agree on it and the engine can check every offset against the manifest before reading.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from hotweights.core.manifest import WeightUpdateManifest

__all__ = [
    "ALIGNMENT",
    "Bucket",
    "BucketEntry",
    "bucket_problems",
    "default_bucket_bytes",
    "pack_into",
    "plan_buckets",
    "unpack",
]

#: Byte alignment of every tensor inside a bucket (any dtype can be viewed at such an offset).
ALIGNMENT = 64

#: Upper bound of the default bucket size.
MAX_DEFAULT_BUCKET_BYTES = 512 << 20


class BucketEntry(BaseModel):
    """One tensor's place in a bucket."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


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


def plan_buckets(manifest: WeightUpdateManifest, bucket_bytes: int | None = None) -> list[Bucket]:
    """Greedy, order-preserving cut of the manifest's tensors into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Tensors of one layer may land in different
    buckets: the engine stages every bucket and installs once, so a split q/k/v is still correct.

    Example:
        >>> m = WeightUpdateManifest.from_state_dict({"a": torch.zeros(10), "b": torch.zeros(10)}, weight_version=1)
        >>> [[e.name for e in b.entries] for b in plan_buckets(m, bucket_bytes=64)]
        [['a'], ['b']]
    """
    limit = default_bucket_bytes() if bucket_bytes is None else bucket_bytes
    if limit <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {limit}")
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    used = 0
    for name, spec in manifest.tensors.items():
        n = spec.expected_nbytes
        start = _align(used)
        if entries and start + n > limit:
            buckets.append(Bucket(index=len(buckets), nbytes=used, entries=tuple(entries)))
            entries, start = [], 0
        entries.append(BucketEntry(name=name, offset=start, nbytes=n))
        used = start + n
    if entries:
        buckets.append(Bucket(index=len(buckets), nbytes=used, entries=tuple(entries)))
    return buckets


def pack_into(buffer: torch.Tensor, bucket: Bucket, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each tensor of ``bucket`` into the flat ``uint8`` ``buffer`` at its offset (one copy, any device)."""
    for e in bucket.entries:
        src = tensors[e.name]
        dst = buffer[e.offset : e.offset + e.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)


def bucket_problems(bucket: Bucket, manifest: WeightUpdateManifest, size: int) -> list[str]:
    """Every way ``bucket`` (received into ``size`` bytes) disagrees with the manifest; empty when it fits.

    Checked before a receiver allocates or reads anything: a bucket can only claim bytes the manifest accounts for.
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
        if spec is None:
            problems.append(f"{e.name!r} is not in the manifest")
        elif e.nbytes != spec.expected_nbytes:
            problems.append(f"{e.name!r} has {e.nbytes} bytes, the manifest says {spec.expected_nbytes}")
        elif e.offset % ALIGNMENT or e.offset + e.nbytes > bucket.nbytes:
            problems.append(
                f"{e.name!r} at [{e.offset}, {e.offset + e.nbytes}) is outside the {bucket.nbytes}-byte bucket"
            )
    if end != bucket.nbytes:
        problems.append(f"bucket declares {bucket.nbytes} bytes but its tensors end at byte {end}")
    return problems


def unpack(buffer: torch.Tensor, bucket: Bucket, manifest: WeightUpdateManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor of ``bucket`` inside ``buffer`` (no copy), typed and shaped by the manifest.

    Raises:
        ValueError: :func:`bucket_problems` found any (all named), before the first view is made.
    """
    problems = bucket_problems(bucket, manifest, buffer.numel())
    if problems:
        raise ValueError(f"bucket {bucket.index} does not match the manifest: " + "; ".join(problems))
    for e in bucket.entries:
        spec = manifest.tensors[e.name]
        yield e.name, buffer[e.offset : e.offset + e.nbytes].view(spec.torch_dtype).view(spec.shape)
