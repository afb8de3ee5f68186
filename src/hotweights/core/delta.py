"""Delta installs, the pure part: what changed since the version last installed, encoded, checked, applied.

A delta lists only the tensors whose bytes changed since its *base* (the version the engine serves). Each changed
tensor goes *sparse* (the flat positions that changed, as sorted int32/int64 indices, plus their new values in the
tensor's dtype) or *full* (the whole tensor), whichever crosses fewer bytes::

    sparse bytes = changed * (index itemsize + value itemsize)  <  numel * value itemsize = full bytes

So with int32 indices a tensor goes sparse while under 1/3 of its elements changed in bf16/fp16, 1/2 in fp32, 2/3 in
fp64 (int64 indices, for tensors of 2**31 elements or more, lower these to 1/5, 1/3, 1/2). Unchanged tensors are not
sent at all. Changes are found bit by bit (a ``-0.0`` that became ``0.0`` changed; a NaN that stayed NaN did not),
so applying a delta reproduces the new tensors exactly.

On the wire a delta is plain tensors, named ``<name>:indices`` and ``<name>:values`` (sparse) or ``<name>:full``,
described by a :class:`~hotweights.core.delta_wire.DeltaManifest` (JSON, no pickle): the buckets and transports of
full installs carry it as they are (:mod:`hotweights.core.delta_wire`, with its checks).

Both ends keep a :class:`DeltaBase`, a host copy of the weights last installed: the trainer one per engine
(:class:`DeltaState`, on the engine's handle, shared by every adapter on it), every worker of a multiprocess engine
one more; an in-process worker is lent the trainer's. :meth:`DeltaBase.apply` checks a delta completely
(:func:`~hotweights.core.delta_wire.delta_problems`) before it builds anything, then builds the new tensors aside
(the base is never written in place) and lists what to reinstall: every tensor of each transformer block that
changed (:func:`~hotweights.core.buckets.layer_key`), because an engine rebuilds fused parameters (q/k/v, gate/up)
from complete parts only. :meth:`DeltaBase.commit` swaps the new tensors in once the engine took them.

Example:
    >>> base = DeltaBase.capture({"w": torch.zeros(1000)}, version=1)
    >>> new = torch.zeros(1000); new[7] = 1.0
    >>> delta = base.encode({"w": new}, weight_version=2)
    >>> delta.manifest.entries["w"].encoding, delta.bytes_sent      # one int32 index + one fp32 value
    ('sparse', 8)
    >>> staged = base.apply(delta.manifest, delta.wire)
    >>> torch.equal(staged.changed["w"], new)
    True
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hotweights.core.buckets import layer_key
from hotweights.core.delta_wire import (
    DeltaEntry,
    DeltaManifest,
    delta_problems,
    index_dtype_for,
    sparse_is_smaller,
    wire_name,
)
from hotweights.core.errors import DeltaBaseMismatchError, Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec, dtype_to_str, tensor_digest

__all__ = ["DeltaBase", "DeltaState", "EncodedDelta", "StagedDelta", "reinstall_names"]

_INDEX_DTYPES: dict[str, torch.dtype] = {"torch.int32": torch.int32, "torch.int64": torch.int64}
_BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The elements of a flat contiguous tensor as integers of the same width (bitwise comparison)."""
    as_int = _BITS.get(flat.dtype.itemsize)
    if flat.dtype == torch.bool or as_int is None:
        return flat.view(torch.uint8).view(flat.numel(), flat.dtype.itemsize)
    return flat.view(as_int)


def _np_elements(flat: torch.Tensor) -> Any:
    """A flat contiguous CPU tensor's elements as a numpy array of same-width integers, sharing memory (rows of
    bytes for bool and odd widths): numpy's fancy indexing is far faster than torch's on CPU, and has no bf16."""
    return _bits(flat).numpy()


def _gather(flat: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``flat[pos]`` (``pos`` int64, CPU), a new flat tensor."""
    return torch.from_numpy(_np_elements(flat)[pos.numpy()]).reshape(-1).view(flat.dtype)


def _scatter(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[pos] = values`` in place (``flat`` contiguous CPU, ``pos`` int64, ``values`` flat in flat's dtype)."""
    _np_elements(flat)[pos.numpy()] = _np_elements(values.contiguous())


def _changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted flat int64 positions where the bits of ``new`` differ from ``old`` (both contiguous, CPU)."""
    a, b = _bits(old.reshape(-1)), _bits(new.reshape(-1))
    diff = a != b
    if diff.dim() == 2:
        diff = diff.any(dim=1)
    return torch.from_numpy(np.flatnonzero(diff.numpy()))  # ~30x faster than torch.nonzero on CPU


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s values (``t`` itself when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy."""
    t = t.detach()
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def reinstall_names(changed: Iterable[str], names: Iterable[str], group: Callable[[str], str] = layer_key) -> list[str]:
    """Every name of ``names`` (in order) whose group holds a changed name: what an engine must reinstall.

    The group is the transformer block (``layer_key``): an engine rebuilds a fused parameter (q/k/v ->
    ``qkv_proj``, gate/up -> ``gate_up_proj``) from all its parts in one go, so a block with one changed part is
    reinstalled whole, its unchanged parts from the host copy.

    Example:
        >>> names = ["embed.weight", "layers.0.q.weight", "layers.0.k.weight", "layers.1.q.weight"]
        >>> reinstall_names(["layers.0.k.weight"], names)
        ['layers.0.q.weight', 'layers.0.k.weight']
    """
    touched = {group(n) for n in changed}
    return [n for n in names if group(n) in touched]


@dataclass
class EncodedDelta:
    """A delta ready to send: its manifest and its wire tensors (CPU)."""

    manifest: DeltaManifest
    wire: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor] = field(default_factory=dict)
    """Private CPU copies of the changed tensors (what the sender's base becomes once the delta is installed)."""

    @property
    def bytes_sent(self) -> int:
        return sum(t.nbytes for t in self.wire.values())


@dataclass
class StagedDelta:
    """A delta applied aside: the rebuilt tensors, and what the engine must reinstall; the base is untouched."""

    version: int
    changed: dict[str, torch.Tensor]
    """Name -> new whole tensor, for every changed tensor (private copies)."""
    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """What to install: every tensor of each block that changed (unchanged parts from the base), in base order."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.items)


class DeltaBase:
    """A host copy of the weights last installed into one engine (checkpoint format, CPU) and their version.

    Memory: one copy of every installed tensor (the model once, in its dtype), plus, while a delta is applied,
    one more copy of the tensors that changed.
    """

    def __init__(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version = version
        self.tensors = tensors

    @classmethod
    def capture(
        cls, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> DeltaBase:
        """A private copy of ``tensors`` (any device) as the base at ``version``."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        return cls(version, {n: _copy(t) for n, t in items})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec.of(t) for n, t in self.tensors.items()}

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: int,
        update_id: str | None = None,
        digests: bool = False,
    ) -> EncodedDelta:
        """The delta from this base to ``tensors`` (same names, shapes and dtypes as the base).

        Raises:
            WeightManifestValidationError: a name, shape or dtype differs from the base (nothing encoded).
        """
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        problems = [
            Mismatch("unexpected", n, actual="not in the weights last installed") for n, _ in items
            if n not in self.tensors
        ]  # fmt: skip
        given = {n for n, _ in items}
        problems += [
            Mismatch("missing", n, expected="every tensor of the base") for n in self.tensors if n not in given
        ]
        for n, t in items:
            old = self.tensors.get(n)
            if old is not None and (old.shape != t.shape or old.dtype != t.dtype):
                want, got = f"{list(old.shape)} {old.dtype}", f"{list(t.shape)} {t.dtype}"
                problems.append(Mismatch("shape" if old.shape != t.shape else "dtype", n, expected=want, actual=got))
        if problems:
            raise WeightManifestValidationError(problems, context="delta update")
        entries: dict[str, DeltaEntry] = {}
        wire: dict[str, torch.Tensor] = {}
        copies: dict[str, torch.Tensor] = {}
        for name, t in items:
            new = _host(t)
            pos = _changed_positions(self.tensors[name], new)
            k, numel = pos.numel(), new.numel()
            if k == 0:
                continue
            new = copies[name] = new if new.data_ptr() != t.data_ptr() else _copy(new)  # never alias the caller
            shape, dtype = tuple(new.shape), dtype_to_str(new.dtype)
            digest = tensor_digest(new) if digests else None
            idx_dtype = index_dtype_for(numel)
            if sparse_is_smaller(k, numel, new.dtype.itemsize, _INDEX_DTYPES[idx_dtype].itemsize):
                entries[name] = DeltaEntry(
                    encoding="sparse", shape=shape, dtype=dtype, count=k, index_dtype=idx_dtype, digest=digest
                )
                wire[wire_name(name, "indices")] = pos.to(_INDEX_DTYPES[idx_dtype])
                wire[wire_name(name, "values")] = _gather(new.reshape(-1), pos)
            else:
                entries[name] = DeltaEntry(encoding="full", shape=shape, dtype=dtype, count=numel, digest=digest)
                wire[wire_name(name, "full")] = new
        manifest = DeltaManifest(
            update_id=update_id or uuid.uuid4().hex,
            weight_version=weight_version,
            base_version=self.version,
            entries=entries,
            unchanged=len(items) - len(entries),
        )
        return EncodedDelta(manifest, wire, copies)

    def staged(self, delta: EncodedDelta, *, group: Callable[[str], str] = layer_key) -> StagedDelta:
        """What :meth:`apply` returns for a delta this base just encoded, without checking or rebuilding it again
        (the sender's side: :meth:`encode` kept copies of the new tensors)."""
        if delta.manifest.base_version != self.version or set(delta.new) != set(delta.manifest.entries):
            raise ValueError("staged() takes a delta encoded by this base, at its current version")
        names = reinstall_names(delta.new, self.tensors, group)
        items = [(n, delta.new.get(n, self.tensors[n])) for n in names]
        return StagedDelta(delta.manifest.weight_version, dict(delta.new), items)

    def apply(
        self,
        delta: DeltaManifest,
        wire: Mapping[str, torch.Tensor],
        *,
        group: Callable[[str], str] = layer_key,
    ) -> StagedDelta:
        """Check ``delta`` completely, then rebuild the changed tensors aside (see :class:`StagedDelta`).

        Raises:
            DeltaBaseMismatchError: ``delta.base_version`` is not this base's version.
            WeightManifestValidationError: :func:`delta_problems` found any, or a rebuilt tensor does not match
                its digest; the base is untouched either way.
        """
        if delta.base_version != self.version:
            raise DeltaBaseMismatchError(delta.weight_version, delta.base_version, f"v{self.version}")
        problems = delta_problems(delta, self.specs(), wire)
        if problems:
            raise WeightManifestValidationError(problems, context="delta update")
        changed: dict[str, torch.Tensor] = {}
        for name, e in delta.entries.items():
            if e.encoding == "full":
                changed[name] = _copy(wire[wire_name(name, "full")])
            else:
                new = _copy(self.tensors[name])
                idx = wire[wire_name(name, "indices")].detach().to(device="cpu", dtype=torch.int64)
                _scatter(new.view(-1), idx.contiguous(), wire[wire_name(name, "values")].detach().to("cpu"))
                changed[name] = new
        bad = [
            Mismatch("digest", n, expected=str(e.digest), actual=tensor_digest(changed[n]))
            for n, e in delta.entries.items()
            if e.digest is not None and tensor_digest(changed[n]) != e.digest
        ]
        if bad:
            raise WeightManifestValidationError(bad, context="delta update (rebuilt tensors)")
        names = reinstall_names(changed, self.tensors, group)
        items = [(n, changed.get(n, self.tensors[n])) for n in names]
        return StagedDelta(delta.weight_version, changed, items)

    def commit(self, staged: StagedDelta) -> None:
        """Make the rebuilt tensors the base (after the engine installed them). Replaces, never writes in place:
        tensors handed to an engine by reference stay as they were."""
        self.tensors.update(staged.changed)
        self.version = staged.version


class DeltaState:
    """What the trainer keeps for delta installs into one engine, shared by every adapter on it (it lives on the
    engine's handle): the base, whether every install keeps it current, and the engine's version when it was taken.

    Once a ``delta=True`` install asked for it (``tracking``), every install into the engine, whichever adapter
    made it, keeps ``base`` as what the engine serves; a failed write or an install by someone else drops it.
    """

    def __init__(self) -> None:
        self.base: DeltaBase | None = None
        """Host copy of what the engine serves (None: the next delta install sends everything)."""
        self.tracking = False
        """Keep ``base`` current on every install (set by the first ``delta=True`` install)."""
        self.engine_version: str | None = None
        """The version the engine reported right after ``base`` was taken."""

    def forget(self) -> None:
        """Drop the base and stop tracking."""
        self.base, self.tracking, self.engine_version = None, False, None
