"""The wire format of a delta install, and its checks (pure logic).

A delta travels as plain tensors, named ``<name>:indices`` and ``<name>:values`` (sparse) or ``<name>:full``
(:func:`wire_name`), described by a :class:`DeltaManifest` (JSON, no pickle): the buckets and transports of full
installs carry it as they are. :func:`delta_problems` checks a delta and its wire tensors against the base they
apply to before anything is built; :mod:`hotweights.core.delta` encodes and applies them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from hotweights.core.errors import Mismatch, WeightManifestValidationError
from hotweights.core.manifest import TensorSpec, WeightUpdateManifest, dtype_to_str

__all__ = [
    "DeltaEntry",
    "DeltaManifest",
    "IndexDtype",
    "delta_problems",
    "index_dtype_for",
    "sparse_is_smaller",
    "wire_name",
]

IndexDtype = Literal["torch.int32", "torch.int64"]
"""The dtypes a sparse entry's indices may have."""


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
