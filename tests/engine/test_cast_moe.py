"""Every MoE family trained in fp32 into a bf16 engine with ``cast="engine"``, as TRL's colocated engine runs: the
trainer's fused experts are cast bucket by bucket to the engine's dtype, and the engine then serves what a fresh bf16
engine started on the fp32 checkpoint serves (vLLM rounds to bf16 as it loads; hotweights as it sends).

GPT-OSS in the default run (not proven on this vLLM: its first install is probed, on a bf16 engine); every other MoE
family of the matrix under ``-m matrix``."""

from __future__ import annotations

import pytest
import torch

import hotweights
from hotweights.testing import ALWAYS_TIED, DTYPES, MOE_ARCHS, TRANSFORMERS_BACKEND

from .conftest import Checkpoints, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

#: MoE families whose engines run in fp32 (Qwen3-Next's run in bf16 always: its matrix cells are bf16 already).
FP32_MOE = [a for a in MOE_ARCHS if DTYPES.get(a, torch.float32) == torch.float32]
DEFAULT = ("gpt_oss",)


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=() if a in DEFAULT else (pytest.mark.matrix,)) for a in FP32_MOE]
)
def test_fp32_trainer_into_a_bf16_engine(arch: str, checkpoint: Checkpoints) -> None:
    variant = Variant(arch, torch.float32, tie=arch in ALWAYS_TIED)
    multiprocess = arch in TRANSFORMERS_BACKEND  # vLLM's Transformers backend: never in this process
    (model_a, path_a), (model_b, path_b) = checkpoint.saved(variant, 1), checkpoint.saved(variant, 2)
    fresh = start_engine(path_b, "bfloat16", multiprocess=multiprocess)
    try:
        fresh_b = greedy_vllm(fresh)
    finally:
        stop_engine(fresh)
    llm = start_engine(path_a, "bfloat16", multiprocess=multiprocess)
    try:
        fresh_a = greedy_vllm(llm)
        assert fresh_a != fresh_b, f"{arch}: seeds 1 and 2 give the same bf16 tokens"
        report = hotweights.install(llm, model_b.state_dict(), weight_version=1, cast="engine")
        assert report.cast_tensors > 0
        assert greedy_vllm(llm) == fresh_b, f"{arch} A->B via {report.adapter} ({report.family_check})"
        hotweights.install(llm, model_a.state_dict(), weight_version=2, cast="engine")
        assert greedy_vllm(llm) == fresh_a, f"{arch} B->A via {report.adapter}"
    finally:
        stop_engine(llm)
