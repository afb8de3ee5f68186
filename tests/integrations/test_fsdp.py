"""FSDP2 trainers install their ``DTensor`` state dicts from every rank (``hotweights.core.sharded``), for real.

Two gloo processes train a tiny model with ``fully_shard`` on CPU (``fsdp_rank.py``). After every step both call
``hotweights.install``: rank 0 with a multiprocess engine, rank 1 with ``engine=None``. The engine must then equal HF
on the gathered model, both ranks must return the same report, each tensor is gathered once and never the whole
model at a time; at the end a freshly started engine on the last weights gives the same output, a version the ranks
disagree on is refused alike on both with nothing written, and a rank that dies inside a gather fails the leader's
install before anything is written. In the same run the two ranks install Megatron-style tensor-parallel chunks
(plain tensors, ``layout=WeightLayout(tp_rank, tp_size=2)``) of two more models.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(
    arch: str, tmp_path: Path, engine_tp: int = 1, die_in: str = "write", unproven: bool = False
) -> list[dict[str, Any]]:
    model_dir = save_tiny_model(build_tiny_model(arch, seed=3), tmp_path / "initial")
    tp_models = [str(save_tiny_model(build_tiny_model(arch, seed=s), tmp_path / f"tp{s}")) for s in (11, 12)]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if unproven:  # as on a vLLM where no family is proven: the leader probes the first install
        env["HOTWEIGHTS_TEST_UNPROVEN"] = "1"
    ranks, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    for r in range(2):
        command = [sys.executable, "-m", "tests.integrations.fsdp_rank", "--rank", str(r), "--port", str(port)]
        command += ["--model", str(model_dir), "--out", str(tmp_path), "--tp-models", ",".join(tp_models)]
        command += ["--engine-tp", str(engine_tp), "--die-in", die_in]
        with logs[r].open("w") as log:  # files, not pipes: a rank must never block on a full pipe
            ranks.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=600) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    for r, (code, wanted) in enumerate(zip(codes, (0, 3), strict=True)):  # rank 1 dies on purpose, last
        assert code == wanted, f"rank {r} exited {code}:\n{logs[r].read_text()[-6000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


# Qwen3-MoE into a TP=1 engine in the default run: its fused experts reach the engine as views of each gathered
# tensor, which covers the dense path too; Qwen2, and Qwen2 into a TP=2 engine, run under -m slow.
@pytest.mark.parametrize(
    ("arch", "engine_tp"),
    [
        pytest.param("qwen2", 1, marks=pytest.mark.slow),
        pytest.param("qwen2", 2, marks=pytest.mark.slow),
        ("qwen3_moe", 1),
    ],
    ids=["qwen2", "qwen2-engine-tp2", "qwen3_moe"],
)
def test_fsdp2_ranks_install_their_shards(arch: str, engine_tp: int, tmp_path: Path) -> None:
    try:
        # rank 1 dies in its own write (the default mode on one host); under -m slow, inside a gather instead
        lead, other = _train(arch, tmp_path, engine_tp, die_in="write" if arch == "qwen3_moe" else "gather")
    finally:
        for leftover in Path("/dev/shm").glob("vllm_dist_*cpushm*"):  # vLLM's own TP channel, left after shutdown
            leftover.unlink(missing_ok=True)
    assert lead["engine_tp"] == engine_tp
    assert lead["initial"] != lead["steps"][0]["vllm"], "the first step did not change the greedy output"
    for step, (mine, theirs) in enumerate(zip(lead["steps"], other["steps"], strict=True), start=1):
        assert mine["vllm"] == mine["hf"], f"step {step}: the engine does not serve the trainer's weights"
        assert mine["report"] == theirs["report"], f"step {step}: the ranks returned different reports"
        assert mine["report"]["weight_version"] == step
        if step == 1:  # rank writes: the other rank wrote its rows and its own experts (views of its shard of the
            # fused tensors) into the leader's buckets; nobody gathered anything
            assert theirs["written"] >= 1 and mine["split"] == 0, (theirs["written"], mine["split"])
            assert mine["gathers"] == theirs["gathers"] == 0, (mine["gathers"], theirs["gathers"])
        else:  # gathered: each DTensor once, whole or (over a bucket, a dim-0 shard) in parts, never all at once;
            # parts alive at once (the one read and the next) at most two buckets
            assert theirs["written"] == 0
            assert mine["split"] >= 1 and mine["parts"] > mine["split"], "no tensor larger than a bucket went in parts"
            assert mine["parts_peak"] <= 2 * mine["bucket_bytes"], (step, mine["parts_peak"])
            # and everything gathered alive at once too: the fused experts (4 buckets each) are read from parts
            assert mine["peak"] <= 2 * mine["bucket_bytes"], (step, mine["peak"])
            for rank in (mine, theirs):
                assert rank["gathers"] + mine["split"] == rank["dtensors"], (step, rank["gathers"], rank["dtensors"])
        for rank in (mine, theirs):
            assert rank["peak"] < mine["model_bytes"] / 2, (step, rank["peak"], mine["model_bytes"])
        assert theirs["peak"] == 0, "the other rank held a gathered tensor: its shards go to the leader alone"
    # The refusal: same error on both ranks, the engine still serves the last step.
    assert lead["refusal"] and lead["refusal"] == other["refusal"], (lead["refusal"], other["refusal"])
    assert lead["refusal"].startswith("WeightManifestValidationError")
    assert lead["version_after_refusal"] == str(len(lead["steps"]))
    assert lead["after_refusal"] == lead["steps"][-1]["vllm"]
    # One more step, installed from bfloat16 shards into the float32 engine (cast="engine") with rank writes: every
    # rank casts what it writes, nobody gathers; the engine equals HF on the same weights.
    cast, cast_other = lead["cast"], other["cast"]
    assert cast["hf"] != lead["after_refusal"], "the step did not change the greedy output"
    assert cast["vllm"] == cast["hf"], "the engine does not serve the cast weights"
    assert cast["report"] == cast_other["report"] and cast["report"]["weight_version"] == 10
    assert cast_other["written"] >= 1 and cast["gathers"] == cast_other["gathers"] == 0, (cast, cast_other)
    # Tensor-parallel chunks (plain tensors, the last chunk padded) of two more models: the engine equals HF on each
    # whole model; a rank claiming another's place is refused alike on both, nothing written.
    assert lead["steps"][-1]["vllm"] != lead["tp"][0]["vllm"] != lead["tp"][1]["vllm"], "the models are alike"
    for version, (mine, theirs) in enumerate(zip(lead["tp"], other["tp"], strict=True), start=11):
        assert mine["vllm"] == mine["hf"], f"v{version}: the engine does not serve the whole model"
        assert mine["report"] == theirs["report"] and mine["report"]["weight_version"] == version
    # v11 with rank writes: the other rank wrote the rows of its dim-0 chunks and the columns of its dim-1 ones
    # (o_proj, down_proj), nobody gathered anything; v12 with the leader gathering every chunk
    (writes, writes_other), (gathered, gathered_other) = zip(lead["tp"], other["tp"], strict=True)
    assert writes_other["written"] >= 1 and gathered_other["written"] == 0, (writes_other, gathered_other)
    assert writes["gathers"] == writes_other["gathers"] == 0 < gathered["gathers"], (writes, gathered)
    assert lead["tp_refusal"] and lead["tp_refusal"] == other["tp_refusal"], lead["tp_refusal"]
    assert lead["tp_refusal"].startswith("ValueError") and lead["version_after_tp_refusal"] == "12"
    # Rank 1 died (writing its own rows; under -m slow, inside a gather): rank 0's install failed typed before
    # writing; the engine serves the last step.
    assert lead["rank_died"].startswith("InstallError"), lead["rank_died"]
    assert lead["death_s"] < 30, lead["death_s"]  # the leader learns it at once (measured: 0.08 s), never hangs
    assert "before the model was touched" in lead["rank_died"], lead["rank_died"]
    assert lead["version_after_death"] == "12"
    assert lead["after_death"] == lead["tp"][-1]["vllm"]
    # A freshly started engine on the last FSDP2 weights serves what the installed engine served then.
    fresh = start_engine(tmp_path / "final", "float32")
    try:
        assert greedy_vllm(fresh) == lead["steps"][-1]["vllm"]
    finally:
        stop_engine(fresh)


@pytest.mark.slow
def test_an_unproven_family_is_probed_without_gathering_the_model(tmp_path: Path) -> None:
    """No family proven (vLLM 0.31, 0.33, 0.34, GPUs): the leader's first install is probed, and its reference reads
    each module's tensors (gathered from the ranks) while that module runs, never the whole model at once."""
    lead, _ = _train("qwen2", tmp_path, unproven=True)
    first = lead["steps"][0]
    assert "probed at v1" in (first["report"]["family_check"] or ""), first["report"]
    assert first["vllm"] == first["hf"]
    assert 0 < first["peak"] < first["model_bytes"] / 2, (first["peak"], first["model_bytes"])
