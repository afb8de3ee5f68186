"""verl 0.9.1's LoRA syncs (``lora.merge=False``) from its own ``BucketedWeightSender`` into an engine started with
``enable_lora=True`` and hotweights' verl extension.

The adapter alone (``peft_config``, ``base_sync_done=True``) is installed as the adapter verl's rollout asks for (its
``VLLM_LORA_INT_ID`` / ``VLLM_LORA_NAME``), each sync equal, token for token and logprob for logprob, to a fresh
engine serving the same adapter from a PEFT directory; requests without an adapter never change. A NaN in the
adapter is refused naming the tensor, the previous adapter serving and the sender returning. The first sync of a
LoRA run (the base weights under PEFT's names, ``base_sync_done=False``) installs exactly. The baseline: verl's own
extension fails on this vLLM. Runs in .venv-verl (``make test-verl``); skipped where verl is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
try:
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, VLLM_LORA_PATH
except Exception as exc:  # not installed, or installed without the "vllm" alias (make test-verl builds both)
    pytest.skip(f"verl's weight sync cannot be imported here ({exc}): run `make test-verl`", allow_module_level=True)

import hotweights
from hotweights.core.envelope import decode
from hotweights.testing import PROMPTS, build_tiny_model, save_tiny_model, start_engine, stop_engine

from ..conftest import our_shm, refused_as
from .test_verl import DTYPE, EXTENSION, ROOT, _sync, _version, _weights

pytestmark = pytest.mark.engine

RANK = 8
TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA = dict(enable_lora=True, max_lora_rank=RANK, max_loras=1)
#: What verl's actor sends as ``peft_config`` (``LoraConfig.to_dict()``, the fields vLLM reads).
PEFT_CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": RANK,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "bias": "none",
    "target_modules": TARGETS,
}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """A rank-8 adapter on the base (seed 1) under the names verl sends (``get_peft_model_state_dict``)."""
    base = build_tiny_model("qwen2", seed=1).state_dict()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in TARGETS or not name.endswith(".weight"):
            continue
        out_f, in_f = weight.shape
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, in_f, generator=gen) * 0.5
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, RANK, generator=gen) * 0.5
    return out


def peft_base(seed: int) -> dict[str, torch.Tensor]:
    """The base weights as verl's FSDP actor sends them in a LoRA run's first sync (``collect_lora_params`` with
    ``base_sync_done=False``, then ``replace_lora_wrapper``): ``.base_layer`` before the weight of each projection."""
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in _weights(seed).items():
        module, _, leaf = name.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module.endswith(projections) else name] = tensor
    return out


def save_adapter(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    """``tensors`` as PEFT saves an adapter (``adapter_model.safetensors``, ``adapter_config.json``)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(PEFT_CONFIG))
    return directory


def verls_request() -> Any:
    """The ``LoRARequest`` verl's rollout server makes for every request (vllm_async_server.py:658)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=VLLM_LORA_NAME, lora_int_id=VLLM_LORA_INT_ID, lora_path=VLLM_LORA_PATH)


def scored(llm: Any, lora: Any = None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and each one's logprob, per prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], sp, lora_request=lora, use_tqdm=False)
    found = []
    for o in outs:
        tokens = list(o.outputs[0].token_ids)
        found.append((tokens, [step[t].logprob for step, t in zip(o.outputs[0].logprobs, tokens, strict=True)]))
    return found


class Fresh:
    """What fresh engines serve: on base seed 1 without an adapter and with adapters 0 and 1 (vLLM's own load of
    their PEFT directories), and on base seed 2 without one."""

    def __init__(self, tmp: Path) -> None:
        from vllm.lora.request import LoRARequest

        self.base = save_tiny_model(build_tiny_model("qwen2", seed=1), tmp / "base")
        self.adapters = [adapter(seed) for seed in (10, 11)]
        requests = [
            LoRARequest(f"a{i}", i + 1, str(save_adapter(a, tmp / f"a{i}"))) for i, a in enumerate(self.adapters)
        ]
        llm = start_engine(self.base, DTYPE, **LORA)
        try:
            self.served = [scored(llm, r) for r in requests]
            self.plain = scored(llm)
        finally:
            stop_engine(llm)
        other = save_tiny_model(build_tiny_model("qwen2", seed=2), tmp / "base2")
        llm = start_engine(other, DTYPE, **LORA)
        try:
            self.plain2 = scored(llm)
        finally:
            stop_engine(llm)
        tokens = [[t for t, _ in s] for s in (*self.served, self.plain, self.plain2)]
        assert len({json.dumps(t) for t in tokens}) == 4, (
            "the adapters or bases change nothing: the test proves nothing"
        )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Fresh:
    return Fresh(tmp_path_factory.mktemp("verl-lora"))


@pytest.fixture(scope="module")
def engine(fresh: Fresh) -> Iterator[Any]:
    llm = start_engine(fresh.base, DTYPE, worker_extension_cls=EXTENSION, **LORA)
    yield llm
    stop_engine(llm)


def _lora_sync(llm: Any, tensors: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, BaseException | None, float]:
    return _sync(llm, tensors, peft_config=PEFT_CONFIG, base_sync_done=True, **kwargs)


def _loaded(llm: Any) -> bool:
    """What verl's server asks before it sends a request with its adapter (vllm_async_server.py:656)."""
    return VLLM_LORA_INT_ID in llm.llm_engine.list_loras()


def test_two_lora_syncs_each_equal_a_fresh_engine_with_that_adapter(engine: Any, fresh: Fresh, capsys: Any) -> None:
    assert scored(engine) == fresh.plain
    timings = []
    for step, tensors in enumerate(fresh.adapters, start=1):
        result, error, seconds = _lora_sync(engine, tensors, global_steps=step)
        assert error is None, error
        assert (result["adapter"], result["weight_version"], _version(engine)) == ("lora", step, step), result
        assert result["tensors"] == len(tensors) == 2 * 2 * len(TARGETS)
        assert _loaded(engine)
        assert scored(engine, verls_request()) == fresh.served[step - 1], f"step {step}: another adapter serves"
        assert scored(engine) == fresh.plain, f"step {step}: requests without the adapter changed"
        timings.append(f"v{step} {seconds * 1e3:.0f} ms (add_lora {result['install_s'] * 1e3:.0f} ms)")
    timings.append(f"{result['bytes']} bytes")
    assert not our_shm()
    with capsys.disabled():
        print(f"\nverl LoRA sync -> hotweights: {', '.join(timings)}")


def test_a_nan_in_lora_b_is_refused_and_the_previous_adapter_serves(engine: Any, fresh: Fresh) -> None:
    result, error, _ = _lora_sync(engine, fresh.adapters[0])
    assert error is None, error
    version = _version(engine)
    bad = dict(fresh.adapters[1])
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    bad[name] = bad[name].clone()
    bad[name][2, 3] = float("nan")
    result, error, _ = _lora_sync(engine, bad)  # fails unless the sender returned
    assert isinstance(error, hotweights.NonFiniteWeightsError), (result, error)
    assert refused_as(error) == {name: f"1 NaN and 0 Inf among {bad[name].numel()} values"}
    typed = decode(f"Worker failed with error '{error}'")  # as the trainer gets it from another process
    assert isinstance(typed, hotweights.NonFiniteWeightsError) and name in str(typed)
    assert _version(engine) == version and _loaded(engine)
    assert scored(engine, verls_request()) == fresh.served[0]
    assert scored(engine) == fresh.plain


def test_an_adapter_that_does_not_fit_is_refused_naming_each_problem(engine: Any, fresh: Fresh) -> None:
    _, error, _ = _lora_sync(engine, fresh.adapters[1])
    assert error is None, error
    bad = dict(fresh.adapters[0])
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    bad[b] = bad[b][:-1].contiguous()  # one output row short of q_proj
    a = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    bad[a] = torch.zeros(2 * RANK, bad[a].shape[1])  # rank 16 > max_lora_rank 8
    bad["base_model.model.lm_head.lora_A.weight"] = torch.zeros(RANK, 128)  # not a LoRA layer of vLLM's
    bad["base_model.model.lm_head.lora_B.weight"] = torch.zeros(1000, RANK)
    _, error, _ = _lora_sync(engine, bad)
    assert isinstance(error, hotweights.WeightManifestValidationError), error
    text = str(error)
    assert b in text and "rank <= 8" in text and "base_model.model.lm_head" in text, text
    assert scored(engine, verls_request()) == fresh.served[1] and scored(engine) == fresh.plain


def test_an_adapter_vllm_refuses_leaves_the_previous_one_serving(engine: Any, fresh: Fresh) -> None:
    """An adapter that passes hotweights' checks but not vLLM's (a DoRA config): vLLM loads the new adapter before it
    drops the old one (``load_inplace``), so the previous adapter still serves under verl's id."""
    _, error, _ = _lora_sync(engine, fresh.adapters[0])
    assert error is None, error
    _, error, _ = _sync(engine, fresh.adapters[1], peft_config={**PEFT_CONFIG, "use_dora": True}, base_sync_done=True)
    assert isinstance(error, hotweights.InstallError) and "DoRA" in str(error), error
    assert _loaded(engine) and scored(engine, verls_request()) == fresh.served[0] and scored(engine) == fresh.plain


def test_the_first_sync_of_a_lora_run_installs_the_base_under_peft_names(engine: Any, fresh: Fresh) -> None:
    """verl's first sync of a LoRA run: the base weights under PEFT's names (``peft_config`` set,
    ``base_sync_done=False``), installed as the checkpoint names them; the adapter applies on the new base."""
    result, error, _ = _sync(engine, peft_base(2), peft_config=PEFT_CONFIG, base_sync_done=False, global_steps=5)
    assert error is None, error
    assert result["tensors"] == 27 and _version(engine) == 5, result
    assert scored(engine) == fresh.plain2
    prefixed = {f"base_model.model.{k}": v for k, v in peft_base(1).items()}  # the prefix some engines keep
    result, error, _ = _sync(engine, prefixed, peft_config=PEFT_CONFIG, base_sync_done=False, global_steps=6)
    assert error is None, error
    assert scored(engine) == fresh.plain
    _, error, _ = _lora_sync(engine, fresh.adapters[1], global_steps=7)
    assert error is None and scored(engine, verls_request()) == fresh.served[1], error


def test_verls_own_call_path_for_a_lora_run(engine: Any, fresh: Fresh) -> None:
    """verl's own colocated sync of a LoRA run (``lora.merge=False``), as far up as runs here (see test_verl.py's
    call-path test for the stand-ins): ``ActorRolloutRefWorker.update_weights`` sends the base under PEFT's names and
    then the adapter at its first step, the adapter alone after, each through verl's ``ServerAdapter``; each step
    equal to a fresh engine with that adapter; a NaN adapter raises the typed error out of verl's ``update_weights``,
    the previous adapter serving."""
    import asyncio

    try:
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError as exc:  # its trainer worker imports `datasets` (make test-verl installs it)
        pytest.skip(f"verl's trainer worker cannot be imported here ({exc})")

    from .verl_helpers import for_llm, server_adapter, trainer_worker, verl_worker_env

    verl_worker_env()
    rollout = server_adapter(for_llm(engine))
    sent = {"adapter": fresh.adapters[0]}

    def per_tensor_param(layered_summon: bool = False, base_sync_done: bool = False, **_: Any) -> Any:
        """The FSDP actor's answer in a LoRA run (fsdp/transformer_impl.py:977): the adapter, or the base."""
        return iter((sent["adapter"] if base_sync_done else peft_base(1)).items()), dict(PEFT_CONFIG)

    # the rollout started on dummy weights: the first step sends the base too
    worker = trainer_worker(rollout, per_tensor_param, base_sync_done=False)
    before = _version(engine) or 0
    asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=1, mode="naive"))
    assert worker.base_sync_done and rollout.server_handle.calls == ["update_weights_from_ipc"] * 2
    assert _version(engine) == before + 1  # the base and the adapter of verl's first step: one version
    assert scored(engine, verls_request()) == fresh.served[0] and scored(engine) == fresh.plain
    sent["adapter"] = fresh.adapters[1]
    asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=2, mode="naive"))
    assert rollout.server_handle.calls == ["update_weights_from_ipc"] * 3 and rollout.server_handle.global_steps == 2
    assert _version(engine) == before + 2
    assert scored(engine, verls_request()) == fresh.served[1] and scored(engine) == fresh.plain
    bad = dict(fresh.adapters[0])
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    bad[name] = bad[name].clone()
    bad[name][0, 0] = float("nan")
    sent["adapter"] = bad
    with pytest.raises(hotweights.NonFiniteWeightsError, match=r"q_proj\.lora_B"):
        asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=3, mode="naive"))
    assert scored(engine, verls_request()) == fresh.served[1] and rollout.server_handle.global_steps == 2


def test_a_multiprocess_engine_installs_the_adapter_and_refuses_a_nan_typed(fresh: Fresh) -> None:
    """vLLM's default engine (its worker in a process of its own): the adapter is installed there, and a refused one
    reaches the trainer as the text of vLLM's RPC error, from which the envelope rebuilds the typed error."""
    llm = start_engine(fresh.base, DTYPE, multiprocess=True, worker_extension_cls=EXTENSION, **LORA)
    try:
        result, error, _ = _lora_sync(llm, fresh.adapters[0], global_steps=3)
        assert error is None and result["weight_version"] == 3, (result, error)
        assert scored(llm, verls_request()) == fresh.served[0] and scored(llm) == fresh.plain
        bad = dict(fresh.adapters[1])
        name = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
        bad[name] = torch.full_like(bad[name], float("inf"))
        _, error, _ = _lora_sync(llm, bad)
        typed = decode(error)
        assert isinstance(typed, hotweights.NonFiniteWeightsError) and refused_as(typed) == {
            name: f"0 NaN and {bad[name].numel()} Inf among {bad[name].numel()} values"
        }, error
        assert scored(llm, verls_request()) == fresh.served[0] and scored(llm) == fresh.plain
        assert _version(llm) == 3 and not our_shm()
    finally:
        stop_engine(llm)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_verls_own_extension_fails_its_lora_sync_here(tmp_path: Path, fresh: Fresh) -> None:
    """The baseline, in a process of its own (its sender may never return): verl's extension removes its adapter,
    then its own loader (``VLLMHijack``) fails on this vLLM."""
    from safetensors.torch import save_file

    weights = tmp_path / "a.safetensors"
    save_file(fresh.adapters[0], str(weights))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VERL_RAY_JOB_ID": f"baseline-lora-{os.getpid()}"}
    cmd = [sys.executable, "-m", "tests.integrations.verl_helpers", "baseline", "--model", str(fresh.base)]
    cmd += ["--weights", str(weights), "--wait", "5", "--lora", json.dumps(PEFT_CONFIG)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    found = json.loads(lines[-1])
    assert found["errors"], "verl's own extension installed the adapter on this vLLM: the baseline no longer fails"
    assert any("get_unstacked_mapper" in e for e in found["errors"]), found
    print(f"\nbaseline: {found}")


def test_a_lora_sync_into_an_engine_without_lora_is_refused(fresh: Fresh) -> None:
    """Last in this module: stopping a second in-process engine tears down vLLM's process-wide groups, which the
    module's engine needs."""
    llm = start_engine(fresh.base, DTYPE, worker_extension_cls=EXTENSION)
    try:
        _, error, _ = _lora_sync(llm, fresh.adapters[0])
        assert isinstance(error, hotweights.EngineNotSupportedError) and "enable_lora=True" in str(error), error
        assert scored(llm) == fresh.plain
    finally:
        stop_engine(llm)
