"""Conformance: every architecture hotweights accepts, A -> B -> A, against a fresh engine on the new weights.

Each check asserts first that A and B give different greedy tokens (one prompt is longer than a KV block), installs the
trainer's own ``model.state_dict()`` (transformers 5 names: MoE experts fused), and compares the engine with a freshly
started engine on the same weights (itself equal to HF transformers in fp32, except on the families in
``DIFFERS_FROM_TRANSFORMERS``). The in-process and zero-config checks start one engine each: the engine started on A is
A's fresh engine, and B's reference is transformers' tokens where a fresh engine equals them (fp32, not in
``DIFFERS_FROM_TRANSFORMERS``; the extension check measures B's fresh engine and holds it to them). The default run
takes every architecture on one path, in-process (those vLLM serves through its Transformers backend: zero-config,
multiprocess), and the architectures that needed mending (MoE, tied heads) through the multiprocess paths too; ``-m
matrix`` runs every architecture through every multiprocess path (``make test-matrix``), and writes the cells to
``$HOTWEIGHTS_MATRIX_OUT`` for ``docs/architectures.md``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import hotweights
from hotweights import EngineNotSupportedError, InstallError, WeightManifestValidationError
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.testing import (
    ALWAYS_TIED,
    ARCHS,
    DIFFERS_FROM_TRANSFORMERS,
    DTYPES,
    MOE_ARCHS,
    TRANSFORMERS_BACKEND,
    build_tiny_model,
)

from .conftest import Checkpoints, TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

#: Tied by default where the family usually is (GPT-2, Gemma, and those vLLM always ties); Qwen3 and Llama run both
#: ways.
TIED = {"gpt2", "gemma2", "gemma3", *ALWAYS_TIED}
VARIANTS = [Variant(a, DTYPES.get(a, torch.float32), tie=a in TIED) for a in ARCHS] + [
    Variant("qwen3", torch.float32, tie=True),
    Variant("llama", torch.float32, tie=True),
]
MOE = [v for v in VARIANTS if v.arch in MOE_ARCHS]
#: MoE families whose checkpoints hold each layer's experts fused, not per expert: nothing there for the read-back.
FUSED_EXPERTS = {"gpt_oss", "granitemoe", "granitemoeshared"}
#: Multiprocess paths of the default run: the families whose installs vLLM's own reload got wrong, and those that
#: cannot run in-process (vLLM's Transformers backend).
MENDED = [Variant("qwen3_moe", torch.float32, tie=False), Variant("llama", torch.float32, tie=True)]
ZERO_CONFIG = [*MENDED, *(v for v in VARIANTS if v.arch in TRANSFORMERS_BACKEND)]


def matrix(default: list[Variant]) -> list[Any]:
    """``default`` in the default run, then every other variant in the matrix profile."""
    return [*default, *(pytest.param(v, marks=pytest.mark.matrix, id=v.id) for v in VARIANTS if v not in default)]


def _id(v: Any) -> str:
    return str(v.id) if isinstance(v, Variant) else str(v)


def _options(variant: Variant) -> dict[str, Any]:
    """Install options for ``variant``: where a fresh engine serves other tokens than transformers, the family
    probe (its reference is transformers) cannot pass, so the fresh engine is the only reference."""
    return {"unproven": "trust"} if variant.arch in DIFFERS_FROM_TRANSFORMERS else {}


#: A per-expert checkpoint tensor, the unit the read-back compares MoE experts in.
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


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


def _inprocess(variant: Variant, checkpoint: Checkpoints) -> None:
    b = checkpoint.expected(variant, 2)
    a, llm = checkpoint.served(variant, 1, lambda path: start_engine(path, variant.vllm_dtype, multiprocess=False))
    try:
        versions = itertools.count(1)
        assert a_to_b_to_a(llm, a, b, versions, **_options(variant)).adapter == "inprocess-auto"
        # the checkpoint's own tensors (per-expert names for MoE), installed twice: B -> B must not change a token
        for _ in range(2):
            hotweights.install(llm, checkpoint_tensors(b), weight_version=next(versions), **_options(variant))
            assert greedy_vllm(llm) == b.fresh
        _record(variant, "in-process", "exact")
    finally:
        stop_engine(llm)


# Two classes, so that make test's two workers (one test scope each: a module, or a class) share the families.
class TestInProcessDense:
    @pytest.mark.parametrize("variant", [v for v in INPROCESS if v.arch not in MOE_ARCHS], ids=lambda v: v.id)
    def test_inprocess(self, variant: Variant, checkpoint: Checkpoints) -> None:
        _inprocess(variant, checkpoint)


class TestInProcessMoE:
    @pytest.mark.parametrize("variant", [v for v in INPROCESS if v.arch in MOE_ARCHS], ids=lambda v: v.id)
    def test_inprocess(self, variant: Variant, checkpoint: Checkpoints) -> None:
        _inprocess(variant, checkpoint)


# ---------------------------------------------------------------------------------------------- multiprocess
@pytest.fixture
def multiprocess() -> Iterator[Callable[..., Any]]:
    """``start(path, **engine_kwargs)``: a multiprocess engine, stopped after the test."""
    started: list[Any] = []

    def start(path: Path, dtype: str = "float32", **kwargs: Any) -> Any:
        llm = start_engine(path, dtype, multiprocess=True, **kwargs)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@pytest.mark.parametrize("variant", matrix(ZERO_CONFIG), ids=_id)
def test_zero_config(variant: Variant, checkpoint: Checkpoints, multiprocess: Callable[..., Any]) -> None:
    """A plain ``LLM(model=...)``: vLLM's own ``reload_weights(weights_path=...)``, mended by the plugin."""
    b = checkpoint.expected(variant, 2)
    a, llm = checkpoint.served(variant, 1, lambda path: multiprocess(path, variant.vllm_dtype))
    assert a_to_b_to_a(llm, a, b, itertools.count(1), **_options(variant)).adapter == "weights-path"
    assert our_shm() == []
    _record(variant, "zero-config", "exact")


@pytest.mark.parametrize("variant", matrix(MENDED), ids=_id)
def test_extension_every_method(
    variant: Variant, checkpoint: Callable[[Variant, int], TinyCheckpoint], multiprocess: Callable[..., Any]
) -> None:
    """The worker extension: auto, reload, direct and aside, atomic and streaming, delta, and the read-back."""
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    llm = multiprocess(a.path, variant.vllm_dtype, worker_extension_cls=hotweights.WORKER_EXTENSION)
    versions = itertools.count(1)
    options = _options(variant)
    report = a_to_b_to_a(llm, a, b, versions, **options)
    assert report.adapter == "multiprocess-shm"
    _record(variant, "extension auto", f"exact ({report.install_method})")
    for method, commit in (("reload", "atomic"), ("reload", "streaming"), ("direct", "atomic"), ("aside", "atomic")):
        adapter = VLLMMultiprocessAdapter(llm, install_method=method, commit=commit, bucket_bytes=200_000)
        adapter.active_weight_version = next(versions)
        path = f"extension {method} {commit}"
        try:
            a_to_b_to_a(llm, a, b, versions, adapter=adapter, **options)
        except (WeightManifestValidationError, InstallError, EngineNotSupportedError) as exc:  # the direct setter
            # cannot place this model, or its rule cannot prove the install exact
            assert method == "direct" and ("before the model was touched" in str(exc) or "nothing was" in str(exc)), exc
            assert greedy_vllm(llm) == a.fresh  # nothing was written
            _record(variant, path, f"refused before writing: {_why(str(exc))}")
        else:
            _record(variant, path, "exact")
        finally:
            adapter.close()
    # delta: a full install, then B as a delta on top of it
    hotweights.install(llm, a.state_dict(), weight_version=next(versions), delta=True, **options)
    report = hotweights.install(llm, b.state_dict(), weight_version=next(versions), delta=True, **options)
    assert report.delta == "applied" and greedy_vllm(llm) == b.fresh
    _record(variant, "extension delta", "exact")
    # the read-back: what it compares on this architecture (MoE experts in the CPU kernel's layout)
    adapter = hotweights.adapter_for(llm)
    adapter.forget_delta_base()
    report = hotweights.install(llm, a.state_dict(), weight_version=next(versions), verify=True, **options)
    assert greedy_vllm(llm) == a.fresh
    if variant.arch in MOE_ARCHS:
        # every routed expert the checkpoint holds per expert (gate, up, down of each expert of each MoE layer) is
        # read back in the CPU kernel's layout; experts the checkpoint holds fused (GPT-OSS, GraniteMoE) are not
        per_expert = [n for n in checkpoint_tensors(a) if _PER_EXPERT.search(n)]
        assert (report.readback_verified or 0) >= len(per_expert), (report.readback_verified, len(per_expert))
        assert per_expert or variant.arch in FUSED_EXPERTS, f"{variant.id}: no per-expert tensor in the checkpoint"
    _record(variant, "verify reads back", f"{report.readback_verified} of {report.num_tensors}")


# ---------------------------------------------------------------------------------------------- bf16, fp32 cast
@pytest.mark.matrix
@pytest.mark.parametrize("variant", MOE, ids=lambda v: v.id)
def test_moe_bf16_engine_from_fp32_master_weights(
    variant: Variant, checkpoint: Checkpoints, multiprocess: Callable[..., Any]
) -> None:
    """Every MoE family in a bf16 engine, installed from the trainer's fp32 tensors with ``cast=torch.bfloat16``
    (RL trainers keep fp32 master weights; rollouts run bf16): A -> B -> A, each equal to a freshly started bf16
    engine on that checkpoint (vLLM casting the fp32 checkpoint, and the install casting bucket by bucket, round the
    same way). In-process (a plain multiprocess ``LLM`` for a family vLLM serves through its Transformers backend),
    then a multiprocess engine with the worker extension."""
    half = Variant(variant.arch, torch.bfloat16, tie=variant.tie)  # its checkpoint: the fp32 model cast
    backend = variant.arch in TRANSFORMERS_BACKEND
    b = checkpoint.expected(half, 2)
    a, llm = checkpoint.served(
        half,
        1,
        lambda path: multiprocess(path, "bfloat16") if backend else start_engine(path, "bfloat16", multiprocess=False),
    )
    try:
        assert a.fresh != b.fresh, f"{half.id}: seeds 1 and 2 give the same tokens"
        paths = [_cast_b_then_a(llm, variant, a, b)]
    finally:
        if not backend:
            stop_engine(llm)
    extension = multiprocess(a.path, "bfloat16", worker_extension_cls=hotweights.WORKER_EXTENSION)
    paths.append(_cast_b_then_a(extension, variant, a, b))
    _record(variant, "bf16 engine, fp32 cast", f"exact ({', '.join(paths)})")


def _cast_b_then_a(llm: Any, variant: Variant, a: TinyCheckpoint, b: TinyCheckpoint) -> str:
    """Install the fp32 masters of B then A into a bf16 engine serving A, each checked against a fresh engine; the
    path it went by."""
    assert greedy_vllm(llm) == a.fresh
    for version, ckpt in enumerate((b, a), start=1):
        master = build_tiny_model(variant.arch, ckpt.seed, tie=variant.tie, dtype=torch.float32).state_dict()
        report = hotweights.install(llm, master, weight_version=version, cast=torch.bfloat16, **_options(variant))
        assert report.cast_tensors, report
        assert greedy_vllm(llm) == ckpt.fresh, (
            f"{ckpt.variant.id}: the install of seed {ckpt.seed} via {report.adapter}"
        )
    return str(report.adapter)
