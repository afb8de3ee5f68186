"""What an update carries: :class:`TensorSpec` per tensor and the :class:`WeightUpdateManifest` around them.

A manifest is checked against the tensors (and against what the engine expects) *before* anything is written;
every mismatch is collected and raised together in one :class:`WeightManifestValidationError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import pydantic
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from hotweights.core.errors import Mismatch, WeightManifestValidationError
from hotweights.core.layout import WeightLayout

__all__ = [
    "ExpectedWeights",
    "TensorSpec",
    "TensorsLike",
    "WeightUpdateManifest",
    "compare_specs",
    "dtype_from_str",
    "dtype_to_str",
    "tensor_digest",
]

#: A tensor set: a mapping name -> tensor or an iterable of (name, tensor) pairs.
TensorsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

MetadataValue = str | int | Annotated[float, Field(allow_inf_nan=False)] | bool | None


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"torch.bfloat16"``."""
    return str(dtype)


@functools.lru_cache(maxsize=256)
def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` (or ``"bfloat16"``) -> ``torch.bfloat16``; ``ValueError`` if torch has no such dtype."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (expected a string like 'torch.float32')")
    return value


DIGEST_ALGORITHM = "blake2b"


def tensor_digest(tensor: torch.Tensor) -> str:
    """``"blake2b:<32 hex>"`` of the tensor's bytes (row-major, its own dtype), wherever it lives."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]
    return f"{DIGEST_ALGORITHM}:{h.hexdigest()}"


class TensorSpec(BaseModel):
    """Shape and dtype of one tensor, and optionally its size in bytes.

    Example:
        >>> spec = TensorSpec.of(torch.zeros(2, 3, dtype=torch.bfloat16))
        >>> spec.shape, spec.dtype, spec.nbytes
        ((2, 3), 'torch.bfloat16', 12)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[StrictInt, ...]
    """Full shape of the tensor, as ``tuple(tensor.shape)``."""
    dtype: str
    """torch dtype as its string, e.g. ``"torch.float32"``."""
    nbytes: StrictInt | None = Field(default=None, ge=0)
    """Size in bytes; when given it must equal numel * element size."""
    digest: str | None = Field(default=None, pattern=r"^blake2b:[0-9a-f]{32}$")
    """Optional :func:`tensor_digest` of the bytes; the receiving side verifies it before anything is installed."""

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        return shape

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, name: str) -> str:
        return dtype_to_str(dtype_from_str(name))

    @model_validator(mode="after")
    def _consistent_nbytes(self) -> TensorSpec:
        if self.nbytes is not None and self.nbytes != self.expected_nbytes:
            raise ValueError(
                f"nbytes {self.nbytes} does not match shape {self.shape} and dtype {self.dtype} "
                f"({self.expected_nbytes} bytes)"
            )
        return self

    @classmethod
    def of(cls, tensor: torch.Tensor, *, digest: bool = False) -> TensorSpec:
        """The spec of a tensor (nbytes included; its digest too when ``digest``).

        Built without re-validation: torch's shape, dtype and byte count satisfy every field's rule by construction
        (this runs for every tensor of every install).
        """
        return cls.model_construct(
            shape=tuple(tensor.shape),
            dtype=dtype_to_str(tensor.dtype),
            nbytes=tensor.nbytes,
            digest=tensor_digest(tensor) if digest else None,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def expected_nbytes(self) -> int:
        """numel * element size: what the tensor occupies when contiguous."""
        return self.numel * self.torch_dtype.itemsize


def _as_items(tensors: TensorsLike) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    try:
        return list(tensors)
    except TypeError:
        problem = Mismatch(
            "manifest", "tensors", actual=f"expected a mapping or (name, tensor) pairs, got {tensors!r:.80}"
        )
        raise WeightManifestValidationError([problem]) from None


def _is_pair(item: object) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)


def _tensor_problem(t: object) -> str | None:
    """Why a value cannot be installed, or None."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.is_nested or t.layout != torch.strided:
        return f"{t.layout} tensor: send dense tensors (tensor.to_dense())"
    if t.is_meta:
        return "meta tensor: it has no data to install"
    return None


def _item_problems(items: list[tuple[str, torch.Tensor]]) -> list[Mismatch]:
    """Items that are not (name, tensor) pairs, values that are not dense tensors with data, repeated names."""
    out: list[Mismatch] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not _is_pair(item):
            out.append(Mismatch("manifest", f"item {i}", actual=f"expected a (name, tensor) pair, got {item!r:.80}"))
            continue
        name, t = item
        why = _tensor_problem(t)
        if why is not None:
            out.append(Mismatch("not_tensor", name, expected="a dense torch.Tensor", actual=why))
        if name in seen:
            out.append(Mismatch("manifest", name, actual="name appears more than once"))
        seen.add(name)
    return out


class _Seen(NamedTuple):
    """Shape and dtype string of a tensor: what :func:`compare_specs` reads of a spec, without building one."""

    shape: tuple[int, ...]
    dtype: str


def _installable(items: list[tuple[str, torch.Tensor]]) -> dict[str, _Seen]:
    """Shape and dtype of the well-formed items (the others are reported by :func:`_item_problems`)."""
    return {
        item[0]: _Seen(tuple(item[1].shape), dtype_to_str(item[1].dtype))
        for item in items
        if _is_pair(item) and _tensor_problem(item[1]) is None
    }


def compare_specs(
    expected: Mapping[str, TensorSpec],
    actual: Mapping[str, TensorSpec] | Mapping[str, _Seen],
    *,
    ignore: Iterable[str] = (),
) -> list[Mismatch]:
    """Every difference between two name -> spec maps: missing, unexpected, shape and dtype.

    Names in ``ignore`` may be present in ``actual`` without being expected (e.g. a tied ``lm_head.weight``).
    """
    ignored = set(ignore)
    out: list[Mismatch] = []
    for name, spec in expected.items():
        if name not in actual:
            out.append(Mismatch("missing", name, expected=f"{list(spec.shape)} {spec.dtype}"))
    for name, got in actual.items():
        want = expected.get(name)
        if want is None:
            if name not in ignored:
                out.append(Mismatch("unexpected", name, actual=f"{list(got.shape)} {got.dtype}"))
            continue
        if want.shape != got.shape:
            out.append(Mismatch("shape", name, expected=str(list(want.shape)), actual=str(list(got.shape))))
        if want.dtype != got.dtype:
            out.append(Mismatch("dtype", name, expected=want.dtype, actual=got.dtype))
    return out


@dataclass(frozen=True)
class ExpectedWeights:
    """The checkpoint-format tensors an engine accepts, and names it accepts but ignores.

    ``ignored`` maps a name to why it is dropped (e.g. ``lm_head.weight`` of a tied model, which
    ``model.state_dict()`` includes but the engine reads from the embedding). ``model_type`` and ``architectures``
    (the checkpoint's ``config.json``) choose transformers' rules that map a trainer's in-memory names onto these
    (:func:`hotweights.core.names.to_checkpoint`).
    """

    tensors: Mapping[str, TensorSpec]
    ignored: Mapping[str, str] = field(default_factory=dict)
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    def mismatches(self, manifest: WeightUpdateManifest) -> list[Mismatch]:
        """Every way ``manifest`` differs from what the engine expects."""
        return compare_specs(self.tensors, manifest.tensors, ignore=self.ignored)


class WeightUpdateManifest(BaseModel):
    """One weight update: its id, the version it installs, and the spec of every tensor.

    Example:
        >>> sd = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
        >>> m = WeightUpdateManifest.from_state_dict(sd, weight_version=3)
        >>> m.validate(sd)                       # passes: same names, shapes, dtypes
        >>> WeightUpdateManifest.from_json(m.to_json()) == m
        True
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    update_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)
    """Unique id of this update (a fresh uuid4 hex by default); reports and logs carry it."""
    weight_version: StrictInt = Field(ge=0)
    """Monotonic version of the weights, usually the optimizer step. Installs refuse a version that is not newer
    than the active one unless forced."""
    tensors: dict[str, TensorSpec]
    """Tensor name (checkpoint/HF format) -> spec. Order is the order tensors are sent in."""
    layout: WeightLayout = Field(default_factory=WeightLayout)
    """Format and tensor-parallel cut of the tensors."""
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    """Free-form, JSON-serialisable annotations (e.g. the trainer's run id)."""

    @field_validator("tensors")
    @classmethod
    def _names_non_empty(cls, tensors: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        if not tensors:
            raise ValueError("a manifest must list at least one tensor")
        bad = [n for n in tensors if not n or n != n.strip()]
        if bad:
            raise ValueError(f"tensor names must be non-empty without surrounding spaces: {bad[:5]}")
        return tensors

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_state_dict(
        cls,
        tensors: TensorsLike,
        *,
        weight_version: int,
        update_id: str | None = None,
        layout: WeightLayout | None = None,
        metadata: Mapping[str, MetadataValue] | None = None,
        digests: bool = False,
    ) -> WeightUpdateManifest:
        """Describe a tensor set (mapping or ``(name, tensor)`` pairs).

        With ``digests=True`` every spec carries a :func:`tensor_digest`, which the engine side verifies after
        transit, before installing (costs one hash pass over the bytes: ~1 GB/s per core).

        Raises:
            WeightManifestValidationError: a value is not a tensor, or a name repeats.
        """
        items = _as_items(tensors)
        problems = _item_problems(items)
        if problems:
            raise WeightManifestValidationError(problems, context="manifest")
        specs = {name: TensorSpec.of(t, digest=digests) for name, t in items}
        return cls._build(specs, weight_version, update_id, layout, metadata)

    @classmethod
    def from_specs(
        cls,
        specs: Mapping[str, TensorSpec],
        *,
        weight_version: int,
        update_id: str | None = None,
        layout: WeightLayout | None = None,
        metadata: Mapping[str, MetadataValue] | None = None,
    ) -> WeightUpdateManifest:
        """A manifest of tensors described by their specs alone (e.g. a sharded state dict's global shapes)."""
        return cls._build(dict(specs), weight_version, update_id, layout, metadata)

    @classmethod
    def from_module(
        cls, module: torch.nn.Module, *, weight_version: int, update_id: str | None = None, **kwargs: Any
    ) -> WeightUpdateManifest:
        """Describe an ``nn.Module``'s ``state_dict()`` (parameters and persistent buffers)."""
        return cls.from_state_dict(module.state_dict(), weight_version=weight_version, update_id=update_id, **kwargs)

    @classmethod
    def from_safetensors(
        cls,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        weight_version: int,
        update_id: str | None = None,
        layout: WeightLayout | None = None,
        metadata: Mapping[str, MetadataValue] | None = None,
    ) -> WeightUpdateManifest:
        """Describe safetensors files (or a directory of them) from their headers, without reading the data."""
        from safetensors import safe_open

        specs: dict[str, TensorSpec] = {}
        for path in _safetensors_files(paths):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    specs[name] = TensorSpec(shape=tuple(sl.get_shape()), dtype=_st_dtype(sl.get_dtype()))
        return cls._build(specs, weight_version, update_id, layout, metadata)

    @classmethod
    def _build(
        cls,
        specs: dict[str, TensorSpec],
        weight_version: int,
        update_id: str | None,
        layout: WeightLayout | None,
        metadata: Mapping[str, MetadataValue] | None,
    ) -> WeightUpdateManifest:
        fields: dict[str, Any] = {"weight_version": weight_version, "tensors": specs}
        if update_id is not None:
            fields["update_id"] = update_id
        if layout is not None:
            fields["layout"] = layout
        if metadata is not None:
            fields["metadata"] = dict(metadata)
        return cls.parse(fields)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> WeightUpdateManifest:
        """Validate a dict into a manifest; a bad field raises :class:`WeightManifestValidationError`."""
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            raise _from_pydantic(exc) from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightUpdateManifest:
        """Parse :meth:`to_json` output; malformed JSON or fields raise :class:`WeightManifestValidationError`."""
        try:
            return cls.model_validate_json(text)
        except pydantic.ValidationError as exc:
            raise _from_pydantic(exc) from exc

    def to_json(self) -> str:
        return self.model_dump_json()

    # ------------------------------------------------------------------ queries
    @property
    def total_bytes(self) -> int:
        return sum(s.expected_nbytes for s in self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    def mismatches(self, tensors: TensorsLike) -> list[Mismatch]:
        """Every difference between this manifest and a tensor set (empty when they match)."""
        items = _as_items(tensors)
        return _item_problems(items) + compare_specs(self.tensors, _installable(items))

    def digest_mismatches(self, tensors: TensorsLike) -> list[Mismatch]:
        """Tensors whose bytes do not hash to the digest their spec carries (specs without one are skipped)."""
        out = []
        for name, t in _as_items(tensors):
            spec = self.tensors.get(name)
            if spec is not None and spec.digest is not None:
                got = tensor_digest(t)
                if got != spec.digest:
                    out.append(Mismatch("digest", name, expected=spec.digest, actual=got))
        return out

    @property
    def has_digests(self) -> bool:
        return any(s.digest is not None for s in self.tensors.values())

    def validate(self, tensors: TensorsLike) -> None:  # type: ignore[override]
        """Check names, shapes and dtypes of ``tensors`` against this manifest.

        Raises:
            WeightManifestValidationError: listing every missing, extra, mis-shaped or mis-typed tensor.
        """
        problems = self.mismatches(tensors)
        if problems:
            raise WeightManifestValidationError(problems)


def _from_pydantic(exc: pydantic.ValidationError) -> WeightManifestValidationError:
    problems = [
        Mismatch("manifest", ".".join(str(p) for p in err["loc"]) or "manifest", actual=err["msg"])
        for err in exc.errors()
    ]
    return WeightManifestValidationError(problems, context="manifest")


_ST_DTYPES = {
    "F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16",
    "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8", "U8": "torch.uint8",
    "BOOL": "torch.bool", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
}  # fmt: skip


def _st_dtype(name: str) -> str:
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise WeightManifestValidationError(
            [Mismatch("dtype", "safetensors header", expected=str(sorted(_ST_DTYPES)), actual=name)],
            "manifest",
        ) from None


def _safetensors_files(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        root = Path(paths)
        if root.is_dir():
            index = root / "model.safetensors.index.json"
            if index.exists():
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                return [root / n for n in names]
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {root}")
            return files
        return [root]
    return [Path(p) for p in paths]
