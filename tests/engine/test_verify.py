"""install(..., verify=True): the live parameters are read back after the commit and compared with the trainer's
tensors; a corrupted parameter is an InstallError and generation fails closed until a full install.

Two real in-process engines, one after the other: one whose linear weights stay unpacked (parameters hold their
data, as on a GPU: everything is read back) through ``VLLMDirectSetterAdapter``; one with vLLM's default packed CPU
weights, started with the worker extension, through ``VLLMMultiprocessAdapter`` (the workers' read-back path: only
parameters that hold data can be read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hotweights
from hotweights import InstallError, PartialUpdateError, WeightUpdateManifest
from hotweights.adapters import VLLMDirectSetterAdapter, VLLMMultiprocessAdapter
from hotweights.vllm import introspect
from hotweights.vllm.worker import setter as direct_engine

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
K = "model.layers.0.self_attn.k_proj.weight"
#: Linear weights per layer of the tiny Qwen2 (q, k, v, o, gate, up, down): packed by vLLM on CPU.
LINEAR_PER_LAYER = 7


def _manifest(sd: dict[str, torch.Tensor], version: int) -> WeightUpdateManifest:
    return WeightUpdateManifest.from_state_dict(sd, weight_version=version)


def _keep_weights_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU linear layers keep their weight (no oneDNN / SGL packing), as ``bench_install.py --weights
    unpacked`` does: parameters hold their data."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(_custom_ops, "_supports_onednn", False)
    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", lambda n, k, dtype: False)


def _corrupting(real: Callable[..., int], corrupt: Callable[[Any], None]) -> Any:
    """``apply_direct`` that writes, then ``corrupt(model)`` (after the write, before the read-back)."""

    def apply(model: torch.nn.Module, plan: Any, tensors: Any, **kw: Any) -> int:
        n = real(model, plan, tensors, **kw)
        with torch.no_grad():
            corrupt(model)
        return n

    return apply


def _flip_a_k_row(model: Any) -> None:
    """One element of layer 0's k rows inside the fused ``qkv_proj`` (the plan's k slice)."""
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.weight.data[qkv.num_heads * qkv.head_size + 3, 5] += 1.0


def _flip_the_final_norm(model: Any) -> None:
    model.model.norm.weight.data[0] += 1.0


def test_direct_setter_reads_everything_back_and_catches_a_corrupted_slice(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    with pytest.MonkeyPatch.context() as mp:
        _keep_weights_unpacked(mp)
        llm = start_engine(a.path)
        try:
            adapter = VLLMDirectSetterAdapter(llm, verify=True)
            assert adapter.model.model.layers[0].self_attn.qkv_proj.weight.numel() > 0  # unpacked: holds its data
            sd = b.state_dict()
            report = adapter.install(_manifest(sd, 1), sd)
            assert (report.readback_verified, report.readback_unreadable) == (len(sd), 0)
            assert "verify" in report.phases and f"(read back: {len(sd)} tensors equal, 0 unreadable)" in str(report)
            assert greedy_vllm(llm) == b.hf

            mp.setattr(direct_engine, "apply_direct", _corrupting(direct_engine.apply_direct, _flip_a_k_row))
            with pytest.raises(InstallError, match=rf"readback after the install: 1 tensor.*{K}"):
                adapter.install(_manifest(a.state_dict(), 2), a.state_dict())
            with pytest.raises(PartialUpdateError):  # fails closed
                greedy_vllm(llm)
            mp.undo()
            _keep_weights_unpacked(mp)
            report = adapter.install(_manifest(a.state_dict(), 2), a.state_dict())  # the same version heals it
            assert report.readback_verified == len(sd)
            assert greedy_vllm(llm) == a.hf
            plain = adapter.install(_manifest(sd, 3), sd, verify=False)
            assert plain.readback_verified is None and "verify" not in plain.phases
        finally:
            stop_engine(llm)


def test_workers_read_back_what_holds_data_and_fail_closed_on_a_mismatch(
    checkpoint: Callable[[Variant, int], TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    # In-process with the extension: the workers' own read-back runs here, where the test can reach it.
    llm = start_engine(a.path, multiprocess=False, worker_extension_cls=introspect.WORKER_EXTENSION)
    try:
        sd = b.state_dict()
        layers = 2
        # the in-process default runs the same session in the same worker: it reads back too (it refused before)
        report = hotweights.install(llm, sd, weight_version=1, verify=True)
        assert (report.adapter, report.install_method) == ("inprocess-auto", "direct"), str(report)
        assert report.readback_unreadable == LINEAR_PER_LAYER * layers
        assert report.readback_verified == len(sd) - LINEAR_PER_LAYER * layers
        assert greedy_vllm(llm) == b.hf
        hotweights.install(llm, a.state_dict(), weight_version=2)
        assert greedy_vllm(llm) == a.hf
        for version, method in enumerate(("auto", "reload"), start=3):
            adapter = VLLMMultiprocessAdapter(llm, install_method=method)
            report = hotweights.install(llm, sd, weight_version=version, verify=True, adapter=adapter)
            assert report.install_method == ("direct" if method == "auto" else "reload")
            assert report.readback_unreadable == LINEAR_PER_LAYER * layers  # packed by vLLM: no data to read
            assert report.readback_verified == len(sd) - LINEAR_PER_LAYER * layers
            assert greedy_vllm(llm) == b.hf

        adapter = VLLMMultiprocessAdapter(llm)
        monkeypatch.setattr(
            direct_engine, "apply_direct", _corrupting(direct_engine.apply_direct, _flip_the_final_norm)
        )
        with pytest.raises(InstallError, match=r"readback after the install: 1 tensor.*model\.norm\.weight"):
            hotweights.install(llm, a.state_dict(), weight_version=5, verify=True, adapter=adapter)
        with pytest.raises(PartialUpdateError):
            greedy_vllm(llm)
        monkeypatch.undo()
        hotweights.install(llm, a.state_dict(), weight_version=5, verify=True, adapter=adapter)
        assert greedy_vllm(llm) == a.hf
    finally:
        stop_engine(llm)


MOE = Variant("qwen3_moe", torch.float32, tie=False)
#: Expert tensors of the tiny Qwen3-MoE: 2 layers x 4 experts x (gate, up, down).
EXPERT_TENSORS = 2 * 4 * 3


def test_moe_experts_are_read_back_in_the_kernel_layout_and_catch_unpacked_experts(
    checkpoint: Callable[[Variant, int], TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU MoE kernel keeps its experts packed; the read-back packs what was sent the same way and compares.
    With vLLM's unmended reload (experts left unpacked: the silent corruption of issue 16) it must fail closed."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    a, b = checkpoint(MOE, 1), checkpoint(MOE, 2)
    llm = start_engine(a.path, multiprocess=False, worker_extension_cls=introspect.WORKER_EXTENSION)
    try:
        adapter = VLLMMultiprocessAdapter(llm)
        report = hotweights.install(llm, b.state_dict(), weight_version=1, verify=True, adapter=adapter)
        assert report.install_method == "reload" and greedy_vllm(llm) == b.fresh
        assert report.readback_verified == EXPERT_TENSORS
        assert report.readback_note and "Qwen3MoeForCausalLM" in report.readback_note  # why the rest was not read

        mended = UnquantizedFusedMoEMethod._setup_kernel
        monkeypatch.setattr(UnquantizedFusedMoEMethod, "_setup_kernel", mended.__wrapped__)  # vLLM's own
        with pytest.raises(InstallError, match=r"readback after the install: 24 tensor.*experts"):
            hotweights.install(llm, a.state_dict(), weight_version=2, verify=True, adapter=adapter)
        with pytest.raises(PartialUpdateError):
            greedy_vllm(llm)
        monkeypatch.undo()
        report = hotweights.install(llm, a.state_dict(), weight_version=2, verify=True, adapter=adapter)
        assert report.readback_verified == EXPERT_TENSORS and greedy_vllm(llm) == a.fresh  # healed
    finally:
        stop_engine(llm)


def test_a_read_back_that_reads_nothing_says_so_and_strict_fails_closed(
    checkpoint: Callable[[Variant, int], TinyCheckpoint], caplog: pytest.LogCaptureFixture
) -> None:
    """Phi-3 is not on the direct setter's allow-list and has no experts: on CPU nothing can be read back."""
    variant = Variant("phi3", torch.float32, tie=False)
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    llm = start_engine(a.path, multiprocess=False, worker_extension_cls=introspect.WORKER_EXTENSION)
    try:
        adapter = VLLMMultiprocessAdapter(llm)
        with caplog.at_level("WARNING", logger="hotweights"):
            report = hotweights.install(llm, b.state_dict(), weight_version=1, verify=True, adapter=adapter)
        assert report.readback_verified == 0 and report.readback_unreadable == report.num_tensors
        assert report.readback_note and report.readback_note.startswith("nothing could be read back")
        assert "Phi3ForCausalLM" in report.readback_note and "nothing could be read back" in str(report)
        assert "read nothing back" in caplog.text
        assert greedy_vllm(llm) == b.fresh
        with pytest.raises(InstallError, match=r'verify="strict": \d+ tensor\(s\) could not be read back'):
            hotweights.install(llm, a.state_dict(), weight_version=2, verify="strict", adapter=adapter)
        with pytest.raises(PartialUpdateError):  # not proven: refused until an install that is
            greedy_vllm(llm)
        hotweights.install(llm, a.state_dict(), weight_version=2, adapter=adapter)
        assert greedy_vllm(llm) == a.fresh
    finally:
        stop_engine(llm)
