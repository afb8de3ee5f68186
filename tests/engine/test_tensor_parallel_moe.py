"""Tensor parallelism with mixture-of-experts: a TP=2 engine, its experts split across two CPU workers (Qwen3-MoE in
the default run; GPT-OSS, with its biased experts and attention sinks split too, in the matrix)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hotweights
from hotweights.adapters import VLLMWeightsPathAdapter

from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm
from .test_tensor_parallel import tp2_engine

pytestmark = pytest.mark.engine


MOE = [
    pytest.param(Variant("qwen3_moe", torch.float32, tie=False), id="qwen3_moe"),
    pytest.param(Variant("gpt_oss", torch.float32, tie=False), id="gpt_oss", marks=pytest.mark.matrix),
]


@pytest.mark.parametrize("variant", MOE)
def test_tensor_parallel_moe(variant: Variant, checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    """A TP=2 MoE engine (experts split across two workers): the trainer's fused experts, A -> B -> A, through
    the extension's default and vLLM's own reload (zero-config)."""
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    assert a.fresh != b.fresh
    with tp2_engine(a.path) as llm:
        report = hotweights.install(llm, b.state_dict(), weight_version=1)
        assert report.adapter == "multiprocess-shm" and report.install_method == "reload"
        assert greedy_vllm(llm) == b.fresh
        zero_config = VLLMWeightsPathAdapter(llm)  # vLLM's own reload_weights(weights_path), mended by the plugin
        zero_config.active_weight_version = 1
        hotweights.install(llm, a.state_dict(), weight_version=2, adapter=zero_config)
        assert greedy_vllm(llm) == a.fresh
    assert our_shm() == []
