"""Pipelined sends and installs built aside, on one engine: what ``buckets_in_flight`` and ``install_method="aside"``
change in a full install's time.

One multiprocess ``vllm.LLM`` with hotweights' worker extension serves the 150m model (~150M-param fp32 Qwen2, 147
tensors, 612 MB, shm buckets of 32 MiB). Every configuration installs B, A, B, ... (``--repeats`` timed installs
after one warm-up) through ``VLLMMultiprocessAdapter(llm, commit=..., install_method=..., buckets_in_flight=k)``:

- ``atomic``: the default session (every bucket staged aside, then one install at the commit), k = 1, 2, 3;
- ``streaming``: each bucket installed as it is staged, k = 1, 2, 3;
- ``aside``: each bucket loaded and re-packed into a twin of the model as it is staged, swapped in at the commit,
  k = 1, 2, 3.

It prints the median wall time of ``hotweights.install``, its ratio to ``atomic`` with k = 1 (the send one bucket at
a time, as before pipelining), and the median phases: ``transfer`` (packing and staging; for streaming and aside
also the workers' install work), ``install`` (the commit) and ``report.stall_s`` (generation held). After the last
install the engine's greedy tokens must equal HF's on that checkpoint (exit 1 otherwise).

Run: ``.venv/bin/python benchmarks/bench_pipeline.py`` (~3 min on 2 cores) or ``--size tiny``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hotweights
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.testing import build_tiny_model, greedy_hf, greedy_vllm, start_engine, stop_engine

SIZES: dict[str, dict[str, int]] = {
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}
CONFIGS: list[tuple[str, str, int]] = [
    (commit, method, k)
    for commit, method in (("atomic", "auto"), ("streaming", "auto"), ("atomic", "aside"))
    for k in (1, 2, 3)
]


def label(commit: str, method: str, k: int) -> str:
    return f"{'aside' if method == 'aside' else commit} k={k}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    models = [build_tiny_model("qwen2", seed=s, **SIZES[args.size]) for s in (1, 2)]
    pair = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    refs = [greedy_hf(m) for m in models]
    nbytes = sum(t.nbytes for t in pair[0].values())
    versions = itertools.count(1)
    rows: list[dict[str, Any]] = []
    last = 0
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        path = Path(tmp) / "A"
        models[0].save_pretrained(path, safe_serialization=True)
        llm = start_engine(path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
        try:
            print(
                f"{args.size}: {nbytes / 1e6:.0f} MB fp32, {args.repeats} timed installs per configuration", flush=True
            )
            for commit, method, k in CONFIGS:
                adapter = VLLMMultiprocessAdapter(llm, commit=commit, install_method=method, buckets_in_flight=k)
                walls, phases, stalls = [], [], []
                for i in range(args.repeats + 1):
                    last = (i + 1) % 2
                    start = time.perf_counter()
                    report = hotweights.install(llm, pair[last], weight_version=next(versions), adapter=adapter)
                    if i:  # the first is a warm-up
                        walls.append(time.perf_counter() - start)
                        phases.append(dict(report.phases))
                        stalls.append(report.stall_s or 0.0)
                row = {
                    "config": label(commit, method, k),
                    "wall": statistics.median(walls),
                    "transfer": statistics.median(p.get("transfer", 0.0) for p in phases),
                    "install": statistics.median(p.get("install", 0.0) for p in phases),
                    "stall": statistics.median(stalls),
                    "method": report.install_method,
                }
                rows.append(row)
                print(
                    f"{row['config']:>14}: {row['wall']:.3f} s (transfer {row['transfer']:.3f}, install "
                    f"{row['install']:.3f}, stall {row['stall']:.3f}; {row['method']})",
                    flush=True,
                )
            served = greedy_vllm(llm)
        finally:
            stop_engine(llm)
    base = rows[0]["wall"]
    print("\n| configuration | install s | vs atomic k=1 | transfer s | commit s | stall s | method |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['wall']:.3f} | {r['wall'] / base:.2f}x | {r['transfer']:.3f} | {r['install']:.3f} | "
            f"{r['stall']:.3f} | {r['method']} |"
        )
    if served != refs[last]:
        print(f"FAIL: after the last install the engine serves {served}, HF on that checkpoint gives {refs[last]}")
        return 1
    print("engine equals HF on the last checkpoint installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
