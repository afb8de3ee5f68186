"""``hotweights.install_lora`` into real engines started with ``enable_lora=True``: the adapter alone, checked before
anything is written, equal after each install to a fresh engine that loads the same adapter from PEFT's own files
and to HF PEFT."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import NonFiniteWeightsError, StaleWeightVersionError, WeightManifestValidationError

from ..conftest import refused_as
from .conftest import PROMPTS, build_tiny_model, greedy_hf, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

RANK = 8
TARGETS = ["q_proj", "v_proj", "down_proj"]


def peft_model(seed: int) -> Any:
    """The base model (seed 1) with a rank-8 adapter whose A and B are random (PEFT starts B at 0: no effect)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        build_tiny_model("qwen2", seed=1), LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    )
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def generate(llm: Any, lora: Any = None) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], sp, lora_request=lora, use_tqdm=False))


def greedy(llm: Any, lora: Any = None) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in generate(llm, lora)]


def served_by(llm: Any, lora: Any) -> tuple[list[list[int]], set[int | None]]:
    """Greedy tokens with ``lora``, and the adapter versions its outputs report."""
    outs = generate(llm, lora)
    return [list(o.outputs[0].token_ids) for o in outs], {hotweights.lora_version_of(o) for o in outs}


class Lora:
    def __init__(self, tmp: Path) -> None:
        from vllm.lora.request import LoRARequest

        self.models = [peft_model(seed) for seed in (3, 4)]
        self.config = self.models[0].peft_config["default"]
        self.base = tmp / "base"
        build_tiny_model("qwen2", seed=1).save_pretrained(self.base, safe_serialization=True)
        self.hf = [greedy_hf(m) for m in self.models]
        self.hf_base = greedy_hf(build_tiny_model("qwen2", seed=1))
        saved = []
        for i, m in enumerate(self.models):
            m.save_pretrained(tmp / f"adapter{i}")
            saved.append(LoRARequest(f"fresh{i}", i + 1, str(tmp / f"adapter{i}")))
        fresh = start_engine(self.base, multiprocess=False, enable_lora=True, max_lora_rank=RANK, max_loras=2)
        self.fresh = [greedy(fresh, r) for r in saved]  # vLLM's own load of PEFT's own files
        self.fresh_base = greedy(fresh)
        stop_engine(fresh)
        assert self.fresh[0] != self.fresh[1] != self.fresh_base, "the adapters change nothing: the test proves nothing"


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Lora:
    return Lora(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def inprocess(lora: Lora) -> Iterator[Any]:
    llm = start_engine(lora.base, multiprocess=False, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    yield llm
    stop_engine(llm)


def test_the_adapter_alone_v1_then_v2_equals_a_fresh_engine_and_hf_peft(lora: Lora, inprocess: Any) -> None:
    llm = inprocess
    assert lora.fresh == lora.hf and lora.fresh_base == lora.hf_base
    report = hotweights.install_lora(
        llm, adapter_tensors(lora.models[0]), name="policy", weight_version=1, config=lora.config
    )
    assert (report.adapter, report.weight_version, report.previous_version) == ("lora", 1, None)
    assert report.num_tensors == 2 * 2 * len(TARGETS) and report.prefix_cache_reset
    assert report.stall_s is not None and report.stall_s >= report.phases["install"]
    v1 = hotweights.lora_request(llm, "policy")
    assert served_by(llm, v1) == (lora.fresh[0], {1})  # each output says which adapter version produced it
    assert {hotweights.lora_version_of(o) for o in generate(llm)} == {None}  # the base model alone
    # live PEFT names (".default") are taken too; the same prompts again: the prefix cache must not serve v1's blocks
    live = {k: v for k, v in lora.models[1].state_dict().items() if "lora_" in k}
    report = hotweights.install_lora(llm, live, name="policy", weight_version=2, config=lora.config)
    assert report.previous_version == 1
    assert served_by(llm, hotweights.lora_request(llm, "policy")) == (lora.fresh[1], {2})
    # v1's request object, kept from before: it is served by v1's adapter, and says so (an adapter reloaded in place
    # under v1's id would serve v2's weights under v1's label)
    assert served_by(llm, v1) == (lora.fresh[0], {1})
    assert greedy(llm) == lora.fresh_base  # the base weights never moved
    with pytest.raises(StaleWeightVersionError):
        hotweights.install_lora(llm, adapter_tensors(lora.models[0]), name="policy", weight_version=2)
    assert greedy(llm, hotweights.lora_request(llm, "policy")) == lora.fresh[1]
    assert len([p for p in our_shm() if "-lora-" in p]) == 2  # the current and the previous version, loadable
    hotweights.install_lora(llm, adapter_tensors(lora.models[0]), name="policy", weight_version=3, config=lora.config)
    assert served_by(llm, hotweights.lora_request(llm, "policy")) == (lora.fresh[0], {3})
    assert len([p for p in our_shm() if "-lora-" in p]) == 2  # v1's went: removed from the engine, files deleted


def test_a_bad_adapter_is_refused_naming_each_problem_and_the_old_one_keeps_serving(lora: Lora, inprocess: Any) -> None:
    llm = inprocess
    good = adapter_tensors(lora.models[1])
    hotweights.install_lora(llm, good, name="policy", weight_version=10, config=lora.config, force=True)
    bad = dict(good)
    b = next(n for n in bad if n.endswith("q_proj.lora_B.weight"))
    bad[b] = bad[b][:-1]  # one output row short of q_proj
    a = next(n for n in bad if n.endswith("v_proj.lora_A.weight"))
    bad[a] = torch.zeros(2 * RANK, bad[a].shape[1])  # rank 16 > max_lora_rank 8 (and B disagrees)
    bad["base_model.model.model.layers.0.mlp.no_such.lora_A.weight"] = torch.zeros(RANK, 4)
    bad["base_model.model.model.layers.0.mlp.no_such.lora_B.weight"] = torch.zeros(4, RANK)
    bad["base_model.model.lm_head.weight"] = torch.zeros(1)
    with pytest.raises(WeightManifestValidationError) as info:
        hotweights.install_lora(llm, bad, name="policy", weight_version=11, config=lora.config)
    text = str(info.value)
    assert "q_proj.lora_B.weight" in text and "rank <= 8" in text and "no_such" in text and "lm_head" in text
    assert len(info.value.mismatches) >= 5
    assert greedy(llm, hotweights.lora_request(llm, "policy")) == lora.fresh[1]  # nothing was written


def test_a_nonfinite_adapter_is_refused_and_base_requests_are_unchanged(lora: Lora, inprocess: Any) -> None:
    llm = inprocess
    good = adapter_tensors(lora.models[1])
    hotweights.install_lora(llm, good, name="policy", weight_version=20, config=lora.config, force=True)
    bad = dict(good)
    b = next(n for n in bad if n.endswith("q_proj.lora_B.weight"))
    bad[b] = bad[b].clone()
    bad[b][0, 0] = float("nan")
    a = next(n for n in bad if n.endswith("down_proj.lora_A.weight"))
    bad[a] = torch.full_like(bad[a], float("-inf"))
    with pytest.raises(NonFiniteWeightsError) as info:
        hotweights.install_lora(llm, bad, name="policy", weight_version=21, config=lora.config)
    assert refused_as(info.value) == {
        b: f"1 NaN and 0 Inf among {bad[b].numel()} values",
        a: f"0 NaN and {bad[a].numel()} Inf among {bad[a].numel()} values",
    }
    assert "LoRA adapter 'policy'" in str(info.value)
    assert served_by(llm, hotweights.lora_request(llm, "policy")) == (lora.fresh[1], {20})  # the old one serves
    assert greedy(llm) == lora.fresh_base  # base requests never saw the bad adapter


def test_the_adapter_alone_into_a_multiprocess_llm(lora: Lora) -> None:
    before = set(our_shm())
    llm = start_engine(lora.base, multiprocess=True, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    try:
        for version, i in ((1, 0), (2, 1)):
            report = hotweights.install_lora(
                llm, adapter_tensors(lora.models[i]), name="policy", weight_version=version, config=lora.config
            )
            assert report.adapter == "lora"
            assert greedy(llm, hotweights.lora_request(llm, "policy")) == lora.fresh[i]
        assert greedy(llm) == lora.fresh_base
    finally:
        stop_engine(llm, wait=True)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert set(our_shm()) <= before  # the adapter's files went with the engine


def test_the_adapter_alone_into_an_async_llm(lora: Lora) -> None:
    """``install_lora_async`` on the engine's loop: v1, v2 while requests run (pause="wait": none mixes versions),
    then a bad adapter refused with v2 still serving."""
    import asyncio

    from vllm import SamplingParams

    from hotweights.testing import EventLoopThread, start_async_engine

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    async def greedy_async(engine: Any, lora_request: Any = None) -> list[list[int]]:
        async def one(i: int, prompt: Any) -> list[int]:
            final = None
            request = {"prompt_token_ids": list(prompt)}
            async for out in engine.generate(request, sp, request_id=f"lora-{i}-{id(lora_request)}",
                                             lora_request=lora_request):  # fmt: skip
                final = out
            assert final is not None
            return list(final.outputs[0].token_ids)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))

    loop = EventLoopThread()
    engine = loop.call(start_async_engine, lora.base, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    try:

        async def scenario() -> tuple[list[list[list[int]]], list[Any], str]:
            served, reports = [], []
            for version, i in ((1, 0), (2, 1)):
                running = asyncio.ensure_future(greedy_async(engine))  # base-model requests in flight
                tensors = adapter_tensors(lora.models[i])
                install = hotweights.install_lora_async(
                    engine, tensors, name="policy", weight_version=version, config=lora.config
                )
                reports.append(await install)
                assert await running == lora.fresh_base
                served.append(await greedy_async(engine, hotweights.lora_request(engine, "policy")))
            bad = adapter_tensors(lora.models[0])
            first = next(iter(bad))
            bad[first] = bad[first][:, :-1]
            try:
                await hotweights.install_lora_async(engine, bad, name="policy", weight_version=3, config=lora.config)
                refused = ""
            except WeightManifestValidationError as exc:
                refused = str(exc)
            served.append(await greedy_async(engine, hotweights.lora_request(engine, "policy")))
            return served, reports, refused

        served, reports, refused = loop.run(scenario())
    finally:
        engine.shutdown()
        loop.close()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert served == [lora.fresh[0], lora.fresh[1], lora.fresh[1]]
    assert [(r.adapter, r.weight_version, r.previous_version) for r in reports] == [("lora", 1, None), ("lora", 2, 1)]
    assert refused and "lora_A" in refused
