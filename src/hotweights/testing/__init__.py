"""Tiny models and greedy-output helpers for testing installs against a real engine (needs ``transformers``).

Used by hotweights' own tests, demo and benchmarks, and meant for users' tests too: build two tiny checkpoints,
start an engine on one, install the other, and compare greedy outputs with a fresh engine.

A trainer's unit tests that need no vLLM at all use :class:`hotweights.fake.FakeEngine` instead: a stand-in that
serves a state dict and takes ``hotweights.install`` in a millisecond, recording every session call (not a vLLM
engine: it proves the trainer's calls, not vLLM's behaviour).

Example:
    >>> from hotweights.testing import build_tiny_model               # doctest: +SKIP
    >>> model = build_tiny_model("qwen2", seed=1)                      # doctest: +SKIP
    >>> model.save_pretrained("/tmp/tiny-a")                           # doctest: +SKIP
"""

from hotweights.testing._engines import (
    BLOCK_SIZE,
    PROMPTS,
    EventLoopThread,
    engine_settings,
    greedy_hf,
    greedy_vllm,
    start_async_engine,
    start_engine,
    start_reference_engine,
    stop_engine,
    wait_for_stopped_engines,
)
from hotweights.testing._families import (
    ALWAYS_TIED,
    ARCHS,
    DIFFERS_FROM_TRANSFORMERS,
    DTYPES,
    MLA_ARCHS,
    MOE_ARCHS,
    NOT_SERVED,
    TRANSFORMERS_BACKEND,
    Arch,
)
from hotweights.testing._models import build_tiny_model, save_tiny_model, tiny_config, tp_chunk

__all__ = [
    "ALWAYS_TIED",
    "ARCHS",
    "BLOCK_SIZE",
    "DIFFERS_FROM_TRANSFORMERS",
    "DTYPES",
    "MLA_ARCHS",
    "MOE_ARCHS",
    "NOT_SERVED",
    "PROMPTS",
    "TRANSFORMERS_BACKEND",
    "Arch",
    "EventLoopThread",
    "build_tiny_model",
    "engine_settings",
    "greedy_hf",
    "greedy_vllm",
    "save_tiny_model",
    "start_async_engine",
    "start_engine",
    "start_reference_engine",
    "stop_engine",
    "tiny_config",
    "tp_chunk",
    "wait_for_stopped_engines",
]
