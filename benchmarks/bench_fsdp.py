"""FSDP2, 2 ranks: a sharded install (each DTensor gathered when it is sent) against gather-then-send.

Two gloo processes hold the 150m model (Qwen2, fp32, 612 MB; ``--size moe``: a Qwen3-MoE whose fused experts are
larger than a bucket) with ``fully_shard`` on CPU; rank 0 also runs a
multiprocess ``vllm.LLM`` with hotweights' worker extension. Measured, per rank, medians over ``--repeats``:

- ``sharded``: ``hotweights.install(llm or None, model.state_dict(), ...)`` on both ranks, the ranks writing their own
  rows (rank writes, the default on one host); the install time, and the peak resident memory above the level
  before the call (sampled every 2 ms);
- ``sharded-gather``: the same with ``HOTWEIGHTS_RANK_WRITES=0``: the leader gathers every tensor (in parts where
  larger than a bucket);
- ``gather-then-send``: every rank gathers the full state dict (``full_tensor()``), then rank 0 installs it: the
  gather time, the install time, and the same peak (the full copy counts: it is what that way costs).

With ``--layout tp`` the ranks hold Megatron-style tensor-parallel chunks of the same model instead (plain tensors,
``layout=WeightLayout(tp_rank=r, tp_size=2)``): ``sharded`` is then each rank writing its own chunks, ``sharded-gather``
the leader gathering them, and ``gather-then-send`` rank 0 installing the whole tensors it read from disk (its gather
time is 0). With ``--engine-dtype bfloat16`` the engine serves bf16 and every install casts the trainer's fp32
tensors (``cast="engine"``; with rank writes each rank casts what it writes).

``python benchmarks/bench_fsdp.py`` (``--size tiny`` for a smoke run). Prints one JSON line per rank and a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SIZES = {
    "tiny": {},
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    # a Qwen3-MoE whose fused experts (gate_up 64 MiB, down 32 MiB per layer) are larger than a 32 MiB bucket
    "moe": {
        "arch": "qwen3_moe",
        "hidden": 512,
        "layers": 4,
        "heads": 8,
        "kv_heads": 4,
        "intermediate": 1024,
        "vocab": 32000,
        "experts": 16,
        "moe_intermediate": 1024,
    },
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_extra(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()``, its seconds, and the most resident bytes above the level before it (sampled every 2 ms)."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        out = fn()
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        watcher.join()
    return out, elapsed, max(0, max(peak[0], _rss()) - base)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import hotweights
    from hotweights.testing import start_engine

    rank = args.rank
    llm = None
    if rank == 0:
        llm = start_engine(
            args.model, args.engine_dtype, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION
        )
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    options: dict[str, Any] = {}
    if args.engine_dtype != "float32":  # the trainer's fp32 tensors cast to the engine's dtype on the way
        options["cast"] = "engine"
    if args.layout == "tp":
        from safetensors.torch import load_file

        from hotweights.testing import tp_chunk

        whole = load_file(str(Path(args.model) / "model.safetensors"))
        chunks = {k: tp_chunk(k, v, rank, 2) for k, v in whole.items()}
        options["layout"] = hotweights.WeightLayout(tp_rank=rank, tp_size=2)

        def state() -> dict[str, Any]:
            return chunks

        def full_state() -> dict[str, torch.Tensor]:
            return whole
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def state() -> dict[str, Any]:
            return model.state_dict()

        def full_state() -> dict[str, torch.Tensor]:
            return {k: t.full_tensor() for k, t in model.state_dict().items()}

    version = 0
    rows: dict[str, list[float]] = {
        "sharded_s": [],
        "sharded_peak": [],
        "gathered_s": [],
        "gathered_peak": [],
        "gather_s": [],
        "full_s": [],
        "full_peak": [],
    }
    report = None
    phases: dict[str, dict[str, float]] = {}
    # Each way in a block of its own, after one warm-up install, as a training loop runs it every step: the bucket
    # plan repeats, so the transport rewrites the files of the install before (a way's plan differs from another's).
    for mode, writes in (("sharded", "1"), ("gathered", "0")):
        os.environ["HOTWEIGHTS_RANK_WRITES"] = writes
        for repeat in range(args.repeats + 1):
            version += 1
            dist.barrier()
            report, seconds, peak = _peak_extra(
                lambda v=version: hotweights.install(llm, state(), weight_version=v, **options)
            )
            if repeat:
                rows[f"{mode}_s"].append(seconds)
                rows[f"{mode}_peak"].append(peak)
        phases[mode] = {k: round(v, 3) for k, v in report.phases.items()}  # the last run's, for the record

    for repeat in range(args.repeats + 1):
        version += 1
        dist.barrier()

        def gather_then_send(v: int = version) -> float:
            start = time.perf_counter()
            full = full_state()
            gathered = time.perf_counter() - start
            if llm is not None:
                hotweights.install(llm, full, weight_version=v, cast=options.get("cast"))
            return gathered

        gathered, seconds, peak = _peak_extra(gather_then_send)
        if repeat:
            rows["gather_s"].append(gathered)
            rows["full_s"].append(seconds - gathered)
            rows["full_peak"].append(peak)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rows.items()}
    out["rank"] = rank
    out["phases"] = phases
    if llm is not None and report is not None:
        out["model_bytes"] = report.num_bytes
        out["adapter"] = report.adapter
        out["bucket_bytes"] = hotweights.adapter_for(llm).bucket_size
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    parser.add_argument("--layout", choices=("fsdp", "tp"), default="fsdp")
    parser.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)

    from hotweights.testing import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        size = dict(SIZES[args.size])
        arch = size.pop("arch", "qwen2")
        build_tiny_model(arch, seed=1, **size).save_pretrained(model_dir, safe_serialization=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        procs = []
        for r in range(2):
            command = [sys.executable, __file__, "--rank", str(r), "--port", str(port), "--model", str(model_dir)]
            command += ["--repeats", str(args.repeats), "--layout", args.layout, "--engine-dtype", args.engine_dtype]
            procs.append(
                subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            )
        results = []
        for proc in procs:
            text, _ = proc.communicate(timeout=1800)
            results += [json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")]
    mb = 1 / 2**20
    for r in sorted(results, key=lambda r: r["rank"]):
        print(json.dumps(r))
    lead = next(r for r in results if r["rank"] == 0)
    print(f"\nmodel {lead['model_bytes'] * mb:.0f} MiB, bucket {lead['bucket_bytes'] * mb:.0f} MiB ({lead['adapter']})")
    print(
        "rank | rank writes s | peak MiB | leader gathers s | peak MiB | gather s | install of full s "
        "| gather-then-send peak MiB"
    )
    for r in sorted(results, key=lambda r: r["rank"]):
        print(
            f"{r['rank']:>4} | {r['sharded_s']:>12.3f} | {r['sharded_peak'] * mb:>8.0f} | {r['gathered_s']:>16.3f} | "
            f"{r['gathered_peak'] * mb:>8.0f} | {r['gather_s']:>8.3f} | {r['full_s']:>17.3f} | "
            f"{r['full_peak'] * mb:>25.0f}"
        )
    then = lead["gather_s"] + lead["full_s"]
    for mode in ("sharded", "gathered"):
        print(f"{mode}: / gather-then-send {lead[f'{mode}_s'] / then:.2f}x, / install of full tensors "
              f"{lead[f'{mode}_s'] / lead['full_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
