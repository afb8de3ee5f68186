"""GPT-OSS (attention sinks, biased experts, sliding and full attention): vLLM 0.32's layerwise reload drops its
experts and sinks (they are copied past the weight loaders), mended by hotweights' ``gpt-oss-experts-sinks`` fix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import hotweights
from hotweights.vllm import fixes

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

Engine = tuple[Any, TinyCheckpoint, TinyCheckpoint]
pytestmark = pytest.mark.engine

VARIANT = Variant("gpt_oss", torch.float32, tie=False)


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[Engine]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    yield llm, a, b
    stop_engine(llm)


def test_install_a_to_b_to_a(engine: Engine) -> None:
    llm, a, b = engine
    assert a.fresh != b.fresh
    assert "gpt-oss-experts-sinks" in fixes.vllm_fixes_needed(llm)
    assert greedy_vllm(llm) == a.fresh
    # the trainer's state dict (transformers 5: fused experts), then the checkpoint's own tensors
    report = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert greedy_vllm(llm) == b.fresh, f"A->B via {report.adapter} ({report.install_method})"
    a_file = {k: v for f in sorted(a.path.glob("*.safetensors")) for k, v in load_file(f).items()}
    report = hotweights.install(llm, a_file, weight_version=2)
    assert greedy_vllm(llm) == a.fresh, f"B->A via {report.adapter} ({report.install_method})"


def test_the_family_guard_catches_vllms_reload_of_gpt_oss_without_the_mend(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the mend undone, vLLM's reload keeps the old experts and sinks. GPT-OSS is not proven on this vLLM, so
    the first install into an engine is probed: the engine fails closed, names the family, keeps its version."""
    from vllm.model_executor.models.gpt_oss import GptOssModel

    llm, _, b = engine
    mended = GptOssModel._load_weights_other
    monkeypatch.setattr(GptOssModel, "_load_weights_other", mended.__wrapped__)  # vLLM's own loader
    handle = hotweights.handles.as_engine(llm)
    monkeypatch.delitem(handle.__dict__, "_hotweights_family_probed", raising=False)  # as on a new engine
    before = hotweights.adapter_for(llm).active_weight_version
    with pytest.raises(hotweights.FamilyProbeError, match="GptOssForCausalLM"):
        hotweights.install(llm, b.state_dict(), weight_version=10)
    with pytest.raises(hotweights.PartialUpdateError):  # nothing wrong is served
        greedy_vllm(llm)
    assert hotweights.adapter_for(llm).active_weight_version == before
    monkeypatch.setattr(GptOssModel, "_load_weights_other", mended)
    report = hotweights.install(llm, b.state_dict(), weight_version=10)  # with the mend: heals, and passes the probe
    assert report.family_check is not None and "probed at v10" in report.family_check
    assert greedy_vllm(llm) == b.fresh
