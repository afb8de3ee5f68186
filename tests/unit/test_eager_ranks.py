"""Eager logprob ranking while the family probe scores (:func:`hotweights.vllm.patches.rank_logprobs_eagerly`):
counted holds on vLLM's sampler's ranking function, the same counts as vLLM's expression, and vLLM's own function
back when the last hold is given back. A stand-in sampler module keeps this a unit test (the real one is checked on
engines in tests/engine/test_family_guard.py and test_guard_engines.py)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from hotweights.vllm import patches
from hotweights.vllm.worker.extension import ENGINE_OPS


def compiled(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Stands in for vLLM's compiled ``batched_count_greater_than``."""
    return (x >= values).sum(-1)


@pytest.fixture
def sampler(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = types.ModuleType(patches._SAMPLER)
    module.batched_count_greater_than = compiled  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, patches._SAMPLER, module)
    monkeypatch.setattr(patches._EagerRanks, "holds", 0)
    return module


def test_holds_are_counted_and_the_last_one_puts_vllms_function_back(sampler: Any) -> None:
    assert patches.rank_logprobs_eagerly(True)
    assert sampler.batched_count_greater_than is patches._count_at_least
    assert patches.rank_logprobs_eagerly(True)  # a second hold (an in-process engine's worker op beside the local one)
    assert patches.rank_logprobs_eagerly(False)
    assert sampler.batched_count_greater_than is patches._count_at_least  # one hold left
    assert patches.rank_logprobs_eagerly(False)
    assert sampler.batched_count_greater_than is compiled
    assert patches.rank_logprobs_eagerly(False)  # one give-back too many changes nothing
    assert sampler.batched_count_greater_than is compiled and patches._EagerRanks.holds == 0


def test_the_eager_counts_are_vllms() -> None:
    logprobs = torch.log_softmax(torch.randn(5, 97, generator=torch.Generator().manual_seed(0)), -1)
    picked = logprobs.gather(-1, torch.tensor([[3], [5], [7], [11], [13]]))
    assert torch.equal(patches._count_at_least(logprobs, picked), compiled(logprobs, picked))


def test_a_process_without_vllms_sampler_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, patches._SAMPLER, raising=False)
    assert patches.rank_logprobs_eagerly(True) is False
    assert patches._SAMPLER not in sys.modules  # nothing imported vLLM's sampler into it


def test_the_worker_operation_takes_only_a_boolean(sampler: Any) -> None:
    assert ENGINE_OPS["eager_ranks"](object(), on=True) is True
    assert sampler.batched_count_greater_than is patches._count_at_least
    assert ENGINE_OPS["eager_ranks"](object(), on=False) is True
    with pytest.raises(ValueError, match="eager_ranks takes"):
        ENGINE_OPS["eager_ranks"](object(), on="yes")
    assert sampler.batched_count_greater_than is compiled
