"""``hotweights.install`` on any ``vllm.LLM``: a plain multiprocess engine (no extension, no backend: the
weights-path adapter), and the first-install race on an in-process engine (a call already running is waited for)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hotweights
from hotweights import (
    EngineNotSupportedError,
    EngineSleepingError,
    InstallError,
    NonFiniteWeightsError,
    PartialUpdateError,
    UnprovenFamilyError,
    WeightManifestValidationError,
)
from hotweights.adapters import VLLMInProcessAdapter, VLLMMultiprocessAdapter, weights_path
from hotweights.core.families import is_proven
from hotweights.vllm import compat

from ..conftest import poisoned, refused_as
from .conftest import PROMPTS, TinyCheckpoint, Variant, greedy_vllm, our_shm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
LONG = PROMPTS[-1]  # longer than a KV block


@pytest.fixture(scope="module")
def plain(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> Iterator[tuple[Any, TinyCheckpoint, TinyCheckpoint]]:
    """A plain ``LLM(model=...)``: vLLM's default multiprocess engine, started with nothing from hotweights."""
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=True)
    assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
    yield llm, a, b
    stop_engine(llm)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_plain_multiprocess_llm_a_to_b_to_a(plain: tuple[Any, TinyCheckpoint, TinyCheckpoint]) -> None:
    llm, a, b = plain
    report = hotweights.install(llm, b.state_dict(), weight_version=1)
    assert report.adapter == "weights-path"
    assert "pack" in report.phases and "install" in report.phases
    assert llm.llm_engine.get_weight_version() == "1"
    assert greedy_vllm(llm) == b.fresh == b.hf
    hotweights.install(llm, a.state_dict(), weight_version=2)
    assert greedy_vllm(llm) == a.fresh == a.hf
    assert our_shm() == []


def test_plain_llm_bad_update_writes_nothing(plain: tuple[Any, TinyCheckpoint, TinyCheckpoint]) -> None:
    llm, _, b = plain
    adapter = hotweights.adapter_for(llm)
    version = adapter.active_weight_version or 0
    before = greedy_vllm(llm)
    sd = b.state_dict()
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :7]
    sd["model.layers.1.self_attn.q_proj.weight"] = sd["model.layers.1.self_attn.q_proj.weight"].double()
    with pytest.raises(WeightManifestValidationError) as info:
        hotweights.install(llm, sd, weight_version=version + 1)
    assert {m.kind for m in info.value.mismatches} == {"shape", "dtype"}
    assert greedy_vllm(llm) == before
    assert llm.llm_engine.get_weight_version() == str(version)
    assert our_shm() == []


def test_options_that_need_the_extension_name_it(plain: tuple[Any, TinyCheckpoint, TinyCheckpoint]) -> None:
    llm, _, _ = plain
    for options in ({"commit": "streaming", "install_method": "direct"}, {"install_method": "direct"}, {}):
        with pytest.raises(EngineNotSupportedError, match="worker_extension_cls") as info:
            VLLMMultiprocessAdapter(llm, **options)
        assert hotweights.WORKER_EXTENSION in str(info.value)
    with pytest.raises(EngineNotSupportedError, match="not an engine"):
        hotweights.install(object(), {}, weight_version=1)


def test_failed_reload_fails_closed_then_heals(
    plain: tuple[Any, TinyCheckpoint, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker cannot read the checkpoint (garbage file): the reload fails after the write began, so generation
    is refused until a full install succeeds, and /dev/shm is clean either way."""
    llm, _, b = plain
    adapter = hotweights.adapter_for(llm)
    version = adapter.active_weight_version or 0

    def garbage(path: Path, items: object) -> None:
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")

    monkeypatch.setattr(weights_path, "_write_safetensors", garbage)
    with pytest.raises(InstallError, match="failed while writing"):
        hotweights.install(llm, b.state_dict(), weight_version=version + 1)
    assert our_shm() == []
    with pytest.raises(PartialUpdateError):
        greedy_vllm(llm)
    assert llm.llm_engine.get_weight_version() == str(version)
    monkeypatch.undo()
    hotweights.install(llm, b.state_dict(), weight_version=version + 1)
    assert greedy_vllm(llm) == b.fresh
    assert our_shm() == []


def test_sleeping_engine_is_never_written(plain: tuple[Any, TinyCheckpoint, TinyCheckpoint]) -> None:
    llm, a, _ = plain
    llm.sleep()
    try:
        if not llm.llm_engine.is_sleeping():
            pytest.skip("this vLLM build has no sleep mode on CPU (llm.sleep() is a no-op); the check runs on GPUs")
        version = hotweights.adapter_for(llm).active_weight_version or 0
        with pytest.raises(EngineSleepingError, match="wake_up"):
            hotweights.install(llm, a.state_dict(), weight_version=version + 1)
        assert llm.llm_engine.get_weight_version() == str(version)
        llm.wake_up(tags=["weights"])  # TRL's order: weights first, install, then the KV cache
        assert llm.llm_engine.is_sleeping()  # vLLM's coarse report still says asleep; the weights are not
        hotweights.install(llm, a.state_dict(), weight_version=version + 1)
    finally:
        llm.wake_up()
    assert greedy_vllm(llm) == a.hf


def test_detach_gives_the_engine_back_to_vllm_and_the_next_install_attaches_again(
    plain: tuple[Any, TinyCheckpoint, TinyCheckpoint],
) -> None:
    """Every patch hotweights made to the LLM, its engine and its core client is undone by one call, which leaves
    one attribute at most; the engine keeps serving what was installed, and hotweights attaches again on its next
    install."""
    llm, a, b = plain
    engine, client = llm.llm_engine, llm.llm_engine.engine_core
    before = hotweights.adapter_for(llm).active_weight_version or 0
    hotweights.install(llm, b.state_dict(), weight_version=before + 1)
    patched = {"generate", "sleep", "wake_up", "_run_engine"}
    assert patched <= set(vars(llm)) and {"add_request", "step"} <= set(vars(engine))
    assert {"_send_input", "call_utility"} <= set(vars(client))
    assert [k for k in vars(llm) if "hotweights" in k] == ["_hotweights"]  # one attribute, the handle inside it
    undone = hotweights.detach(llm)
    assert undone >= 12
    assert not patched & set(vars(llm)) and not {"add_request", "step"} & set(vars(engine))
    assert llm.generate.__func__ is type(llm).generate  # vLLM's own again
    assert not {"_send_input", "call_utility", "shutdown", "get_output"} & set(vars(client))
    assert not [k for k in vars(llm) if "hotweights" in k] and hotweights.detach(llm) == 0
    assert greedy_vllm(llm) == b.fresh  # still serving what was installed
    hotweights.install(llm, a.state_dict(), weight_version=before + 2)  # a fresh handle reads the version back
    assert hotweights.adapter_for(llm).active_weight_version == before + 2
    assert greedy_vllm(llm) == a.fresh
    assert our_shm() == []


def test_inprocess_sleep_is_read_from_the_executor(checkpoint: Callable[[Variant, int], TinyCheckpoint]) -> None:
    """In-process (TRL's colocate mode), the weights' own sleeping tag decides, whenever the engine slept."""
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        llm.sleep(level=1)  # before hotweights ever saw the engine
        if not llm.llm_engine.is_sleeping():
            pytest.skip("this vLLM build has no sleep mode on CPU")
        with pytest.raises(EngineSleepingError):
            hotweights.install(llm, b.state_dict(), weight_version=1)
        llm.wake_up(tags=["weights"])  # the KV cache still sleeps, and vLLM keeps the scheduler paused until it wakes
        options: dict[str, Any] = {}
        if not is_proven("Qwen2ForCausalLM", vllm=compat.vllm_version(), device=compat.device_kind()):
            # unproven here (vLLM 0.31, a GPU): the first install is probed by generating, which a paused scheduler
            # never runs (before: a hang), so it is refused before writing; trusted, it installs
            with pytest.raises(UnprovenFamilyError, match=r"scheduler of vllm\.LLM \(in-process\) is paused"):
                hotweights.install(llm, b.state_dict(), weight_version=1)
            options["unproven"] = "trust"
        hotweights.install(llm, b.state_dict(), weight_version=1, **options)
        llm.wake_up()
        assert greedy_vllm(llm) == b.hf
    finally:
        stop_engine(llm)


# --------------------------------------------------------------------------- the first-install race
def test_generation_running_before_the_first_install_is_waited_for(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """A generate call that started before hotweights ever saw the engine (so it never entered the gate) finishes
    entirely on the old weights; the install waits for it, then the new weights serve."""
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        reference = greedy_vllm(llm, [LONG], max_tokens=80)  # A, computed before any install
        result: list[list[list[int]]] = []
        thread = threading.Thread(target=lambda: result.append(greedy_vllm(llm, [LONG], max_tokens=80)))
        thread.start()
        while not llm.llm_engine.has_unfinished_requests():  # it is generating, outside any gate
            assert thread.is_alive() or result, "the generation thread died"
            if result:
                pytest.fail("generation finished before the install could start; make it longer")
        report = hotweights.install(llm, b.state_dict(), weight_version=1)
        thread.join(timeout=60)
        assert result == [reference]  # entirely the old weights: no mix, no crash
        assert report.phases["wait_generation"] > 0
        assert greedy_vllm(llm) == b.fresh
    finally:
        stop_engine(llm)


def test_a_generation_loop_from_before_the_first_install_survives_eight_installs(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """A thread generating in a loop since before hotweights saw the engine, through a ``generate`` it looked up
    then (so it never enters the wrapped method): each of its calls runs wholly on one version, none dies, and no
    install waits for requests that nobody runs (issue 18: vLLM logged "Failed to reset prefix cache", the thread
    died, the second install timed out)."""
    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        from vllm import SamplingParams

        generate = llm.generate  # looked up before the gate exists: the unwrapped method
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
        stop, outputs, errors = threading.Event(), [], []

        def loop() -> None:
            try:
                while not stop.is_set():
                    outs = generate(prompts, sp, use_tqdm=False)
                    outputs.append([list(o.outputs[0].token_ids) for o in outs])
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=loop)
        thread.start()
        while not outputs and not errors:  # it is generating, outside any gate
            time.sleep(0.01)
        # the gate is made now; a hang fails fast
        adapter = VLLMInProcessAdapter(llm, install_method="reload", lock_timeout=60)
        for version in range(1, 9):
            ckpt = b if version % 2 else a
            hotweights.install(llm, ckpt.state_dict(), weight_version=version, adapter=adapter)
        stop.set()
        thread.join(timeout=120)
        assert not thread.is_alive() and errors == []
        assert all(out in (a.fresh, b.fresh) for out in outputs), "a call mixed two versions"
        assert greedy_vllm(llm) == a.fresh  # version 8 is A
    finally:
        stop_engine(llm)


def test_a_thread_driving_llm_engine_by_hand_never_steps_during_an_install(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """Requests added through ``llm.llm_engine.add_request`` and stepped by hand: each batch runs on one version, and
    installs neither overlap its steps nor wait for requests nobody runs."""
    from vllm import SamplingParams

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        adapter = VLLMInProcessAdapter(llm, install_method="reload", lock_timeout=60)  # the gate exists from here on
        engine = llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        stop, batches, errors = threading.Event(), [], []

        def drive() -> None:
            try:
                n = 0
                while not stop.is_set():
                    for p in PROMPTS:
                        n += 1
                        engine.add_request(f"hand-{n}", {"prompt_token_ids": list(p)}, sp)
                    done: dict[tuple[int, ...], list[int]] = {}
                    while engine.has_unfinished_requests():
                        for out in engine.step():
                            if out.finished:
                                done[tuple(out.prompt_token_ids)] = list(out.outputs[0].token_ids)
                    batches.append([done[tuple(p)] for p in PROMPTS])
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=drive)
        thread.start()
        while not batches and not errors:
            time.sleep(0.01)
        for version in range(1, 5):
            ckpt = b if version % 2 else a
            hotweights.install(llm, ckpt.state_dict(), weight_version=version, adapter=adapter)
        stop.set()
        thread.join(timeout=120)
        assert not thread.is_alive() and errors == []
        assert all(batch in (a.fresh, b.fresh) for batch in batches), "a batch mixed two versions"
    finally:
        stop_engine(llm)


def test_a_three_prompt_generate_loop_from_before_any_hotweights_call_never_deadlocks_an_install(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """Issue 26, as seen: a thread loops ``llm.generate([p1, p2, p3])`` from before hotweights ever saw the engine;
    the main thread installs v1..v8, alternating B and A. The first install used to close the gate while a call sat
    between its first and second request (the first unseen, in the engine): the install waited for the engine to go
    idle, the call waited at the gate for its second request, for 600 s. Now every install completes after the
    running call, and no call mixes two versions."""
    from vllm import SamplingParams

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    three = PROMPTS[:3]
    llm = start_engine(a.path, multiprocess=False)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        expect = {tuple(map(tuple, ck.fresh[:3])) for ck in (a, b)}
        add = llm.llm_engine.add_request

        def slow_add(*args: Any, **kwargs: Any) -> Any:  # a prompt that takes a while to render (before hotweights)
            try:
                return add(*args, **kwargs)
            finally:
                time.sleep(0.03)

        llm.llm_engine.add_request = slow_add  # widens the window between a call's requests: the race, every time
        stop, outputs, errors = threading.Event(), [], []

        def loop() -> None:
            try:
                while not stop.is_set():
                    outs = llm.generate([{"prompt_token_ids": list(p)} for p in three], sp, use_tqdm=False)
                    outputs.append(tuple(tuple(o.outputs[0].token_ids) for o in outs))
            except BaseException as exc:
                errors.append(exc)

        generating = threading.Thread(target=loop, daemon=True)
        generating.start()
        while not outputs and not errors:
            time.sleep(0.005)
        reports: list[Any] = []

        def installs() -> None:
            try:
                for version in range(1, 9):
                    ckpt = b if version % 2 else a
                    reports.append(hotweights.install(llm, ckpt.state_dict(), weight_version=version))
            except BaseException as exc:
                errors.append(exc)

        installer = threading.Thread(target=installs, daemon=True)
        installer.start()
        installer.join(timeout=180)
        assert not installer.is_alive(), f"install deadlocked after {len(reports)} of 8"
        stop.set()
        generating.join(timeout=60)
        assert not generating.is_alive() and errors == []
        assert len(reports) == 8 and [r.weight_version for r in reports] == list(range(1, 9))
        assert all(out in expect for out in outputs), "a call mixed two versions"
        assert greedy_vllm(llm) == a.fresh  # version 8 is A
    finally:
        stop_engine(llm)


def test_a_request_added_on_one_thread_and_stepped_on_another_leaves_no_hold(
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
) -> None:
    """Issue 26: the hold taken where a request is added by hand is released by the step that finishes it, whichever
    thread steps; before, the adding thread's hold stayed and every later install waited out its lock_timeout."""
    from vllm import SamplingParams

    a, b = checkpoint(VARIANT, 1), checkpoint(VARIANT, 2)
    llm = start_engine(a.path, multiprocess=False)
    try:
        adapter = VLLMInProcessAdapter(llm, install_method="reload", lock_timeout=20)  # the gate exists from here on
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        adder = threading.Thread(
            target=lambda: llm.llm_engine.add_request("by-hand", {"prompt_token_ids": list(PROMPTS[0])}, sp)
        )
        adder.start()
        adder.join(30)
        done: list[Any] = []

        def step_until_done() -> None:
            while llm.llm_engine.has_unfinished_requests():
                done.extend(o for o in llm.llm_engine.step() if o.finished)

        stepper = threading.Thread(target=step_until_done)
        stepper.start()
        stepper.join(60)
        assert [list(o.outputs[0].token_ids) for o in done] == [a.fresh[0]]
        report = hotweights.install(llm, b.state_dict(), weight_version=1, adapter=adapter)  # no hold left behind
        assert report.phases["wait_generation"] < 5.0
        assert greedy_vllm(llm) == b.fresh
    finally:
        stop_engine(llm)


def test_plain_llm_nan_and_inf_refused_before_the_reload(plain: tuple[Any, TinyCheckpoint, TinyCheckpoint]) -> None:
    llm, a, b = plain
    version = hotweights.adapter_for(llm).active_weight_version or 0
    before, recorded = greedy_vllm(llm), llm.llm_engine.get_weight_version()
    other = b if before != b.fresh else a  # the checkpoint not served: installing it would change the output
    assert before != other.fresh
    sd, named = poisoned(other.state_dict())
    with pytest.raises(NonFiniteWeightsError) as info:
        hotweights.install(llm, sd, weight_version=version + 1)
    assert refused_as(info.value) == named
    assert greedy_vllm(llm) == before and llm.llm_engine.get_weight_version() == recorded
    assert our_shm() == []  # the checkpoint written aside went too
