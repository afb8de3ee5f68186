"""verl's sender with a tiny Qwen3-MoE policy: transformers 5 holds the experts fused in memory
(``experts.gate_up_proj`` ``[E, 2I, H]``), which is what verl's actor sends; the engine serves one tensor per expert
and projection. The worker maps each bucket's names (:func:`hotweights.core.names.to_checkpoint`), and every step
equals a fresh engine.

A module of its own: its in-process engine must not overlap test_verl.py's. Runs in .venv-verl (``make test-verl``).
"""

from __future__ import annotations

import pytest
import torch

from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

from .test_verl import DTYPE, EXTENSION, _sync, _version

pytestmark = pytest.mark.engine


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in build_tiny_model("qwen3_moe", seed=seed).state_dict().items()}


def test_qwen3_moe_steps_are_exact(tmp_path_factory: pytest.TempPathFactory) -> None:
    paths, fresh = {}, {}
    for seed in (0, 1, 2, 3):
        paths[seed] = save_tiny_model(build_tiny_model("qwen3_moe", seed=seed), tmp_path_factory.mktemp(f"moe{seed}"))
        llm = start_engine(paths[seed], DTYPE)
        try:
            fresh[seed] = greedy_vllm(llm)
        finally:
            stop_engine(llm)
    llm = start_engine(paths[0], DTYPE, worker_extension_cls=EXTENSION)
    try:
        assert greedy_vllm(llm) == fresh[0]
        for step in (1, 2, 3):
            assert fresh[step] != fresh[step - 1], f"step {step}: the weights change nothing the test sees"
            weights = _weights(step)
            assert any(n.endswith("experts.gate_up_proj") for n in weights), "the trainer holds fused experts"
            result, error, _ = _sync(llm, weights)
            assert error is None, error
            assert result["weight_version"] == step and _version(llm) == step, result
            assert greedy_vllm(llm) == fresh[step], f"step {step}: the engine serves something else"
    finally:
        stop_engine(llm)
