"""WeightLayout: defaults, range checks and what this version can install."""

from __future__ import annotations

import pydantic
import pytest

from hotweights import HotWeightsError, UnsupportedLayoutError, WeightLayout
from hotweights.core.layout import SUPPORTED_FORMATS


def test_defaults() -> None:
    layout = WeightLayout()
    assert layout.format == "checkpoint"
    assert layout.tp_rank == 0
    assert layout.tp_size == 1
    assert layout.is_full is True
    assert layout.validate_supported() is None


def test_supported_formats_is_checkpoint_only() -> None:
    assert frozenset({"checkpoint"}) == SUPPORTED_FORMATS


@pytest.mark.parametrize(("rank", "size"), [(1, 1), (2, 2), (3, 2), (8, 4)])
def test_rank_not_below_size_is_refused(rank: int, size: int) -> None:
    with pytest.raises(pydantic.ValidationError, match=f"tp_rank {rank} must be smaller than tp_size {size}"):
        WeightLayout(tp_rank=rank, tp_size=size)


def test_rank_below_size_is_a_shard() -> None:
    layout = WeightLayout(tp_rank=1, tp_size=2)
    assert layout.is_full is False
    assert (layout.tp_rank, layout.tp_size) == (1, 2)


@pytest.mark.parametrize("kwargs", [{"tp_rank": -1}, {"tp_size": 0}, {"tp_size": -2}, {"format": "fused"}])
def test_out_of_range_fields_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        WeightLayout(**kwargs)  # type: ignore[arg-type]


def test_frozen_and_no_extra_fields() -> None:
    layout = WeightLayout()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        layout.tp_size = 2  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        WeightLayout(pp_rank=0)  # type: ignore[call-arg]


def test_kernel_format_is_refused_with_what_to_do() -> None:
    with pytest.raises(UnsupportedLayoutError) as info:
        WeightLayout(format="kernel").validate_supported()
    msg = str(info.value)
    assert "weight format 'kernel' is not supported here" in msg
    assert "(supported: ['checkpoint'])" in msg
    assert "send checkpoint-format tensors" in msg
    assert "model.state_dict()" in msg
    assert isinstance(info.value, HotWeightsError)


def test_kernel_format_accepted_when_caller_accepts_it() -> None:
    WeightLayout(format="kernel").validate_supported(frozenset({"checkpoint", "kernel"}))


def test_checkpoint_refused_when_caller_only_accepts_kernel() -> None:
    with pytest.raises(UnsupportedLayoutError, match=r"'checkpoint' is not supported here \(supported: \['kernel'\]\)"):
        WeightLayout().validate_supported(frozenset({"kernel"}))


def test_shards_refused_unless_sharded_with_what_to_do() -> None:
    layout = WeightLayout(tp_rank=1, tp_size=2)
    with pytest.raises(UnsupportedLayoutError) as info:
        layout.validate_supported()
    msg = str(info.value)
    assert "tensor-parallel shards (tp_rank=1, tp_size=2) are not supported" in msg
    assert "send full tensors (tp_size=1)" in msg
    assert "let the engine take its own shard" in msg
    assert layout.validate_supported(sharded=True) is None


def test_format_is_checked_before_sharding() -> None:
    with pytest.raises(UnsupportedLayoutError, match="weight format 'kernel'"):
        WeightLayout(format="kernel", tp_rank=0, tp_size=4).validate_supported()
