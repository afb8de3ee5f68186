"""Casting on the way in: a trainer's fp32 master weights installed into a bf16 engine (pure logic).

``install(..., cast=torch.bfloat16)`` (or ``cast="engine"``: each tensor to the dtype the engine expects for it)
casts floating-point tensors whose dtype differs. The cast is lazy: :class:`CastItems` keeps the caller's tensors
and casts one when it is read, so the transports cast bucket by bucket (each cast copy is dropped once its bucket
is written) and the update is never held twice. Integer and bool tensors are never cast. Without ``cast`` a dtype
difference stays a refusal that names this opt-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, overload

import torch

from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest, dtype_to_str

__all__ = [
    "BucketSource",
    "Cast",
    "CastItems",
    "Load",
    "Parts",
    "cast_targets",
    "item_names",
    "items_of",
    "lazy_mapping",
    "uncast",
]

Cast = torch.dtype | Literal["engine"]
"""A dtype every floating-point tensor is cast to, or ``"engine"``: the dtype the engine expects for each."""

Load = Callable[[str, torch.Tensor], torch.Tensor]


class Parts(Protocol):
    """A source that can read rows of some tensors alone (a sharded state dict gathers only those rows)."""

    def splits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (as the source holds it) may be read in parts."""

    def load_rows(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``tensor``'s data."""

    def parts_at_most(self, limit: int) -> None:
        """The bucket size: views of large tensors are then read from parts of about ``limit`` bytes."""

    def rank_writes(self) -> Any:
        """The leader's side of rank-parallel writes (:mod:`hotweights.core.rank_writes`), or None."""


"""``load(name, tensor)``: the data behind a placeholder (e.g. a sharded tensor gathered when read), or ``tensor``."""


def cast_targets(
    manifest: WeightUpdateManifest, cast: Cast, expected: ExpectedWeights | None
) -> dict[str, torch.dtype]:
    """Name -> dtype for each floating-point tensor of ``manifest`` that must change dtype.

    Raises:
        ValueError: ``cast`` is neither a floating-point dtype nor ``"engine"``, or ``"engine"`` with no
            knowledge of the engine's dtypes.
    """
    if cast == "engine":
        if expected is None:
            raise ValueError(
                'cast="engine" needs the engine\'s dtypes, which are not known here (its checkpoint cannot be '
                "read); pass the dtype, e.g. cast=torch.bfloat16. Nothing was written."
            )
        wanted = {n: s.torch_dtype for n, s in expected.tensors.items() if s.torch_dtype.is_floating_point}
    elif isinstance(cast, torch.dtype) and cast.is_floating_point:
        wanted = dict.fromkeys(manifest.tensors, cast)
    else:
        raise ValueError(f'cast must be a floating-point torch dtype or "engine", not {cast!r}; nothing was written')
    return {
        name: wanted[name]
        for name, spec in manifest.tensors.items()
        if name in wanted and spec.torch_dtype.is_floating_point and spec.torch_dtype != wanted[name]
    }


class CastItems(Sequence[tuple[str, torch.Tensor]]):
    """``(name, tensor)`` pairs whose tensors named in ``targets`` are cast when read, one at a time.

    Nothing is cast up front: code that reads a bucket's tensors casts that bucket only, and a cast copy lives as
    long as its reader keeps it. :attr:`source` holds the caller's tensors. With ``load``, a read first turns the
    source tensor into its data (:mod:`hotweights.core.sharded`: ``meta`` placeholders of a sharded state dict,
    gathered when read); the source then only describes names, shapes and dtypes.
    """

    def __init__(
        self,
        source: Sequence[tuple[str, torch.Tensor]],
        targets: Mapping[str, torch.dtype],
        load: Load | None = None,
        parts: Parts | None = None,
    ) -> None:
        self.source = list(source)
        self.targets = dict(targets)
        self.load = load
        self.parts = parts

    @overload
    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]: ...
    @overload
    def __getitem__(self, index: slice) -> CastItems: ...
    def __getitem__(self, index: int | slice) -> tuple[str, torch.Tensor] | CastItems:
        if isinstance(index, slice):
            return CastItems(self.source[index], self.targets, self.load, self.parts)
        name, tensor = self.source[index]
        return name, self._cast(name, tensor)

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            yield name, self._cast(name, tensor)

    def _cast(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.load is not None:
            tensor = self.load(name, tensor)
        dtype = self.targets.get(name)
        return tensor if dtype is None else tensor.to(dtype)

    def splits(self, index: int) -> bool:
        """Whether item ``index`` may be read in parts (:meth:`rows`)."""
        return self.parts is not None and self.parts.splits(self.source[index][1])

    def rows(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of item ``index``, cast: read alone where the source can."""
        name, tensor = self.source[index]
        if self.parts is None or not self.parts.splits(tensor):
            return self._cast(name, tensor)[start:stop]
        part = self.parts.load_rows(tensor, start, stop)
        dtype = self.targets.get(name)
        return part if dtype is None else part.to(dtype)

    def without(self, names: Mapping[str, object]) -> CastItems:
        """The same pairs less those named in ``names``."""
        return CastItems([(n, t) for n, t in self.source if n not in names], self.targets, self.load, self.parts)

    def recast(self, targets: Mapping[str, torch.dtype]) -> CastItems:
        """The same pairs (and loader), cast to ``targets`` instead."""
        return CastItems(self.source, targets, self.load, self.parts)

    def manifest(self, manifest: WeightUpdateManifest) -> WeightUpdateManifest:
        """``manifest`` as the engine receives it: cast tensors in their new dtype (digests of the cast bytes)."""
        digests = manifest.has_digests
        tensors = dict(manifest.tensors)
        for name, tensor in self.source:
            dtype = self.targets.get(name)
            if dtype is not None and digests:  # hashing needs the cast bytes: one tensor at a time
                tensors[name] = TensorSpec.of(self._cast(name, tensor), digest=True)
            elif dtype is not None:
                spec = TensorSpec.model_construct(
                    shape=tuple(tensor.shape), dtype=dtype_to_str(dtype), nbytes=tensor.numel() * dtype.itemsize
                )
                tensors[name] = spec
        return manifest.model_copy(update={"tensors": tensors})

    @property
    def cast_tensors(self) -> int:
        """How many tensors change dtype."""
        return sum(1 for n, _ in self.source if n in self.targets)

    @property
    def cast_bytes(self) -> int:
        """Bytes of the cast tensors before the cast (what the caller handed over)."""
        return sum(t.nbytes for n, t in self.source if n in self.targets)


class BucketSource(Mapping[str, torch.Tensor]):
    """What an install's buckets are read from: name -> tensor over :class:`CastItems` (each read casts, or gathers
    a sharded tensor) or plain pairs, and what the source can do, declared here: :attr:`split` (tensors that may
    travel in parts), :attr:`reads_in_order` (reads are collectives), :meth:`parts_at_most`, :meth:`rank_writes`."""

    def __init__(self, items: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        if isinstance(items, Mapping):
            items = list(items.items())
        self._plain = None if isinstance(items, CastItems) else items
        self._items = items if isinstance(items, CastItems) else CastItems(items, {})
        self._index = {name: i for i, (name, _) in enumerate(self._items.source)}

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> BucketSource:
        """``tensors`` as a bucket source (itself when it is one)."""
        return tensors if isinstance(tensors, BucketSource) else cls(tensors)

    @property
    def split(self) -> Callable[[str], bool] | None:
        """:meth:`splits` where some tensors may travel in parts (a sharded state dict), else None."""
        return self.splits if self._items.parts is not None else None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._items[self._index[name]][1]

    def splits(self, name: str) -> bool:
        """Whether ``name`` may travel in parts (see :func:`hotweights.core.buckets.plan_buckets`)."""
        return self._items.splits(self._index[name])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name`` (:func:`hotweights.core.buckets.rows_of`)."""
        return self._items.rows(self._index[name], start, stop)

    def parts_at_most(self, limit: int) -> None:
        """Tell a source that gathers what it reads (a sharded state dict) the bucket size: it then reads views of
        large tensors from parts of about ``limit`` bytes (see ``Gatherer.parts_at_most``)."""
        if self._items.parts is not None:
            self._items.parts.parts_at_most(limit)

    @property
    def reads_in_order(self) -> bool:
        """Whether reads must come one at a time, in the plan's order: a loader that gathers each tensor across
        the ranks of a sharded install (a collective every rank runs in the same order)."""
        return self._items.load is not None

    def rank_writes(self) -> Any:
        """Where every rank of a sharded install can write its own rows (:mod:`hotweights.core.rank_writes`): the
        leader's side of it (each rank casts what it writes, as the manifest says); None otherwise."""
        return self._items.parts.rank_writes() if self._items.parts is not None else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def lazy_mapping(items: Sequence[tuple[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
    """``dict(items)``, except that :class:`CastItems` stay lazy (a read casts one tensor)."""
    return BucketSource(items) if isinstance(items, CastItems) else dict(items)


def items_of(tensors: Mapping[str, torch.Tensor]) -> Sequence[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs behind ``tensors`` (a :func:`lazy_mapping`), still lazy where they cast."""
    if isinstance(tensors, BucketSource):
        return tensors._plain if tensors._plain is not None else tensors._items
    return list(tensors.items())


def uncast(items: Sequence[tuple[str, torch.Tensor]]) -> Sequence[tuple[str, torch.Tensor]]:
    """The caller's own (name, tensor) pairs behind ``items``, as given (:class:`CastItems`: before their cast)."""
    return items.source if isinstance(items, CastItems) else items


def item_names(items: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of ``items`` without reading (casting) their tensors."""
    return [n for n, _ in uncast(items)]
