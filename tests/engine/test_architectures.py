"""Conformance: every architecture hotweights accepts, A -> B -> A, against a fresh engine on the new weights.

Each check asserts first that A and B give different greedy tokens (one prompt is longer than a KV block), installs
the trainer's own ``model.state_dict()`` (transformers 5 names: MoE experts fused), and compares the engine with a
freshly started engine on the same weights (itself equal to HF transformers, fp32). The default run takes every
architecture in-process and the architectures that needed mending (MoE, tied heads) through the multiprocess paths;
``-m matrix`` runs every architecture through every multiprocess path (``make test-matrix``), and writes the cells
to ``$HOTWEIGHTS_MATRIX_OUT`` for ``docs/architectures.md``.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import hotweights
from hotweights import EngineNotSupportedError, InstallError, WeightManifestValidationError
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.testing import ARCHS, MOE_ARCHS, TRANSFORMERS_BACKEND

from .conftest import TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

#: Tied by default where the family usually is (GPT-2, Gemma); Qwen3 and Llama run both ways.
TIED = {"gpt2", "gemma2", "gemma3"}
VARIANTS = [Variant(a, torch.float32, tie=a in TIED) for a in ARCHS] + [
    Variant("qwen3", torch.float32, tie=True),
    Variant("llama", torch.float32, tie=True),
]
MOE = [v for v in VARIANTS if v.arch in MOE_ARCHS]
#: Multiprocess paths of the default run: the families whose installs vLLM's own reload got wrong, and those that
#: cannot run in-process (vLLM's Transformers backend).
MENDED = [Variant("qwen3_moe", torch.float32, tie=False), Variant("llama", torch.float32, tie=True)]
ZERO_CONFIG = [*MENDED, *(v for v in VARIANTS if v.arch in TRANSFORMERS_BACKEND)]


def matrix(default: list[Variant]) -> list[Any]:
    """``default`` in the default run, then every other variant in the matrix profile."""
    return [*default, *(pytest.param(v, marks=pytest.mark.matrix, id=v.id) for v in VARIANTS if v not in default)]


def _id(v: Any) -> str:
    return str(v.id) if isinstance(v, Variant) else str(v)


_CELLS: dict[str, dict[str, str]] = {}


def _record(variant: Variant, path: str, result: str) -> None:
    """Note one cell; with ``$HOTWEIGHTS_MATRIX_OUT`` set, merge it into that file (a partial run keeps the rest)."""
    out = os.environ.get("HOTWEIGHTS_MATRIX_OUT")
    if out and not _CELLS and Path(out).is_file():
        _CELLS.update(json.loads(Path(out).read_text()))
    _CELLS.setdefault(variant.id, {})[path] = result
    if out:
        Path(out).write_text(json.dumps(_CELLS, indent=1, sort_keys=True) + "\n")


def _why(message: str) -> str:
    """The worker's reason for a refusal, short enough for a table cell."""
    for marker in ("cannot prove an install into this model exact: ", "mismatch(es)\n  - "):
        if marker in message:
            reason = message.split(marker, 1)[1]
            return reason.split(" (", 1)[0].split(";", 1)[0].split("\n", 1)[0]
    return message[:120]


def checkpoint_tensors(ckpt: TinyCheckpoint) -> dict[str, torch.Tensor]:
    """The tensors as ``save_pretrained`` wrote them (per-expert names), not as the trainer holds them."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def a_to_b_to_a(
    llm: Any, a: TinyCheckpoint, b: TinyCheckpoint, versions: Iterator[int], **options: Any
) -> hotweights.InstallReport:
    """Install B then A (trainer state dicts) into an engine serving A, each checked against a fresh engine; the
    report of the install of B."""
    assert a.fresh != b.fresh, f"{a.variant.id}: seeds {a.seed} and {b.seed} give the same tokens"
    assert greedy_vllm(llm) == a.fresh
    report = hotweights.install(llm, b.state_dict(), weight_version=next(versions), **options)
    assert greedy_vllm(llm) == b.fresh, f"{a.variant.id} A->B via {report.adapter}"
    hotweights.install(llm, a.state_dict(), weight_version=next(versions), **options)
    assert greedy_vllm(llm) == a.fresh, f"{a.variant.id} B->A via {report.adapter}"
    return report


# ---------------------------------------------------------------------------------------------- in-process
INPROCESS = [v for v in VARIANTS if v.arch not in TRANSFORMERS_BACKEND]


@pytest.mark.parametrize("variant", INPROCESS, ids=lambda v: v.id)
def test_inprocess(variant: Variant, checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        versions = itertools.count(1)
        assert a_to_b_to_a(llm, a, b, versions).adapter == "inprocess-auto"
        # the checkpoint's own tensors (per-expert names for MoE), installed twice: B -> B must not change a token
        for _ in range(2):
            hotweights.install(llm, checkpoint_tensors(b), weight_version=next(versions))
            assert greedy_vllm(llm) == b.fresh
        _record(variant, "in-process", "exact")
    finally:
        stop_engine(llm)


# ---------------------------------------------------------------------------------------------- multiprocess
@pytest.fixture
def multiprocess() -> Iterator[Callable[..., Any]]:
    """``start(path, **engine_kwargs)``: a multiprocess engine, stopped after the test."""
    started: list[Any] = []

    def start(path: Path, **kwargs: Any) -> Any:
        llm = start_engine(path, multiprocess=True, **kwargs)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@pytest.mark.parametrize("variant", matrix(ZERO_CONFIG), ids=_id)
def test_zero_config(
    variant: Variant, checkpoint: Callable[[Variant, int], TinyCheckpoint], multiprocess: Callable[..., Any]
) -> None:
    """A plain ``LLM(model=...)``: vLLM's own ``reload_weights(weights_path=...)``, mended by the plugin."""
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    llm = multiprocess(a.path)
    assert a_to_b_to_a(llm, a, b, itertools.count(1)).adapter == "weights-path"
    assert our_shm() == []
    _record(variant, "zero-config", "exact")


@pytest.mark.parametrize("variant", matrix(MENDED), ids=_id)
def test_extension_every_method(
    variant: Variant, checkpoint: Callable[[Variant, int], TinyCheckpoint], multiprocess: Callable[..., Any]
) -> None:
    """The worker extension: auto, reload and direct, atomic and streaming, delta, and the read-back."""
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    llm = multiprocess(a.path, worker_extension_cls=hotweights.WORKER_EXTENSION)
    versions = itertools.count(1)
    report = a_to_b_to_a(llm, a, b, versions)
    assert report.adapter == "multiprocess-shm"
    _record(variant, "extension auto", f"exact ({report.install_method})")
    for method, commit in (("reload", "atomic"), ("reload", "streaming"), ("direct", "atomic")):
        adapter = VLLMMultiprocessAdapter(llm, install_method=method, commit=commit, bucket_bytes=200_000)
        adapter.active_weight_version = next(versions)
        path = f"extension {method} {commit}"
        try:
            a_to_b_to_a(llm, a, b, versions, adapter=adapter)
        except (WeightManifestValidationError, InstallError, EngineNotSupportedError) as exc:  # direct cannot place it
            assert method == "direct", exc
            assert isinstance(exc, EngineNotSupportedError) or "before the model was touched" in str(exc), exc
            assert greedy_vllm(llm) == a.fresh  # nothing was written
            _record(variant, path, f"refused before writing: {_why(str(exc))}")
        else:
            _record(variant, path, "exact")
        finally:
            adapter.close()
    # delta: a full install, then B as a delta on top of it
    hotweights.install(llm, a.state_dict(), weight_version=next(versions), delta=True)
    report = hotweights.install(llm, b.state_dict(), weight_version=next(versions), delta=True)
    assert report.delta == "applied" and greedy_vllm(llm) == b.fresh
    _record(variant, "extension delta", "exact")
    # the read-back: what it compares on this architecture (MoE experts in the CPU kernel's layout)
    adapter = hotweights.adapter_for(llm)
    adapter.forget_delta_base()
    report = hotweights.install(llm, a.state_dict(), weight_version=next(versions), verify=True)
    assert greedy_vllm(llm) == a.fresh
    if variant.arch in MOE_ARCHS:
        assert report.readback_verified and report.readback_verified >= 3 * 4 * 2  # 3 projections x 4 experts x 2
    _record(variant, "verify reads back", f"{report.readback_verified} of {report.num_tensors}")
