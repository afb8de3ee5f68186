"""verl 0.9.1's own weight sync (its ``BucketedWeightSender``, shared memory) into a real vLLM engine.

The baseline: verl's own worker extension on this vLLM fails at the first bucket, and its sender then waits forever.
Through ``hotweights.integrations.verl.VerlWorkerExtension`` (the one setting a verl user changes): 3 steps, each
equal to a fresh engine on the sent weights and versioned by the step; a wrong-shaped tensor refused before any
write with the typed error while the sender returns; a sender killed mid-update leaves the previous version serving
and nothing in /dev/shm. Runs in .venv-verl (``make test-verl``); skipped where verl is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
try:
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender  # noqa: F401
except Exception as exc:  # not installed, or installed without the "vllm" alias (make test-verl builds both)
    pytest.skip(f"verl's weight sync cannot be imported here ({exc}): run `make test-verl`", allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
os.environ.setdefault("VERL_RAY_JOB_ID", f"hotweights-test-{os.getpid()}")  # this run's ZMQ socket, its own

import hotweights
from hotweights.core.envelope import decode
from hotweights.integrations.verl import TIMEOUT_ENV
from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

from ..conftest import our_shm
from .verl_helpers import send, use_cpu, zmq_handle

EXTENSION = "hotweights.integrations.verl.VerlWorkerExtension"
VERL_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
DTYPE = "bfloat16"  # verl's actor sends fp32; the rollout serves bf16 (the worker casts, as a fresh load does)
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine

use_cpu()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in build_tiny_model("qwen2", seed=seed).state_dict().items()}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, tuple[Path, list[list[int]]]]]:
    """Seed -> (checkpoint directory, greedy outputs of a fresh engine started on it)."""
    out: dict[int, tuple[Path, list[list[int]]]] = {}
    for seed in range(4):
        path = save_tiny_model(build_tiny_model("qwen2", seed=seed), tmp_path_factory.mktemp(f"qwen2-s{seed}"))
        llm = start_engine(path, DTYPE)
        try:
            out[seed] = (path, greedy_vllm(llm))
        finally:
            stop_engine(llm)
    yield out


@pytest.fixture(scope="module")
def engine(fresh: dict[int, tuple[Path, list[list[int]]]]) -> Iterator[Any]:
    llm = start_engine(fresh[0][0], DTYPE, worker_extension_cls=EXTENSION)
    yield llm
    stop_engine(llm)


def _verl_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("verl_weights_*")}


def _sync(llm: Any, weights: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, BaseException | None, float]:
    """One verl sync as verl's ``ServerAdapter.update_weights`` makes it: the RPC to the workers (verl's kwargs), and
    verl's sender beside it (here a thread: the in-process engine runs the RPC in this one). Returns the RPC's
    result, its error, and the sender's seconds; fails if the sender has not returned 60 s after the RPC."""
    sent: list[float] = []
    failed: list[BaseException] = []

    def sender() -> None:
        start = time.perf_counter()
        try:
            send(zmq_handle(), weights)
        except BaseException as exc:
            failed.append(exc)
        sent.append(time.perf_counter() - start)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    result: Any = None
    error: BaseException | None = None
    try:
        result = llm.collective_rpc(
            "update_weights_from_ipc", kwargs={"peft_config": None, "base_sync_done": True, "use_shm": True, **kwargs}
        )[0]
    except BaseException as exc:
        error = exc
    thread.join(60)
    assert not thread.is_alive(), "verl's sender still waits for an answer"
    assert not failed, f"verl's sender failed: {failed}"
    if error is None:
        llm.reset_prefix_cache()  # verl's ServerAdapter then calls its server's clear_kv_cache, which does this
    return result, error, sent[0]


def _version(llm: Any) -> int | None:
    found: int | None = llm.collective_rpc("hotweights_verl_version")[0]
    return found


def test_verl_own_extension_fails_and_its_sender_hangs(tmp_path: Path, fresh: Any) -> None:
    """The baseline, in a process of its own (its sender never returns): verl's extension on this vLLM fails at the
    first bucket, its clean-up raises BufferError, and the sender still waits for an answer after the RPC."""
    weights = tmp_path / "w.safetensors"
    from safetensors.torch import save_file

    save_file(_weights(1), str(weights))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VERL_RAY_JOB_ID": f"baseline-{os.getpid()}"}
    cmd = [sys.executable, "-m", "tests.integrations.verl_helpers", "baseline", "--model", str(fresh[0][0])]
    run = subprocess.run(
        [*cmd, "--weights", str(weights), "--wait", "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    found = json.loads(lines[-1])
    errors = found["errors"]
    assert errors, "verl's own extension installed the update on this vLLM: the baseline no longer fails"
    assert errors[0].startswith("BufferError"), errors
    assert any("weight_loader" in e or "Attempted to load weight" in e for e in errors), errors
    assert found["sender_waiting"], "verl's sender returned"
    print(f"\nbaseline: {errors}")


def test_three_verl_steps_are_exact_and_versioned(engine: Any, fresh: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert greedy_vllm(engine) == fresh[0][1]
    before = _verl_files()
    timings = []
    for step in (1, 2, 3):
        assert fresh[step][1] != fresh[step - 1][1], f"step {step}: the weights change nothing the test sees"
        # verl's ServerAdapter passes no step to the workers: the worker counts; a caller may pass global_steps
        extra = {"global_steps": step} if step == 3 else {}
        result, error, seconds = _sync(engine, _weights(step), **extra)
        assert error is None, error
        assert result["weight_version"] == step and _version(engine) == step, result
        assert result["tensors"] == 27, result
        assert greedy_vllm(engine) == fresh[step][1], f"step {step}: the engine serves something else"
        timings.append(f"v{step} {seconds * 1e3:.0f} ms ({result['install_method']})")
    assert _verl_files() == before and not our_shm()
    with capsys.disabled():
        print(f"\nverl sender -> hotweights: {', '.join(timings)}")


def test_wrong_shape_is_refused_before_any_write(engine: Any, fresh: Any) -> None:
    served, version = greedy_vllm(engine), _version(engine)
    weights = _weights(4)
    name = "model.layers.1.mlp.down_proj.weight"  # in a late bucket: earlier ones were staged already
    weights[name] = weights[name][:, :-1].contiguous()
    result, error, _ = _sync(engine, weights)
    assert isinstance(error, hotweights.WeightManifestValidationError), result
    assert [(m.kind, m.name) for m in error.mismatches] == [("shape", name)]
    typed = decode(f"Worker failed with error '{error}'")  # the text vLLM's RPC makes of it in another process
    assert isinstance(typed, hotweights.WeightManifestValidationError), "the envelope does not cross as text"
    assert [(m.kind, m.name) for m in typed.mismatches] == [("shape", name)]
    assert greedy_vllm(engine) == served and _version(engine) == version
    # the next sync goes through: nothing was left open
    result, error, _ = _sync(engine, _weights(1))
    assert error is None and greedy_vllm(engine) == fresh[1][1]


def _storage(llm: Any) -> dict[str, int]:
    """Where each parameter's data lives (those vLLM re-packed on CPU hold none)."""
    from hotweights.vllm.introspect import inprocess_model

    return {n: p.data_ptr() for n, p in inprocess_model(llm).named_parameters() if p.numel()}


@pytest.mark.parametrize(
    "names",
    [
        ("model.norm.weight",),  # the last tensor the engine serves: checked after verl's last bucket
        ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"),  # verl's first bucket, two params
    ],
)
def test_nonfinite_tensor_is_refused_before_the_swap(engine: Any, names: tuple[str, ...]) -> None:
    """verl's tensors are copied straight into the parameters' next storage, which the commit swaps in: a NaN
    is still refused by the check of every staged tensor (each of verl's buckets checked in one go, every bad
    tensor of it named), and nothing is swapped."""
    served, version, storage = greedy_vllm(engine), _version(engine), _storage(engine)
    weights = _weights(4)
    for name in names:
        weights[name] = weights[name].clone()
        weights[name].view(-1)[3] = float("nan")
    result, error, _ = _sync(engine, weights)
    assert isinstance(error, hotweights.NonFiniteWeightsError), (result, error)
    assert sorted((m.kind, m.name) for m in error.mismatches) == sorted(("nonfinite", n) for n in names)
    assert greedy_vllm(engine) == served and _version(engine) == version and _storage(engine) == storage


def test_commit_swaps_storage_and_a_failed_commit_puts_it_back(
    engine: Any, fresh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit points each parameter at the storage verl's tensors were copied into (no second copy of the
    update); a commit that fails after the swap puts the previous storage back, the previous weights serving."""
    import hotweights.vllm.worker.setter as setter

    before = _storage(engine)
    seed = next(s for s in (1, 2, 3) if fresh[s][1] != greedy_vllm(engine))
    result, error, _ = _sync(engine, _weights(seed))
    assert error is None and result["parameters_swapped"] > 0, (result, error)
    after = _storage(engine)
    assert greedy_vllm(engine) == fresh[seed][1]
    moved = {n for n in after if after[n] != before.get(n)}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= moved, moved
    served, version = greedy_vllm(engine), _version(engine)

    def fail(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("injected failure of the direct setter")

    monkeypatch.setattr(setter, "apply_direct", fail)
    other = next(s for s in (1, 2, 3) if fresh[s][1] != served)
    result, error, _ = _sync(engine, _weights(other))
    monkeypatch.undo()
    assert error is not None and "injected failure" in str(error), (result, error)
    assert _storage(engine) == after and greedy_vllm(engine) == served and _version(engine) == version


def test_killed_sender_leaves_the_previous_version(
    engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    served, version = greedy_vllm(engine), _version(engine)
    weights = tmp_path / "w.safetensors"
    save_file(_weights(2), str(weights))
    before = _verl_files()
    monkeypatch.setenv(TIMEOUT_ENV, "10")
    cmd = [sys.executable, "-m", "tests.integrations.verl_helpers", "send", "--weights", str(weights)]
    with open(tmp_path / "sender.err", "w") as err:
        sender = subprocess.Popen(
            [*cmd, "--stall-after", "20"], cwd=ROOT, env={**os.environ}, stdout=subprocess.PIPE, stderr=err, text=True
        )
    outcome: list[BaseException | Any] = []

    def rpc() -> None:
        try:
            kwargs = {"peft_config": None, "base_sync_done": True, "use_shm": True}
            outcome.append(engine.collective_rpc("update_weights_from_ipc", kwargs=kwargs))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=rpc, daemon=True)
    try:
        assert sender.stdout is not None
        said = sender.stdout.readline().strip()
        assert said == "ready", (said, (tmp_path / "sender.err").read_text()[-3000:])
        thread.start()
        said = sender.stdout.readline().strip()
        assert said == "stalled", (said, (tmp_path / "sender.err").read_text()[-3000:])
        time.sleep(0.5)
    finally:
        sender.kill()  # mid-update: some buckets staged, the next never comes
        sender.wait(30)
    start = time.perf_counter()
    thread.join(60)
    assert not thread.is_alive(), "the worker still waits for the killed sender"
    assert isinstance(outcome[0], hotweights.HotWeightsTimeoutError), outcome
    assert time.perf_counter() - start < 30
    assert greedy_vllm(engine) == served and _version(engine) == version
    deadline = time.monotonic() + 10
    while _verl_files() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _verl_files() - before and not our_shm()


def test_lora_sync_is_refused_and_answered(engine: Any) -> None:
    served = greedy_vllm(engine)
    result, error, _ = _sync(engine, _weights(3), peft_config={"r": 8}, base_sync_done=True)
    assert isinstance(error, hotweights.EngineNotSupportedError) and "lora.merge=True" in str(error), result
    assert greedy_vllm(engine) == served


def test_multiprocess_engine_exact_and_refusal_typed(fresh: Any) -> None:
    """vLLM's default engine (its worker in a process of its own): a step is exact, and a refused one reaches the
    trainer as the text of vLLM's RPC error, from which the envelope rebuilds the typed error."""
    llm = start_engine(fresh[0][0], DTYPE, multiprocess=True, worker_extension_cls=EXTENSION)
    try:
        result, error, _ = _sync(llm, _weights(1), global_steps=7)
        assert error is None and result["weight_version"] == 7 and _version(llm) == 7, (result, error)
        assert greedy_vllm(llm) == fresh[1][1]
        weights = _weights(2)
        weights["model.norm.weight"] = torch.ones(3)
        _, error, _ = _sync(llm, weights)
        typed = decode(error)
        assert isinstance(typed, hotweights.WeightManifestValidationError), error
        assert [(m.kind, m.name) for m in typed.mismatches] == [("shape", "model.norm.weight")]
        assert greedy_vllm(llm) == fresh[1][1] and _version(llm) == 7
        assert not our_shm()
    finally:
        stop_engine(llm)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def test_verls_own_call_path_into_the_extension(engine: Any, fresh: Any) -> None:
    """verl's own colocated sync, as far up as runs here: its trainer worker's ``ActorRolloutRefWorker.update_weights``
    (mode ``naive``, engine_workers.py:728) calls its ``ServerAdapter.update_weights`` (vllm_rollout.py:210), which
    starts the RPC on the server actor and runs verl's sender. Stand-ins: the trainer worker itself (its actor's
    ``get_per_tensor_param``; the worker is built by Ray with an FSDP engine) and the server's Ray actor (an object
    with its methods, over the in-process engine). A step is exact; a refused one raises the typed error out of
    verl's own ``update_weights``, the previous weights serving."""
    try:
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError as exc:  # its trainer worker imports `datasets` (make test-verl installs it)
        pytest.skip(f"verl's trainer worker cannot be imported here ({exc})")
    from .verl_helpers import for_llm, server_adapter, trainer_worker, verl_worker_env

    verl_worker_env()
    adapter = server_adapter(for_llm(engine))
    served, version = greedy_vllm(engine), _version(engine)
    seed = next(s for s in (1, 2, 3) if fresh[s][1] != served)
    sent: dict[str, torch.Tensor] = {}
    worker = trainer_worker(adapter, lambda **_: (iter(sent.items()), None), base_sync_done=True)
    sent.update(_weights(seed))
    asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=42, mode="naive"))
    assert greedy_vllm(engine) == fresh[seed][1]
    assert _version(engine) == (version or 0) + 1  # verl's ServerAdapter passes no step: the worker counts
    assert adapter.server_handle.global_steps == 42 and adapter.server_handle.calls == ["update_weights_from_ipc"]
    sent.clear()
    sent.update(_weights(0))
    sent["model.norm.weight"] = torch.ones(3)
    with pytest.raises(hotweights.WeightManifestValidationError, match=r"model\.norm\.weight"):
        asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=43, mode="naive"))
    assert greedy_vllm(engine) == fresh[seed][1] and adapter.server_handle.global_steps == 42
