"""How the tensors of an update are laid out, and what this version of hotweights can install."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from hotweights.core.errors import UnsupportedLayoutError

__all__ = ["SUPPORTED_FORMATS", "WeightFormat", "WeightLayout"]

WeightFormat = Literal["checkpoint", "kernel"]

#: Formats this version installs. ``kernel`` (vLLM's fused, post-processed parameters) is described so that a
#: manifest can say what it carries, but no adapter accepts it yet.
SUPPORTED_FORMATS: frozenset[str] = frozenset({"checkpoint"})


class WeightLayout(BaseModel):
    """Where the tensors come from and how they are cut.

    Example:
        >>> WeightLayout().validate_supported()
        >>> WeightLayout(format="checkpoint", tp_rank=0, tp_size=1).is_full
        True
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: WeightFormat = "checkpoint"
    """``checkpoint``: Hugging Face names, q/k/v and gate/up separate (what ``model.state_dict()`` gives).
    ``kernel``: vLLM's own parameter names and fused shapes."""
    tp_rank: StrictInt = Field(default=0, ge=0)
    """Tensor-parallel rank these tensors belong to (0 for full tensors)."""
    tp_size: StrictInt = Field(default=1, ge=1)
    """Tensor-parallel size the tensors were cut for; 1 means full, unsharded tensors."""

    @model_validator(mode="after")
    def _rank_in_range(self) -> WeightLayout:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be smaller than tp_size {self.tp_size}")
        return self

    @property
    def is_full(self) -> bool:
        """True when the tensors are whole (not a tensor-parallel shard)."""
        return self.tp_size == 1

    def validate_supported(self, formats: frozenset[str] = SUPPORTED_FORMATS, sharded: bool = False) -> None:
        """Raise :class:`UnsupportedLayoutError` unless this layout can be installed.

        Args:
            formats: formats the caller (usually an adapter) accepts.
            sharded: whether the caller accepts tensor-parallel shards (``tp_size > 1``).
        """
        if self.format not in formats:
            raise UnsupportedLayoutError(
                f"weight format {self.format!r} is not supported here (supported: {sorted(formats)}); "
                "send checkpoint-format tensors, e.g. the trainer's model.state_dict()."
            )
        if not self.is_full and not sharded:
            raise UnsupportedLayoutError(
                f"tensor-parallel shards (tp_rank={self.tp_rank}, tp_size={self.tp_size}) are not supported by "
                "this adapter; send full tensors (tp_size=1) and let the engine take its own shard."
            )
