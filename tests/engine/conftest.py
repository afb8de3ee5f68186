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
    DIFFERS_FROM_TRANSFORMERS,
    PROMPTS,
    TRANSFORMERS_BACKEND,
    build_tiny_model,
    greedy_hf,
    greedy_vllm,
    save_tiny_model,
    start_engine,
)
from hotweights.testing import stop_engine as _stop_engine

from ..conftest import our_shm


def stop_engine(llm: Any, *, wait: bool = False) -> None:
    """Stop ``llm``; a multiprocess engine's teardown (about 4 s in vLLM) goes on in the background while the next
    test starts its engine. ``wait=True`` where a test checks what the engine's exit removes."""
    _stop_engine(llm, wait=wait)


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
    """Greedy outputs of HF transformers (fp32 only; bf16 vLLM and HF diverge after a few tokens). Equal to
    :attr:`fresh` except on the families in ``DIFFERS_FROM_TRANSFORMERS``."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


_CACHE: dict[tuple[Variant, int], TinyCheckpoint] = {}
_BUILT: dict[tuple[Variant, int], tuple[Any, Path, list[list[int]] | None]] = {}


class Checkpoints:
    """``checkpoint(variant, seed)``: a tiny model built, saved and measured once per session.

    ``checkpoint.served(variant, seed, start)`` also hands back ``start(path)``, an engine the caller started on it
    (and stops): where the fresh outputs are not measured yet, they are read from that engine, itself a freshly
    started one, instead of from one more engine. With :meth:`expected` for the other checkpoint, a test of an
    install A -> B -> A then starts one engine in all.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory

    def __call__(self, variant: Variant, seed: int) -> TinyCheckpoint:
        key = (variant, seed)
        if key not in _CACHE:
            _, path, _ = self._built(variant, seed)
            if variant.arch in TRANSFORMERS_BACKEND:  # an in-process engine would break this process's model class
                llm = start_engine(path, dtype=variant.vllm_dtype, multiprocess=True)
                fresh = greedy_vllm(llm)
                stop_engine(llm)
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            else:
                llm = start_engine(path, dtype=variant.vllm_dtype)
                fresh = greedy_vllm(llm)
                stop_engine(llm)
            self._measured(variant, seed, fresh)
        return _CACHE[key]

    def expected(self, variant: Variant, seed: int) -> TinyCheckpoint:
        """The checkpoint at the least cost of engines: with a fresh engine's outputs where they are measured
        already; else, where a fresh engine equals transformers (fp32, not in ``DIFFERS_FROM_TRANSFORMERS``: checked
        on every engine this fixture measures, and on every family by the matrix), with transformers' own (cached
        apart, so a later ``checkpoint(variant, seed)`` still measures an engine); else measured."""
        fresh_is_hf = variant.dtype == torch.float32 and variant.arch not in DIFFERS_FROM_TRANSFORMERS
        if (variant, seed) not in _CACHE and fresh_is_hf:
            model, path, hf = self._built(variant, seed)
            assert hf is not None
            return TinyCheckpoint(variant, seed, model, path, hf, hf)
        return self(variant, seed)

    def served(self, variant: Variant, seed: int, start: Callable[[Path], Any]) -> tuple[TinyCheckpoint, Any]:
        _, path, _ = self._built(variant, seed)
        llm = start(path)
        try:
            ckpt = _CACHE.get((variant, seed)) or self._measured(variant, seed, greedy_vllm(llm))
        except BaseException:
            stop_engine(llm)
            raise
        return ckpt, llm

    def saved(self, variant: Variant, seed: int) -> tuple[Any, Path]:
        """The model (the trainer) and its saved directory, with no engine measured."""
        model, path, _ = self._built(variant, seed)
        return model, path

    def _built(self, variant: Variant, seed: int) -> tuple[Any, Path, list[list[int]] | None]:
        key = (variant, seed)
        if key not in _BUILT:
            model = build_tiny_model(variant.arch, seed, tie=variant.tie, dtype=variant.dtype)  # type: ignore[arg-type]
            path = save_tiny_model(model, self._tmp.mktemp(f"{variant.id}-s{seed}"))
            hf = greedy_hf(model) if variant.dtype == torch.float32 else None
            _BUILT[key] = (model, path, hf)
        return _BUILT[key]

    def _measured(self, variant: Variant, seed: int, fresh: list[list[int]]) -> TinyCheckpoint:
        model, path, hf = self._built(variant, seed)
        if hf is not None and variant.arch not in DIFFERS_FROM_TRANSFORMERS:
            assert fresh == hf, f"fresh vLLM engine disagrees with HF on {variant.id} seed {seed}"
        _CACHE[(variant, seed)] = TinyCheckpoint(variant, seed, model, path, fresh, hf)
        return _CACHE[(variant, seed)]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """``checkpoint(variant, seed)``: built, saved and measured once per session (see :class:`Checkpoints`)."""
    return Checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def versions() -> Iterator[int]:
    """Monotonic weight versions for one module's engine."""
    return itertools.count(1)


__all__ = [
    "PROMPTS",
    "Checkpoints",
    "TinyCheckpoint",
    "Variant",
    "greedy_vllm",
    "our_shm",
    "start_engine",
    "stop_engine",
]
