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
described by a :class:`DeltaManifest` (JSON, no pickle): the buckets and transports of full installs carry it as
they are.

Both ends keep a :class:`DeltaBase`, a host copy of the weights last installed: the trainer one per engine
(:class:`DeltaState`, on the engine's handle, shared by every adapter on it), every worker of a multiprocess engine
one more; an in-process worker is lent the trainer's. :meth:`DeltaBase.apply` checks a
delta completely (:func:`delta_problems`) before it builds anything, then builds the new tensors aside (the base
is never written in place) and lists what to reinstall: every tensor of each transformer block that changed
(:func:`~hotweights.core.buckets.layer_key`), because an engine rebuilds fused parameters (q/k/v, gate/up) from
complete parts only. :meth:`DeltaBase.commit` swaps the new tensors in once the engine took them.

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
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from hotweights.core.buckets import layer_key
from hotweights.core.errors import DeltaBaseMismatchError, Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec, WeightUpdateManifest, dtype_to_str, tensor_digest

__all__ = [
    "DeltaBase",
    "DeltaEntry",
    "DeltaManifest",
    "DeltaState",
    "EncodedDelta",
    "StagedDelta",
    "delta_problems",
    "index_dtype_for",
    "reinstall_names",
    "sparse_is_smaller",
    "wire_name",
]

IndexDtype = Literal["torch.int32", "torch.int64"]
_INDEX_DTYPES: dict[str, torch.dtype] = {"torch.int32": torch.int32, "torch.int64": torch.int64}
_BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaEntry(BaseModel):
    """How one changed tensor travels."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    encoding: Literal["full", "sparse"]
    """``sparse``: ``<name>:indices`` + ``<name>:values``; ``full``: ``<name>:full``."""
    shape: tuple[StrictInt, ...]
    """Shape of the tensor (as in the base)."""
    dtype: str
    """dtype of the tensor and of its values, e.g. ``"torch.bfloat16"``."""
    count: StrictInt = Field(ge=0)
    """Elements sent: the positions that changed (sparse), or every element (full)."""
    index_dtype: IndexDtype | None = None
    """dtype of the indices (sparse only)."""
    digest: str | None = Field(default=None, pattern=r"^blake2b:[0-9a-f]{32}$")
    """Optional digest of the whole new tensor: the receiver checks what it rebuilt against it."""


class DeltaManifest(BaseModel):
    """A delta update: the version it installs, the version it applies to, and how each changed tensor travels.

    ``entries`` may be empty (nothing changed: only the version moves).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    update_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    weight_version: StrictInt = Field(ge=0)
    """Version the engine serves after this delta."""
    base_version: StrictInt = Field(ge=0)
    """Version the delta was computed against: the engine must serve exactly this one, or it refuses."""
    entries: dict[str, DeltaEntry] = Field(default_factory=dict)
    """Changed tensors only, in the order of the update."""
    unchanged: StrictInt = Field(default=0, ge=0)
    """Tensors of the update that did not change (not sent)."""

    def wire_specs(self) -> dict[str, TensorSpec]:
        """Name -> spec of every tensor this delta puts on the wire, in order."""
        out: dict[str, TensorSpec] = {}
        for name, e in self.entries.items():
            if e.encoding == "full":
                out[wire_name(name, "full")] = TensorSpec(shape=e.shape, dtype=e.dtype)
            else:
                out[wire_name(name, "indices")] = TensorSpec(shape=(e.count,), dtype=e.index_dtype or "torch.int64")
                out[wire_name(name, "values")] = TensorSpec(shape=(e.count,), dtype=e.dtype)
        return out

    @property
    def bytes_sent(self) -> int:
        """Bytes of the wire tensors: what crosses to the engine."""
        return sum(s.expected_nbytes for s in self.wire_specs().values())

    def wire_manifest(self, wire: Mapping[str, torch.Tensor] | None = None) -> WeightUpdateManifest | None:
        """The manifest of the wire tensors (same update id and version), which buckets and transports carry;
        None when nothing changed. With ``wire`` given, each spec carries the tensor's digest (checked after
        transit)."""
        specs = self.wire_specs()
        if not specs:
            return None
        if wire is not None:
            specs = {n: TensorSpec.of(wire[n], digest=True) for n in specs}
        return WeightUpdateManifest.parse(
            {"update_id": self.update_id, "weight_version": self.weight_version, "tensors": specs}
        )

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> DeltaManifest:
        """Parse :meth:`to_json` output; a malformed one raises :class:`WeightManifestValidationError`."""
        import pydantic

        try:
            return cls.model_validate_json(text)
        except pydantic.ValidationError as exc:
            problems = [
                Mismatch("delta", ".".join(str(p) for p in err["loc"]) or "delta", expected="valid", actual=err["msg"])
                for err in exc.errors()
            ]
            raise WeightManifestValidationError(problems, context="delta update") from exc


def wire_name(name: str, part: Literal["full", "indices", "values"]) -> str:
    """``"w"``, ``"indices"`` -> ``"w:indices"``: the name a part of a delta travels under."""
    return f"{name}:{part}"


def index_dtype_for(numel: int) -> IndexDtype:
    """int32 indices where every position fits in them, else int64."""
    return "torch.int32" if numel <= 2**31 - 1 else "torch.int64"


def sparse_is_smaller(changed: int, numel: int, itemsize: int, index_itemsize: int = 4) -> bool:
    """Whether indices + values of ``changed`` elements are fewer bytes than the whole tensor (the threshold).

    Example:
        >>> sparse_is_smaller(333, 1000, itemsize=2), sparse_is_smaller(334, 1000, itemsize=2)  # bf16: 1/3
        (True, False)
    """
    return changed * (index_itemsize + itemsize) < numel * itemsize


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


def delta_problems(
    delta: DeltaManifest, base: Mapping[str, TensorSpec], wire: Mapping[str, torch.Tensor]
) -> list[Mismatch]:
    """Every way ``delta`` and its ``wire`` tensors do not fit ``base`` (name -> spec); empty when they apply.

    Checked: each entry names a base tensor with its shape and dtype; full entries carry one tensor of that shape;
    sparse entries carry 1-D indices (their declared int32/int64) and values (the tensor's dtype) of ``count``
    elements each, ``0 < count <= numel``, indices inside ``[0, numel)``, strictly increasing (sorted, no
    duplicates); no wire tensor is left undescribed.
    """
    out: list[Mismatch] = []
    described: set[str] = set()
    for name, e in delta.entries.items():
        spec = base.get(name)
        if spec is None:
            out.append(Mismatch("unexpected", name, actual="not in the weights last installed (the delta's base)"))
            continue
        if tuple(e.shape) != spec.shape:
            out.append(Mismatch("shape", name, expected=str(list(spec.shape)), actual=str(list(e.shape))))
            continue
        if e.dtype != spec.dtype:
            out.append(Mismatch("dtype", name, expected=spec.dtype, actual=e.dtype))
            continue
        numel = spec.numel
        if e.encoding == "full":
            key = wire_name(name, "full")
            described.add(key)
            if e.index_dtype is not None:
                out.append(Mismatch("delta", name, expected="no index dtype (full entry)", actual=e.index_dtype))
            if e.count != numel:
                out.append(Mismatch("delta", name, expected=f"count {numel} (full entry)", actual=f"count {e.count}"))
            out += _wire_tensor_problems(wire, key, spec.shape, spec.dtype)
            continue
        ikey, vkey = wire_name(name, "indices"), wire_name(name, "values")
        described.update((ikey, vkey))
        if e.index_dtype is None:
            out.append(Mismatch("delta", name, expected="an index dtype (sparse entry)", actual="none"))
            continue
        if not 0 < e.count <= numel:
            out.append(Mismatch("delta", name, expected=f"1 to {numel} changed elements", actual=f"count {e.count}"))
            continue
        vbad = _wire_tensor_problems(wire, vkey, (e.count,), spec.dtype)
        ibad = _wire_tensor_problems(wire, ikey, (e.count,), e.index_dtype)
        out += vbad + ibad
        if not ibad:
            out += _index_problems(ikey, wire[ikey], numel)
    for key in wire:
        if key not in described:
            out.append(Mismatch("unexpected", key, actual="a wire tensor that no delta entry describes"))
    return out


def _wire_tensor_problems(
    wire: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...], dtype: str
) -> list[Mismatch]:
    t = wire.get(key)
    if t is None:
        return [Mismatch("missing", key, expected=f"{list(shape)} {dtype}")]
    if not isinstance(t, torch.Tensor):
        return [Mismatch("not_tensor", key, expected="a torch.Tensor", actual=type(t).__name__)]
    out = []
    if tuple(t.shape) != shape:
        if len(shape) == 1 and t.dim() == 1:
            out.append(Mismatch("delta", key, expected=f"{shape[0]} elements (the count)", actual=f"{t.numel()}"))
        else:
            out.append(Mismatch("shape", key, expected=str(list(shape)), actual=str(list(t.shape))))
    if dtype_to_str(t.dtype) != dtype:
        out.append(Mismatch("dtype", key, expected=dtype, actual=dtype_to_str(t.dtype)))
    return out


def _index_problems(key: str, indices: torch.Tensor, numel: int) -> list[Mismatch]:
    idx = indices.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    out = []
    bad = torch.nonzero((idx < 0) | (idx >= numel)).view(-1)
    if bad.numel():
        show = idx[bad[:3]].tolist()
        out.append(
            Mismatch("delta", key, expected=f"indices in [0, {numel})", actual=f"{bad.numel()} outside, e.g. {show}")
        )
    step = idx[1:] - idx[:-1]
    dup = torch.nonzero(step == 0).view(-1)
    if dup.numel():
        out.append(
            Mismatch(
                "delta", key, expected="no duplicate indices", actual=f"{dup.numel()} repeated, e.g. {idx[dup[0]]}"
            )
        )
    down = torch.nonzero(step < 0).view(-1)
    if down.numel():
        i = int(down[0])
        out.append(
            Mismatch(
                "delta",
                key,
                expected="indices sorted ascending",
                actual=f"{idx[i]} then {idx[i + 1]} at position {i}",
            )
        )
    return out


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
