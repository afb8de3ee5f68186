"""The guard for unproven families on a real engine: the first install is probed, later ones are not, and an install
that leaves a layer stale fails closed instead of serving wrong tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights.adapters import VLLMInProcessAdapter
from hotweights.core import families
from hotweights.vllm import compat, introspect, patches

from .conftest import TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)


@pytest.fixture
def unproven(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2 as a family nobody has proven on this vLLM."""
    monkeypatch.setattr(families, "PROVEN", {})


@pytest.fixture
def engine(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> Iterator[tuple[Any, TinyCheckpoint, TinyCheckpoint]]:
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    yield llm, a, b
    stop_engine(llm)


def test_a_proven_family_is_named_proven(
    engine: tuple[Any, TinyCheckpoint, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, _, b = engine
    version = compat.vllm_version()
    if not families.is_proven("Qwen2ForCausalLM", vllm=version, device="cpu"):  # vLLM 0.31: the matrix has not run
        line = (families.release_line(version), "cpu")
        monkeypatch.setitem(families.PROVEN, line, families.PROVEN.get(line, frozenset()) | {"Qwen2ForCausalLM"})
    report = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert report.family_check == f"proven: Qwen2ForCausalLM on vLLM {version} on cpu (conformance matrix)"
    assert "family_probe" not in report.phases


def test_an_unproven_family_is_probed_once_per_engine(
    engine: tuple[Any, TinyCheckpoint, TinyCheckpoint], unproven: None
) -> None:
    llm, a, b = engine
    first = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert first.family_check is not None and "probed at v1" in first.family_check and "family_probe" in first.phases
    assert greedy_vllm(llm) == b.fresh
    second = hotweights.install(llm, a.state_dict(), weight_version=2)
    assert "family_probe" not in second.phases and "probed at v1" in (second.family_check or "")
    assert greedy_vllm(llm) == a.fresh
    with pytest.raises(hotweights.UnprovenFamilyError, match="unproven='refuse'"):
        hotweights.install(llm, b.state_dict(), weight_version=3, adapter=None, unproven="refuse")
    trusted = hotweights.install(llm, b.state_dict(), weight_version=3, unproven="trust")
    assert "probed at v1" in (trusted.family_check or "")  # this engine passed already


def test_the_probe_ranks_logprobs_eagerly_and_gives_vllms_ranking_back(
    engine: tuple[Any, TinyCheckpoint, TinyCheckpoint], unproven: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM compiles its logprob ranking on an engine's first logprobs request (seconds on CPU): the probe's request
    ranks eagerly instead, so that compile never runs inside the install, and vLLM's own function is back after."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    llm, _, b = engine
    calls: list[int] = []
    eager = patches._count_at_least

    def counted(x: Any, values: Any) -> Any:
        calls.append(int(x.shape[0]))
        return eager(x, values)

    monkeypatch.setattr(patches, "_count_at_least", counted)
    report = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert "probed at v1" in (report.family_check or "") and "family_probe" in report.phases
    assert calls, "the probe's prompt logprobs were ranked by vLLM's compiled function"
    assert sampler.batched_count_greater_than is logprobs.batched_count_greater_than
    assert greedy_vllm(llm) == b.fresh


def test_an_install_that_leaves_a_layer_stale_fails_closed(
    engine: tuple[Any, TinyCheckpoint, TinyCheckpoint], unproven: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that silently keeps one layer's old MLP (the kind of defect vLLM's reload had for MoE experts, tied
    heads and GPT-OSS) is caught by the probe: FamilyProbeError, generation refused, the version unchanged."""
    llm, _, b = engine
    model = introspect.inprocess_model(llm)
    load = model.load_weights

    def drops_a_layer(weights: Any, *args: Any, **kwargs: Any) -> Any:
        return load(((n, t) for n, t in weights if "layers.1.mlp.down_proj" not in n), *args, **kwargs)

    monkeypatch.setattr(model, "load_weights", drops_a_layer)
    adapter = VLLMInProcessAdapter(llm, install_method="reload")
    with pytest.raises(hotweights.FamilyProbeError, match="Qwen2ForCausalLM") as caught:
        hotweights.install(llm, b.state_dict(), weight_version=1, adapter=adapter)
    assert "tolerance" in str(caught.value)
    with pytest.raises(hotweights.PartialUpdateError):
        greedy_vllm(llm)
    assert adapter.active_weight_version is None  # still the engine's initial weights
    monkeypatch.setattr(model, "load_weights", load)  # the defect gone, the next install heals
    report = hotweights.install(llm, b.state_dict(), weight_version=1, adapter=adapter)
    assert "probed at v1" in (report.family_check or "")
    assert greedy_vllm(llm) == b.fresh
