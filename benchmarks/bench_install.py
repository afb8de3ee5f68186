"""Install speed: hotweights' in-process adapter vs. vLLM's bare ``reload_weights`` vs. a plain ``torch.copy_``.

Builds two ~150M-parameter Qwen2 models (seeds 1 and 2), starts one in-process engine per dtype on model A, then
alternately installs B and A and reports the median seconds and GB/s of each method, the median phase breakdown
of hotweights' installs, and (fp32) whether greedy outputs after installing B equal HF transformers' on B.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench_install.py [--dtypes float32] [--repeats 3]
[--size tiny]``). ``--size tiny`` is a quick smoke run (under a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the adapter hands tensors over by reference: engine in-process

import torch

from hotweights import InstallReport, VLLMInProcessWeightReloadAdapter, WeightUpdateManifest
from hotweights.testing import (
    PROMPTS,
    build_tiny_model,
    greedy_hf,
    greedy_vllm,
    save_tiny_model,
    start_engine,
    stop_engine,
)

StateDict = dict[str, torch.Tensor]
Row = tuple[str, str, int, float]  # method, dtype, bytes, median seconds

#: Config overrides for ``build_tiny_model`` (head_dim 64 for "150m": 768 / 12).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # the testing defaults: hidden 128, 2 layers, vocab 1000
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
}


def median_seconds(step: Callable[[StateDict], float], pair: tuple[StateDict, StateDict], repeats: int) -> float:
    """One untimed warm-up ``step(B)``, then ``repeats`` timed steps alternating A, B, A, ...; the median."""
    step(pair[1])
    return statistics.median(step(pair[i % 2]) for i in range(repeats))


def bench_dtype(path: Path, dtype_name: str, models: tuple[Any, Any], repeats: int) -> tuple[list[Row], bool | None]:
    """Rows for one dtype, and the greedy check's result (None: not checked)."""
    dtype = getattr(torch, dtype_name)
    pair = tuple({k: v.to(dtype) for k, v in m.state_dict().items()} for m in models)
    assert len(pair) == 2
    nbytes = sum(t.nbytes for t in pair[0].values())
    llm = start_engine(path, dtype=dtype_name)
    try:
        adapter = VLLMInProcessWeightReloadAdapter(llm)
        reports: list[InstallReport] = []

        def hotweights_step(sd: StateDict) -> float:
            manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=len(reports) + 1)
            t0 = time.perf_counter()
            reports.append(adapter.install(manifest, sd))
            return time.perf_counter() - t0

        def vllm_step(sd: StateDict) -> float:
            t0 = time.perf_counter()
            kwargs = {"weights_iterator": list(sd.items()), "is_checkpoint_format": True}
            llm.collective_rpc("reload_weights", kwargs=kwargs)
            return time.perf_counter() - t0

        dst = {k: torch.empty_like(v) for k, v in pair[0].items()}

        def copy_step(sd: StateDict) -> float:
            t0 = time.perf_counter()
            for k, v in sd.items():
                dst[k].copy_(v)
            return time.perf_counter() - t0

        hw_s = median_seconds(hotweights_step, pair, repeats)
        assert reports[-1].num_bytes == nbytes, (reports[-1].num_bytes, nbytes)
        phases = {p: statistics.median(r.phases[p] for r in reports[1:]) for p in reports[-1].phases}
        print(
            f"[{dtype_name}] hotweights median phases: " + ", ".join(f"{p} {s * 1e3:.1f} ms" for p, s in phases.items())
        )
        rows = [
            ("hotweights in-process", dtype_name, nbytes, hw_s),
            ("vLLM reload_weights(list)", dtype_name, nbytes, median_seconds(vllm_step, pair, repeats)),
            ("torch.copy_", dtype_name, nbytes, median_seconds(copy_step, pair, repeats)),
        ]
        ok = None
        if dtype == torch.float32:  # bf16 vLLM and HF diverge after a few tokens: only fp32 is compared with HF
            adapter.install(WeightUpdateManifest.from_state_dict(pair[1], weight_version=len(reports) + 1), pair[1])
            got, want = greedy_vllm(llm, PROMPTS[:2], max_tokens=4), greedy_hf(models[1], PROMPTS[:2], max_tokens=4)
            ok = got == want
            print(f"[{dtype_name}] greedy after installing B == HF on B: {ok} (vLLM {got}, HF {want})")
        return rows, ok
    finally:
        stop_engine(llm)


def table(rows: list[Row]) -> str:
    """Markdown table; the ratio is the method's speed over hotweights' speed (same dtype)."""
    hw = {dtype: s for method, dtype, _, s in rows if method.startswith("hotweights")}
    lines = ["| method | dtype | MB | median s | GB/s | ratio vs hotweights |", "|---|---|---:|---:|---:|---:|"]
    for method, dtype, nbytes, s in rows:
        lines.append(
            f"| {method} | {dtype} | {nbytes / 1e6:.1f} | {s:.4f} | {nbytes / 1e9 / s:.2f} | {hw[dtype] / s:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated engine dtypes")
    parser.add_argument("--repeats", type=int, default=3, help="timed installs per method (median reported)")
    parser.add_argument("--size", choices=sorted(SIZES), default="150m", help="model size ('tiny': smoke run)")
    args = parser.parse_args()
    t0 = time.perf_counter()

    import vllm

    models = (
        build_tiny_model("qwen2", seed=1, **SIZES[args.size]),
        build_tiny_model("qwen2", seed=2, **SIZES[args.size]),
    )
    params = sum(p.numel() for p in models[0].parameters())
    print(
        f"model: qwen2 {args.size}, {params / 1e6:.1f}M params, {len(models[0].state_dict())} tensors; "
        f"vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    )
    rows: list[Row] = []
    checks: list[bool | None] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(models[0], Path(tmp) / "a")  # the engine starts on A; B is only sent, never loaded
        for dtype_name in args.dtypes.split(","):
            new_rows, ok = bench_dtype(path, dtype_name, models, args.repeats)
            rows += new_rows
            checks.append(ok)
    print("\n" + table(rows) + "\n")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if False in checks:
        sys.exit("greedy outputs after the install differ from HF's: the install is wrong")


if __name__ == "__main__":
    main()
