"""A reference engine started with a live engine's own settings (hotweights.testing.start_reference_engine): what a
hot-installed engine must equal token for token."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hotweights
from hotweights.testing import engine_settings, start_reference_engine

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


def test_a_reference_engine_has_the_live_engines_settings_and_equals_it_after_an_install(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False, max_model_len=96, seed=3)
    try:
        settings = engine_settings(llm)
        hotweights.install(llm, b.state_dict(), weight_version=1)
        hot = greedy_vllm(llm)
    finally:
        stop_engine(llm)  # one in-process engine at a time: a second one's shutdown would tear down the first's groups
    assert {k: settings[k] for k in ("dtype", "max_model_len", "enforce_eager", "seed", "max_num_seqs")} == {
        "dtype": "float32",
        "max_model_len": 96,
        "enforce_eager": True,
        "seed": 3,
        "max_num_seqs": 4,
    }
    assert settings["block_size"] == 32 and settings["kv_cache_memory_bytes"] == 64 << 20
    assert settings["enable_prefix_caching"] is True and settings["skip_tokenizer_init"] is True
    assert settings["compilation_config"] == {"mode": 0}  # eager
    reference = start_reference_engine(llm, b.path)
    try:
        assert reference.llm_engine.vllm_config.model_config.max_model_len == 96
        assert greedy_vllm(reference) == hot == b.fresh
    finally:
        stop_engine(reference)
