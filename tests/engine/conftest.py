"""Real tiny vLLM engines, shared per module; fresh-engine reference outputs, shared per session."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# In-process engines: start in ~2 s and hand tensors over by reference. Must be set before vLLM builds an LLM.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)

from hotweights.testing import (
    PROMPTS,
    TRANSFORMERS_BACKEND,
    build_tiny_model,
    greedy_hf,
    greedy_vllm,
    save_tiny_model,
    start_engine,
    stop_engine,
)

from ..conftest import our_shm


@dataclass(frozen=True)
class Variant:
    arch: str
    dtype: torch.dtype
    tie: bool

    @property
    def id(self) -> str:
        return f"{self.arch}-{str(self.dtype).removeprefix('torch.')}-{'tied' if self.tie else 'untied'}"

    @property
    def vllm_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass
class TinyCheckpoint:
    """One tiny model: the HF module (the 'trainer'), its directory, and reference greedy outputs."""

    variant: Variant
    seed: int
    model: Any
    path: Path
    fresh: list[list[int]]
    """Greedy outputs of a freshly started engine on this checkpoint."""
    hf: list[list[int]] | None
    """Greedy outputs of HF transformers (fp32 only; bf16 vLLM and HF diverge after a few tokens)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


_CACHE: dict[tuple[Variant, int], TinyCheckpoint] = {}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Variant, int], TinyCheckpoint]:
    """``checkpoint(variant, seed)``: built, saved and measured once per session."""

    def get(variant: Variant, seed: int) -> TinyCheckpoint:
        key = (variant, seed)
        if key not in _CACHE:
            model = build_tiny_model(variant.arch, seed, tie=variant.tie, dtype=variant.dtype)  # type: ignore[arg-type]
            path = save_tiny_model(model, tmp_path_factory.mktemp(f"{variant.id}-s{seed}"))
            hf = greedy_hf(model) if variant.dtype == torch.float32 else None
            if variant.arch in TRANSFORMERS_BACKEND:  # an in-process engine would break this process's model class
                llm = start_engine(path, dtype=variant.vllm_dtype, multiprocess=True)
                fresh = greedy_vllm(llm)
                stop_engine(llm)
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            else:
                llm = start_engine(path, dtype=variant.vllm_dtype)
                fresh = greedy_vllm(llm)
                stop_engine(llm)
            if hf is not None:
                assert fresh == hf, f"fresh vLLM engine disagrees with HF on {variant.id} seed {seed}"
            _CACHE[key] = TinyCheckpoint(variant, seed, model, path, fresh, hf)
        return _CACHE[key]

    return get


@pytest.fixture(scope="module")
def versions() -> Iterator[int]:
    """Monotonic weight versions for one module's engine."""
    return itertools.count(1)


__all__ = ["PROMPTS", "TinyCheckpoint", "Variant", "greedy_vllm", "our_shm", "start_engine", "stop_engine"]
