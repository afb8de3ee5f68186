"""Writes into hotweights' ``/dev/shm`` files at offsets, with ``pwrite``: a packed bucket's tensors back to back
(:func:`write_views`), and a bucket's file open for the rows each rank of a sharded install holds
(:class:`BucketFile`, :func:`opened_for_writes`: :mod:`hotweights.core.rank_writes`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from hotweights.transports.shm_files import SHM_DIR, is_segment, open_segment
from hotweights.transports.transport import Descriptor

__all__ = ["BucketFile", "ShmDescriptor", "opened_for_writes", "write_at", "write_views"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShmDescriptor(Descriptor):
    """A bucket in a hotweights file of ``SHM_DIR`` (the shm transport's; the receiver maps only those)."""

    transport: str = "shm"
    path: str
    """The file, ``SHM_DIR/hotweights-<pid>-<id>``."""
    segment: str | None = None
    """A kept segment's id (``keep_segments=True``): mapped shared once and kept by the worker."""

    def __post_init__(self) -> None:
        super().__post_init__()
        fix = "send the descriptor the shm transport's send made"
        self.require("path", isinstance(self.path, str), "a string", fix)
        self.require("segment", self.segment is None or isinstance(self.segment, str), "a string (or no)", fix)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def write_views(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` back to back from offset 0, gathering up to ``IOV_MAX`` of them per system call.

    Measured on the 291-tensor model (15 MB): 10 ms, against 20 ms for mapping the new file and copying each tensor
    into it (the copies fault in every fresh page one by one; the kernel fills them in bulk here).
    """
    offset = 0
    for i in range(0, len(views), _IOV_MAX):
        chunk = views[i : i + _IOV_MAX]
        done = os.pwritev(fd, chunk, offset)
        for view in chunk:  # a short write (tmpfs does not make them, but the call may): the rest one by one
            n = min(done, view.nbytes)
            done -= n
            write_at(fd, view[n:], offset + n)
            offset += view.nbytes


class BucketFile:
    """A bucket's file, open for writes at offsets (``fd`` stays the opener's to close). The ranks of a sharded
    install write the rows they hold straight into the leader's bucket (:mod:`hotweights.core.rank_writes`)."""

    def __init__(self, path: Path, fd: int, size: int, nbytes: int | None = None) -> None:
        self.path, self.fd, self.size = str(path), fd, size
        nbytes = size if nbytes is None else nbytes
        self.descriptor = ShmDescriptor(path=self.path, nbytes=nbytes)
        """What stages the bucket written into this file."""

    def write(self, data: torch.Tensor, offset: int, shape: Sequence[int], dim: int = 0, start: int = 0) -> None:
        """``data``: the slice ``[start, start + data.shape[dim])`` along ``dim`` of a row-major tensor of
        ``shape`` (of ``data``'s dtype) that begins ``offset`` bytes into the file, written with ``pwrite``: rows in
        one call, columns in one call per row."""
        full = tuple(int(n) for n in shape)
        whole = tuple(data.shape) == full and start == 0
        count = int(data.shape[dim]) if 0 <= dim < min(data.dim(), len(full)) else -1
        if not whole and (
            data.dim() != len(full)
            or tuple(data.shape) != (*full[:dim], count, *full[dim + 1 :])
            or start < 0
            or start + count > full[dim]
        ):
            raise ValueError(
                f"a slice of shape {tuple(data.shape)} at {start} along dim {dim} does not fit a tensor of shape {full}"
            )
        step = math.prod(full[dim + 1 :]) * data.element_size()  # bytes of one index along dim
        end = offset + math.prod(full) * data.element_size()
        if offset < 0 or end > self.size:
            raise ValueError(f"bytes [{offset}, {end}) lie outside the bucket file ({self.size} bytes)")
        raw = memoryview(data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        outer = math.prod(full[:dim])
        if whole or outer == 1 or not data.numel():  # one run of bytes
            write_at(self.fd, raw, offset + start * step)
            return
        # One run per index of the dimensions before ``dim`` (a row of columns): a system call each, on this thread
        # (a mapping's strided copy ran on torch's threads, against the other ranks' writes: 4-6x slower here).
        length, stride = count * step, full[dim] * step
        at = offset + start * step
        for i in range(outer):
            write_at(self.fd, raw[i * length : (i + 1) * length], at + i * stride)


@contextlib.contextmanager
def opened_for_writes(path: str) -> Iterator[BucketFile]:
    """Another process's bucket file (``file.path`` of its shm transport's ``written``), open for this
    process's writes: only a hotweights segment in ``SHM_DIR``, a regular file of this user."""
    where = Path(path)
    if not is_segment(where):
        raise ValueError(f"refusing to write {path}: not a hotweights segment in {SHM_DIR}")
    fd = open_segment(SHM_DIR / where.name, os.O_RDWR)
    try:
        yield BucketFile(where, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def write_at(fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` at ``offset`` of the file behind ``fd`` (``pwrite`` again after a short write: tmpfs does not
    make them, but the call may)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
