"""Where an install's tensors come from: one rank's own tensors (:class:`LocalTensors`), or a sharded state dict
gathered tensor by tensor from every rank (:class:`~hotweights.core.sharded.Gatherer`), behind one contract
(:class:`TensorSource`). The install asks its source for the update under the names the engine loads, then tells it
how the install ended."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from hotweights.core.manifest import ExpectedWeights, MetadataValue, WeightUpdateManifest
from hotweights.core.names import to_checkpoint

__all__ = ["LocalTensors", "TensorSource", "checkpoint_names"]

Items = list[tuple[str, torch.Tensor]]


class TensorSource(Protocol):
    """What an install reads its tensors from."""

    def update(
        self,
        expected: ExpectedWeights | None,
        weight_version: int,
        *,
        update_id: str | None,
        layout: Any,
        metadata: Mapping[str, MetadataValue] | None,
        digests: bool,
    ) -> tuple[Sequence[tuple[str, torch.Tensor]], WeightUpdateManifest]:
        """The tensors under the names an engine expecting ``expected`` loads (None: as given), and their
        manifest. Refusals raise, typed, before anything is read or sent."""
        ...

    def finish(self, outcome: Any) -> None:
        """The install ended with ``outcome`` (its report, or the exception it raised)."""
        ...


class LocalTensors:
    """This process's own tensors (checkpoint names, or transformers' in-memory ones)."""

    def __init__(self, items: Items) -> None:
        self.items = items

    def update(
        self,
        expected: ExpectedWeights | None,
        weight_version: int,
        *,
        update_id: str | None = None,
        layout: Any = None,
        metadata: Mapping[str, MetadataValue] | None = None,
        digests: bool = False,
    ) -> tuple[Items, WeightUpdateManifest]:
        items = checkpoint_names(expected, self.items)
        manifest = WeightUpdateManifest.from_state_dict(
            items, weight_version=weight_version, update_id=update_id, layout=layout, metadata=metadata, digests=digests
        )
        return items, manifest

    def finish(self, outcome: Any) -> None:
        """Nothing to tell: no other rank waits."""


def checkpoint_names(expected: ExpectedWeights | None, items: Items) -> Items:
    """transformers 5's in-memory names (fused MoE experts, ...) -> the checkpoint's, for an engine that expects
    ``expected`` (None: unknown, the names are kept)."""
    if expected is None:
        return items
    out, _ = to_checkpoint(items, expected.tensors, expected.model_type, architectures=expected.architectures)
    return list(out)
