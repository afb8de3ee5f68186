"""install_method="auto", the default of VLLMMultiprocessAdapter and so of hotweights.install on an extension
engine: the direct setter where the workers' plan proves it safe (Qwen2), vLLM's layerwise reload elsewhere (a
model class off the allow-list, for real: Phi-3), forced paths, and the refusal rule on real modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
import hotweights.transports
from hotweights import WeightUpdateManifest
from hotweights.adapters import VLLMDirectSetterAdapter, VLLMMultiprocessAdapter
from hotweights.testing import build_tiny_model, greedy_hf, save_tiny_model
from hotweights.vllm import introspect
from hotweights.vllm.worker.setter import direct_refusals

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


class Engine:
    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint) -> None:
        self.llm, self.a, self.b = llm, a, b
        self.version = 0

    def install(self, ckpt: TinyCheckpoint, **options: Any) -> hotweights.InstallReport:
        self.version += 1
        sd = ckpt.state_dict()
        if not options:  # the default path, as a trainer calls it
            return hotweights.install(self.llm, sd, weight_version=self.version)
        adapter = VLLMMultiprocessAdapter(self.llm, **options)
        adapter.active_weight_version = self.version - 1
        return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version), sd)


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Engine]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    yield Engine(llm, a, b)
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_default_path_is_the_direct_setter_with_its_reason(engine: Engine) -> None:
    report = engine.install(engine.b)
    assert report.adapter == "multiprocess-shm"
    assert report.install_method == "direct"
    assert report.install_reason is not None and report.install_reason.startswith("auto: Qwen2ForCausalLM")
    assert "[direct: auto: Qwen2ForCausalLM" in str(report)
    assert report.to_dict()["hotweights/install_method"] == "direct"
    assert greedy_vllm(engine.llm) == engine.b.fresh == engine.b.hf
    assert engine.install(engine.a).install_method == "direct"
    assert greedy_vllm(engine.llm) == engine.a.fresh == engine.a.hf
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.hf


@pytest.mark.parametrize("commit", ["atomic", "streaming"])
def test_forcing_either_path(engine: Engine, commit: str) -> None:
    report = engine.install(engine.a, install_method="reload", commit=commit)
    assert (report.install_method, report.install_reason) == ("reload", "install_method='reload' was asked for")
    assert greedy_vllm(engine.llm) == engine.a.hf
    report = engine.install(engine.b, install_method="direct", commit=commit)
    assert (report.install_method, report.install_reason) == ("direct", "install_method='direct' was asked for")
    assert greedy_vllm(engine.llm) == engine.b.hf


def test_streaming_auto_decides_at_begin(engine: Engine) -> None:
    report = engine.install(engine.a, commit="streaming", bucket_bytes=100_000)
    assert report.install_method == "direct" and report.adapter == "multiprocess-shm-streaming"
    assert greedy_vllm(engine.llm) == engine.a.hf


def test_kept_segments_with_streaming_need_a_forced_direct_setter(engine: Engine) -> None:
    kept = hotweights.transports.make_transport("shm", keep_segments=True)
    with pytest.raises(ValueError, match="may fall back to that reload"):
        VLLMMultiprocessAdapter(engine.llm, transport=kept, commit="streaming")
    kept.close()


# ------------------------------------------------------------------------------------------- the fallback, for real
def test_unlisted_model_falls_back_to_reload_with_the_reason(tmp_path: Path) -> None:
    a, b = build_tiny_model("phi3", 1), build_tiny_model("phi3", 2)  # not on the allow-list (nor are its fused
    # checkpoint tensors: a forced direct install served wrong tokens in the conformance matrix)
    want_a, want_b = greedy_hf(a), greedy_hf(b)
    assert want_a != want_b
    # In-process (starts in seconds), with the extension: the same worker methods, reached by name.
    llm = start_engine(
        save_tiny_model(a, tmp_path / "a"), multiprocess=False, worker_extension_cls=introspect.WORKER_EXTENSION
    )
    try:
        assert greedy_vllm(llm) == want_a
        adapter = VLLMMultiprocessAdapter(llm)
        sd = dict(b.state_dict())
        report = adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=1), sd)
        assert report.install_method == "reload"
        assert report.install_reason is not None
        assert "cannot prove this model safe: model class Phi3ForCausalLM" in report.install_reason
        assert greedy_vllm(llm) == want_b
        # The same rule in-process, through the session: the default falls back to the reload, and a forced direct
        # install is refused before anything is written, with the error the rule raises (not an InstallError).
        report = hotweights.install(llm, dict(a.state_dict()), weight_version=2)
        assert (report.adapter, report.install_method) == ("inprocess-auto", "reload"), str(report)
        assert greedy_vllm(llm) == want_a
        with pytest.raises(hotweights.EngineNotSupportedError, match="cannot prove an install into this model exact"):
            VLLMDirectSetterAdapter(llm).install(WeightUpdateManifest.from_state_dict(sd, weight_version=3), sd)
        assert greedy_vllm(llm) == want_a  # nothing written
        refusals = direct_refusals(introspect.inprocess_model(llm))
        assert len(refusals) == 1  # the model class only: all its layers are allow-listed kinds
    finally:
        stop_engine(llm)


def test_refusal_rule_on_the_real_models_modules(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    """The rule on a real in-process Qwen2 (clean), then on the same modules with one layer of each refused kind."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    llm = start_engine(checkpoint(VARIANT, 1).path, multiprocess=False)
    try:
        real = introspect.inprocess_model(llm)
        assert direct_refusals(real) == ()

        class Qwen2ForCausalLM(torch.nn.Module):  # same class name, other modules: the layer rules decide
            def __init__(self, model: torch.nn.Module) -> None:
                super().__init__()
                self.model = model

        clean = Qwen2ForCausalLM(real.model)
        assert direct_refusals(clean) == ()

        class Fp8LinearMethod(UnquantizedLinearMethod):  # a quantized method: off the allow-list, even as subclass
            pass

        class MLAAttention(torch.nn.Module):  # derives absorbed weights from kv_b_proj after loading
            def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
                pass

        class FusedMoE(torch.nn.Module):  # holds parameters, not a layer the setter rebuilds
            def __init__(self) -> None:
                super().__init__()
                self.w13_weight = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)

        o_proj = real.model.layers[0].self_attn.o_proj
        quantized = type(o_proj).__new__(type(o_proj))
        quantized.__dict__.update(o_proj.__dict__)
        quantized.quant_method = Fp8LinearMethod()
        unsafe = Qwen2ForCausalLM(real.model)
        unsafe.add_module("o_proj_fp8", quantized)
        unsafe.add_module("mla", MLAAttention())
        unsafe.add_module("experts", FusedMoE())
        reasons = direct_refusals(unsafe)
        assert any("o_proj_fp8 (RowParallelLinear) uses quant method Fp8LinearMethod" in r for r in reasons)
        assert any("mla (MLAAttention) derives state in process_weights_after_loading" in r for r in reasons)
        assert any("experts (FusedMoE) holds parameters" in r for r in reasons)
        assert len(reasons) == 3
    finally:
        stop_engine(llm)
