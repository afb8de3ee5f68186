"""The delta base in one shared-memory file: the trainer's copy, which the engine's workers on this host map.

Without it every worker keeps a private copy of what it serves for deltas to apply to, next to the trainer's own:
a TP=8 engine on one host holds nine copies of the model. With it there is one. The trainer writes its
:class:`SharedDeltaBase` into one ``hotweights-<pid>-<id>`` file in ``/dev/shm`` (mode 0600, locked by the trainer,
swept like any bucket file once the trainer is gone) and moves it to a new version only after every worker
committed; the workers map it read-only (:func:`map_base`: ``PROT_READ``, so a stray write would fault rather than
let one worker's base drift from the others') and read the unchanged parts of a delta's blocks from it; a delta's
changed tensors are rebuilt in private copies.

The file starts with a 64-byte header: the magic ``HWBASE01`` and the version (int64, little-endian) the tensors
hold; the tensors follow, each 64-byte aligned, as :meth:`SharedDeltaBase.descriptor` lays out.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hotweights.core.delta import DeltaBase, StagedDelta
from hotweights.core.manifest import dtype_from_str, dtype_to_str
from hotweights.transports import shm_files

__all__ = ["MappedBase", "SharedDeltaBase", "map_base"]

_MAGIC = b"HWBASE01"
_HEADER = 64
_ALIGN = 64


class SharedDeltaBase(DeltaBase):
    """A :class:`~hotweights.core.delta.DeltaBase` whose tensors live in one shared-memory file.

    :meth:`commit` writes the changed tensors in place and then the new version, so the workers that map the file
    see the base move only once the trainer says every worker installed the delta.
    """

    def __init__(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        layout: list[tuple[str, int, tuple[int, ...], str]] = []
        offset = _HEADER
        for name, t in tensors.items():
            layout.append((name, offset, tuple(t.shape), dtype_to_str(t.dtype)))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        _, path, fd = shm_files.new_file(max(offset, _HEADER))
        try:
            mm = mmap.mmap(fd, max(offset, _HEADER))
        except BaseException:
            shm_files.remove(path)
            raise
        finally:
            os.close(fd)
        self.path: Path = path
        self.layout = layout
        self._mm = mm
        views = _views(mm, layout)
        for name, t in tensors.items():
            views[name].copy_(t.detach().reshape(views[name].shape))
        super().__init__(version, views)
        self._write_version(version)
        self._finalizer = weakref.finalize(self, _release, mm, path)

    @classmethod
    def capture(
        cls, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SharedDeltaBase:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls(version, {n: t.detach().to("cpu") for n, t in items})

    def commit(self, staged: StagedDelta) -> None:
        """Write the rebuilt tensors into the file, then the new version."""
        for name, t in staged.changed.items():
            self.tensors[name].copy_(t)
        self.version = staged.version
        self._write_version(staged.version)

    def descriptor(self) -> dict[str, Any]:
        """What a worker needs to map the file (JSON)."""
        return {"path": str(self.path), "layout": [list(e) for e in self.layout]}

    def close(self) -> None:
        """Remove the file and unmap it here (workers keep their mappings until they drop them)."""
        self._finalizer()

    def _write_version(self, version: int) -> None:
        self._mm[: len(_MAGIC) + 8] = _MAGIC + struct.pack("<q", version)


class MappedBase:
    """A worker's read-only mapping of a trainer's :class:`SharedDeltaBase`."""

    def __init__(self, path: Path, mm: mmap.mmap, tensors: dict[str, torch.Tensor]) -> None:
        self.path = path
        self._mm = mm
        self.tensors = tensors

    @property
    def version(self) -> int | None:
        """The version the file's tensors hold now (None: not a base file)."""
        head = self._mm[: len(_MAGIC) + 8]
        if head[: len(_MAGIC)] != _MAGIC:
            return None
        return int(struct.unpack("<q", head[len(_MAGIC) :])[0])

    def base(self) -> DeltaBase:
        """The mapping as a :class:`DeltaBase` at its current version (its tensors are the file's pages)."""
        version = self.version
        if version is None:
            raise ValueError(f"{self.path} is not a hotweights delta base")
        return DeltaBase(version, self.tensors)


def map_base(descriptor: Mapping[str, Any]) -> MappedBase:
    """Map the base file ``descriptor`` names (a hotweights file of this user in ``/dev/shm``, as for buckets),
    read-only; raises ``ValueError`` for anything else."""
    path = Path(str(descriptor.get("path", "")))
    if not shm_files.is_segment(path):
        raise ValueError(f"refusing to map {path}: not a hotweights file in {shm_files.SHM_DIR}")
    raw = descriptor.get("layout")
    if not isinstance(raw, list):
        raise ValueError("a shared delta base needs its layout (a list of [name, offset, shape, dtype])")
    fd = shm_files.open_segment(shm_files.SHM_DIR / path.name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        layout: list[tuple[str, int, tuple[int, ...], str]] = []
        for entry in raw:
            name, offset, shape, dtype = entry
            shape = tuple(int(d) for d in shape)
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype_from_str(str(dtype)).itemsize
            if not isinstance(offset, int) or offset < _HEADER or offset + nbytes > size or min(shape, default=0) < 0:
                raise ValueError(f"the shared delta base's layout does not fit {path} ({size} bytes): {name!r}")
            layout.append((str(name), offset, shape, str(dtype)))
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return MappedBase(path, mm, _views(mm, layout, writable=False))


def _views(
    mm: mmap.mmap, layout: list[tuple[str, int, tuple[int, ...], str]], *, writable: bool = True
) -> dict[str, torch.Tensor]:
    buffer = memoryview(mm) if writable else memoryview(mm).toreadonly()
    out: dict[str, torch.Tensor] = {}
    for name, offset, shape, dtype in layout:
        torch_dtype = dtype_from_str(dtype)
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:
            out[name] = torch.empty(shape, dtype=torch_dtype)
            continue
        with warnings.catch_warnings():  # a read-only mapping: the views are only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch_dtype, count=numel, offset=offset)
        out[name] = flat.view(shape)
    return out


def _release(mm: mmap.mmap, path: Path) -> None:
    shm_files.remove(path)
    with contextlib.suppress(BufferError):  # views still alive: the pages go with them
        mm.close()
