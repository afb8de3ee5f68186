"""engine_settings: a live engine's settings as vllm.LLM keyword arguments (a fake vllm_config, no vLLM)."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import torch

from hotweights.testing import engine_settings


class _Impl(enum.Enum):
    AUTO = "auto"


def _llm(*, eager: bool, mode: int, lora: Any = None, skip_tokenizer: bool = True) -> Any:
    model = SimpleNamespace(
        dtype=torch.bfloat16,
        max_model_len=2048,
        enforce_eager=eager,
        seed=7,
        skip_tokenizer_init=skip_tokenizer,
        tokenizer="/models/tok",
        trust_remote_code=False,
        quantization=None,
        model_impl=_Impl.AUTO,
        max_logprobs=20,
        logprobs_mode="raw_logprobs",
        hf_overrides={},
    )
    cache = SimpleNamespace(
        block_size=16,
        enable_prefix_caching=True,
        cache_dtype="auto",
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=None,
    )
    config = SimpleNamespace(
        model_config=model,
        cache_config=cache,
        scheduler_config=SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=4096),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(mode=mode),
        lora_config=lora,
    )
    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))


def test_a_compiled_bf16_engine_gives_a_compiled_bf16_reference() -> None:
    settings = engine_settings(_llm(eager=False, mode=3))
    assert settings["dtype"] == "bfloat16" and settings["enforce_eager"] is False
    assert settings["compilation_config"] == {"mode": 3}
    assert settings["seed"] == 7 and settings["max_model_len"] == 2048 and settings["block_size"] == 16
    assert settings["model_impl"] == "auto" and settings["gpu_memory_utilization"] == 0.3
    assert "kv_cache_memory_bytes" not in settings and "tokenizer" not in settings and "enable_lora" not in settings
    assert "hf_overrides" not in settings


def test_lora_and_the_tokenizer_are_carried_over() -> None:
    lora = SimpleNamespace(max_lora_rank=16, max_loras=2)
    settings = engine_settings(_llm(eager=True, mode=0, lora=lora, skip_tokenizer=False))
    assert settings["compilation_config"] == {"mode": 0} and settings["enforce_eager"] is True
    assert (settings["enable_lora"], settings["max_lora_rank"], settings["max_loras"]) == (True, 16, 2)
    assert settings["tokenizer"] == "/models/tok"
