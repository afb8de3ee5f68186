"""TRL's GRPOTrainer (colocated vLLM) trains for real and syncs through ``hotweights.integrations.trl.attach``.

After every sync the engine must serve exactly the trainer's current weights: vLLM's greedy output equals HF's on
the trainer's model (fp32 on both sides), the engine's version is the global step, and TRL's own measure of the
gap between the sampler and the trainer (``sampling/sampling_logp_difference/mean``) is ~0.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("vllm")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import hotweights
from hotweights.integrations.trl import TRLWeightSync, attach, lora_engine
from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, stop_engine

LOGP_KEY = "sampling/sampling_logp_difference/mean"  # trl/trainer/grpo_trainer.py
# Greedy prompts within the tokenizer's vocabulary (the model's vocabulary is the tokenizer's); the last one is
# longer than a KV block (32 tokens), so a stale prefix cache would show.
GREEDY_PROMPTS = [[2, 3, 4, 5], [17, 99, 3, 250, 7, 7, 8], [300, 12, 200], [(i * 37 + 11) % 300 for i in range(41)]]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "a", "cat", "sat", "on"]


def _tokenizer() -> Any:
    """A byte-level BPE trained in code (no hub); ids 0/1 are bos/eos, as in ``hotweights.testing.tiny_config``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def _reward(completions: list[str], **_: Any) -> list[float]:
    """Varies across completions (a constant reward has zero advantage and zero gradient)."""
    return [float(sum(c.count(ch) for ch in "aeiou")) / (1 + len(c)) for c in completions]


@dataclass
class Sync:
    step: int
    report: hotweights.InstallReport
    vllm: list[list[int]]
    hf: list[list[int]]
    engine_version: Any
    weights: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)


@pytest.fixture
def restore_env() -> Iterator[None]:
    """TRL sets RANK/WORLD_SIZE/MASTER_* for vLLM's external launcher: put the environment back afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _fp32_cpu_llm(**kwargs: Any) -> Any:
    """TRL's ``LLM(...)`` call, plus what TRL cannot pass: fp32 (vLLM downcasts fp32 checkpoints to bf16 by default,
    and only fp32 vLLM equals HF greedy exactly) and a CPU-sized KV cache."""
    from vllm import LLM

    kwargs.pop("gpu_memory_utilization", None)
    return LLM(**kwargs, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20)


def _train(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    steps: int,
    peft: bool,
    arch: str = "qwen2",
    with_lora: bool = False,
    trls_engine: bool = False,
) -> tuple[Any, Any, list[Sync]]:
    """Train ``steps`` GRPO steps; every sync TRL asks for goes through hotweights and is checked right after.
    ``trls_engine``: TRL's own ``LLM(...)`` as it starts it (bf16, compiled), checked only by the caller."""
    import trl.generation.vllm_generation as vg
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if not trls_engine:
        monkeypatch.setattr(vg, "LLM", _fp32_cpu_llm)
    tokenizer = _tokenizer()
    model = build_tiny_model(arch, seed=0, vocab=len(tokenizer))  # type: ignore[arg-type]
    path = save_tiny_model(model, tmp_path / "policy")
    tokenizer.save_pretrained(path)  # vLLM loads the tokenizer from the model directory
    prompts = [" ".join(WORDS[i : i + 3]) for i in range(8)]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=steps,
        learning_rate=3e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        bf16=False,  # TRL defaults to bf16 autocast: the trainer's logprobs would then differ from fp32 vLLM's
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
    )
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"])
    with lora_engine(max_lora_rank=8) if with_lora else contextlib.nullcontext():
        trainer = GRPOTrainer(
            model=str(path),
            reward_funcs=_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    llm = trainer.vllm_generation.llm
    handle = attach(trainer)
    syncs: list[Sync] = []
    trl_sync = trainer.vllm_generation.sync_weights

    def checked_sync() -> None:
        report = trl_sync()
        assert report is not None
        syncs.append(_check(trainer, llm, report, hf=not trls_engine))

    # A spy around the handle: TRL calls sync_weights itself, at the step it chooses; check what it installed.
    monkeypatch.setattr(trainer.vllm_generation, "sync_weights", checked_sync)
    try:
        trainer.train()  # TRL syncs before generating; attach's callback installs the last step at the end
        assert handle.last_report is not None and handle.last_report.weight_version == steps
    except BaseException:
        stop_engine(llm)
        raise
    return trainer, llm, syncs


def _served_model(trainer: Any) -> Any:
    """The HF model whose weights the engine should serve (for PEFT: a merged copy of the current adapter)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_and_unload"):
        import copy

        return copy.deepcopy(model).merge_and_unload()
    return model


@torch.no_grad()
def _greedy_hf(model: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Plain argmax decoding, like ``greedy_vllm``'s ``ignore_eos``: ``hotweights.testing.greedy_hf`` passes
    ``min_new_tokens``, which masks EOS, and this model's vocabulary is small enough that EOS does come up."""
    result = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        result.append(ids[0, len(p) :].tolist())
    return result


def _check(trainer: Any, llm: Any, report: hotweights.InstallReport, hf: bool = True) -> Sync:
    model = _served_model(trainer)
    was_training = model.training
    model.eval()
    sync = Sync(
        step=trainer.state.global_step,
        report=report,
        vllm=greedy_vllm(llm, GREEDY_PROMPTS),
        hf=_greedy_hf(model, GREEDY_PROMPTS) if hf else [],
        engine_version=llm.llm_engine.get_weight_version(),
        weights={k: v.detach().clone() for k, v in model.state_dict().items()},
    )
    model.train(was_training)
    return sync


def _assert_synced(syncs: list[Sync], trainer: Any, steps: int) -> None:
    assert [s.step for s in syncs] == list(range(steps + 1)), "one install per step, versioned by the global step"
    for s in syncs:
        assert s.report.weight_version == s.step
        assert str(s.engine_version) == str(s.step)
        assert s.vllm == s.hf, f"step {s.step}: vLLM serves something else than the trainer's model"
    for prev, cur in itertools.pairwise(syncs):
        changed = [k for k in cur.weights if not torch.equal(cur.weights[k], prev.weights[k])]
        assert changed, f"step {cur.step}: training did not change the weights, so the test proves nothing"
    logged = [e[LOGP_KEY] for e in trainer.state.log_history if LOGP_KEY in e]
    assert len(logged) == steps, f"TRL logged {LOGP_KEY} {len(logged)} times, expected {steps}"
    assert all(abs(v) < 1e-3 for v in logged), f"sampler and trainer disagree: {logged}"


def _summary(name: str, syncs: list[Sync], trainer: Any) -> str:
    logged = [e[LOGP_KEY] for e in trainer.state.log_history if LOGP_KEY in e]
    ms = ", ".join(f"v{s.step} {s.report.seconds * 1e3:.1f}" for s in syncs)
    return f"{name}: install ms per sync: {ms}; {LOGP_KEY}: {logged}; {syncs[-1].report}"


@pytest.mark.engine
def test_grpo_colocate_syncs_through_hotweights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    trainer, llm, syncs = _train(tmp_path, monkeypatch, steps=3, peft=False)
    try:
        _assert_synced(syncs, trainer, steps=3)
        assert len({tuple(map(tuple, s.vllm)) for s in syncs}) > 1, "greedy output never changed across steps"
        assert all(s.report.num_tensors == syncs[0].report.num_tensors for s in syncs)
    finally:
        stop_engine(llm)
    with capsys.disabled():
        print(f"\n{_summary('full', syncs, trainer)} ({time.perf_counter() - start:.1f} s)")


@pytest.mark.engine
def test_grpos_own_bf16_compiled_engine_equals_a_fresh_one_with_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """TRL's engine unchanged (bf16, compiled, as TRL starts it): after 2 GRPO steps synced through hotweights
    (the trainer's fp32 weights cast bucket by bucket), it serves what a freshly started engine with the same
    settings serves on the last step's weights, token for token and log-probability for log-probability."""
    from vllm import SamplingParams

    from hotweights.testing import start_reference_engine

    start = time.perf_counter()
    trainer, llm, syncs = _train(tmp_path, monkeypatch, steps=2, peft=False, trls_engine=True)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS]
    try:
        config = llm.llm_engine.vllm_config
        assert config.model_config.dtype == torch.bfloat16 and not config.model_config.enforce_eager
        assert [s.report.weight_version for s in syncs] == [0, 1, 2] and syncs[-1].report.cast_tensors > 0
        assert len({tuple(map(tuple, s.vllm)) for s in syncs}) > 1, "greedy output never changed across steps"
        live = llm.generate(prompts, sp, use_tqdm=False)
        settings = {"tokenizer": config.model_config.tokenizer}
    finally:
        stop_engine(llm)
    final = tmp_path / "final"
    _served_model(trainer).save_pretrained(final, safe_serialization=True)
    fresh = start_reference_engine(llm, final, **settings)
    try:
        reference = fresh.generate(prompts, sp, use_tqdm=False)
    finally:
        stop_engine(fresh)
    assert [list(o.outputs[0].token_ids) for o in live] == [list(o.outputs[0].token_ids) for o in reference]
    assert [o.outputs[0].cumulative_logprob for o in live] == [o.outputs[0].cumulative_logprob for o in reference]
    with capsys.disabled():
        print(f"\n{_summary('TRL engine', syncs, trainer)} ({time.perf_counter() - start:.1f} s)")


@pytest.mark.engine
def test_grpo_colocate_moe_policy_is_exact_after_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Qwen3-MoE policy (transformers 5 holds its experts fused; the engine loads per-expert tensors): after every
    sync, the last one by attach's train-end callback, the engine serves what the trainer holds."""
    start = time.perf_counter()
    trainer, llm, syncs = _train(tmp_path, monkeypatch, steps=3, peft=False, arch="qwen3_moe")
    try:
        _assert_synced(syncs, trainer, steps=3)
        assert any("experts.gate_up_proj" in n for n in syncs[-1].weights), "the trainer holds fused experts"
    finally:
        stop_engine(llm)
    with capsys.disabled():
        print(f"\n{_summary('moe', syncs, trainer)} ({time.perf_counter() - start:.1f} s)")


@pytest.mark.engine
def test_grpo_colocate_lora_serves_merged_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("peft")
    start = time.perf_counter()
    trainer, llm, syncs = _train(tmp_path, monkeypatch, steps=2, peft=True)
    try:
        _assert_synced(syncs, trainer, steps=2)
        assert not any("lora_" in n for n in syncs[-1].weights), "the reference must be the merged model"
    finally:
        stop_engine(llm)
    with capsys.disabled():
        print(f"\n{_summary('lora', syncs, trainer)} ({time.perf_counter() - start:.1f} s)")


@pytest.mark.engine
def test_grpo_colocate_lora_engine_gets_the_adapter_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PEFT policy and an engine started with LoRA: every sync sends the adapter alone, TRL's rollouts use it,
    and after every step vLLM with the adapter equals HF on the merged model."""
    pytest.importorskip("peft")
    start = time.perf_counter()
    trainer, llm, syncs = _train(tmp_path, monkeypatch, steps=3, peft=True, with_lora=True)
    try:
        assert [s.step for s in syncs] == [0, 1, 2, 3], "one install per step, versioned by the global step"
        model_bytes = sum(t.nbytes for t in syncs[-1].weights.values())
        for s in syncs:
            assert s.report.adapter == "lora" and s.report.weight_version == s.step, s.report
            assert s.report.num_bytes * 20 < model_bytes, (s.report.num_bytes, model_bytes)
            assert s.vllm == s.hf, f"step {s.step}: vLLM with the adapter serves something else than the trainer"
        assert len({tuple(map(tuple, s.vllm)) for s in syncs}) > 1, "greedy output never changed across steps"
        logged = [e[LOGP_KEY] for e in trainer.state.log_history if LOGP_KEY in e]
        assert all(abs(v) < 1e-3 for v in logged) and len(logged) == 3, f"sampler and trainer disagree: {logged}"
    finally:
        stop_engine(llm)
    with capsys.disabled():
        print(f"\n{_summary('lora-adapter', syncs, trainer)} ({time.perf_counter() - start:.1f} s)")


def test_import_hotweights_does_not_import_trl() -> None:
    code = "import sys, hotweights, hotweights.integrations.trl; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attach_refuses_a_trainer_without_vllm() -> None:
    class Trainer:
        pass

    with pytest.raises(hotweights.EngineNotSupportedError, match="use_vllm=True"):
        attach(Trainer())


def test_attach_refuses_unknown_install_options() -> None:
    with pytest.raises(TypeError, match="weight_version"):
        attach(object(), weight_version=3)


def test_server_mode_without_connect_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    class Generation:
        mode = "server"

        def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ()

    class Trainer:
        vllm_generation = Generation()

    monkeypatch.delattr(hotweights, "connect", raising=False)
    with pytest.raises(hotweights.EngineNotSupportedError, match=r"hotweights\.connect"):
        attach(Trainer())


def test_detach_gives_sync_weights_back() -> None:
    class Generation:
        mode = "server"

        def sync_weights(self) -> str:
            return "trl"

        def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ()

    class Accelerator:
        is_main_process = False  # the rank that only gathers: no connection is opened

    class Trainer:
        vllm_generation = Generation()
        accelerator = Accelerator()

    trainer = Trainer()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hotweights, "connect", lambda url: pytest.fail("only the main process connects"), raising=False)
        handle = attach(trainer)
        assert isinstance(handle, TRLWeightSync)
        assert trainer.vllm_generation.sync_weights == handle.sync
        with pytest.raises(hotweights.HotWeightsError, match="already attached"):
            attach(trainer)
        handle.detach()
        assert trainer.vllm_generation.sync_weights() == "trl"
        attach(trainer).detach()  # attachable again


class _FakeGeneration:
    """What attach() reads of TRL's VLLMGeneration, in server mode; counts the gathers every rank takes part in."""

    mode = "server"
    enable_sleep_mode = False
    server_base_url = None
    server_host = "10.0.0.7"
    server_port = 8123

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 2)
        self.gathers = 0

    def _iter_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.gathers += 1
        for name, param in self.model.named_parameters():
            yield name, param.data


def _fake_trainer(main: bool) -> Any:
    class Accelerator:
        is_main_process = main

    class State:
        global_step = 0

    class Trainer:
        vllm_generation = _FakeGeneration()
        accelerator = Accelerator()
        state = State()

    return Trainer()


def test_server_mode_installs_once_per_sync_on_the_main_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import hotweights.integrations.trl as integration

    class Client:
        dtype = "bfloat16"

    urls: list[str] = []
    calls: list[tuple[Any, dict[str, torch.Tensor], int, dict[str, Any]]] = []

    def fake_install(target: Any, tensors: dict[str, torch.Tensor], *, weight_version: int, **kw: Any) -> Any:
        calls.append((target, dict(tensors), weight_version, kw))
        return hotweights.InstallReport(
            update_id="u", weight_version=weight_version, previous_version=None, adapter="fake", num_tensors=2,
            num_bytes=0, prefix_cache_reset=True,
        )  # fmt: skip

    monkeypatch.setattr(hotweights, "connect", lambda url: urls.append(url) or Client(), raising=False)
    monkeypatch.setattr(integration, "install", fake_install)
    trainer = _fake_trainer(main=True)
    handle = attach(trainer, digests=True)
    assert urls == ["http://10.0.0.7:8123"]
    trainer.state.global_step = 5
    report = trainer.vllm_generation.sync_weights()  # what TRL calls
    assert report is handle.last_report and report.weight_version == 5
    target, tensors, version, kw = calls[-1]
    assert isinstance(target, Client) and version == 5
    assert kw == {"digests": True, "force": False, "cast": torch.bfloat16}  # cast bucket by bucket by install
    assert sorted(tensors) == ["bias", "weight"]
    handle.sync()  # the same step again (TRL re-pushes after sleep level 2): allowed
    assert calls[-1][3]["force"] is True and len(handle.reports) == 2

    other = _fake_trainer(main=False)  # a rank that only takes part in the gather
    other_handle = attach(other)
    assert other_handle.sync() is None and other.vllm_generation.gathers == 1 and len(calls) == 2
