"""Delta installs vs. full installs: bytes sent and seconds, at 1 %, 5 % and 20 % of the elements changed.

Builds one ~150M-parameter Qwen2 (``--size tiny``: the testing defaults, a smoke run under two minutes) in
``--dtype`` (default bf16, what RL trainers hand over) and, per engine kind (an in-process engine, then a
multiprocess one with hotweights' worker extension and the shm transport), times:

- ``full``: plain full installs (``delta=False``, through an adapter that keeps no host copy);
- ``delta X%``: ``install(..., delta=True)`` of the previous version with Gaussian noise added at a random X % of
  every tensor's positions (what one optimizer step looks like), after one full ``delta=True`` install that primes
  the host copies.

Each row is the median of ``--repeats`` installs (each one a new version). After the last delta of each engine the
greedy tokens are compared with a fresh full install of the same weights through another adapter (exit 1 on a
mismatch).

Run: ``flock /tmp/hotweights-engine.lock .venv/bin/python benchmarks/bench_delta.py [--size tiny] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

import hotweights
from hotweights import InstallReport, WeightUpdateManifest
from hotweights.adapters import VLLMInProcessAdapter, VLLMMultiprocessAdapter
from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

StateDict = dict[str, torch.Tensor]
EXTENSION = hotweights.WORKER_EXTENSION

SIZES: dict[str, dict[str, Any]] = {
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}


def nudged(sd: StateDict, fraction: float, seed: int) -> StateDict:
    """``sd`` with noise at a random ``fraction`` of each tensor's positions."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        noise = torch.randn(t.shape, generator=g) * 0.01
        out[name] = torch.where(mask, t + noise.to(t.dtype), t)
    return out


def install(adapter: Any, sd: StateDict, version: int, delta: bool) -> InstallReport:
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=version)
    report: InstallReport = adapter.install(manifest, sd, delta=delta)
    return report


def bench_engine(
    kind: str, make: Callable[[], Any], adapter_of: Callable[[Any], Any], a: StateDict, args: argparse.Namespace
) -> tuple[list[tuple[str, str, float, int, int, float]], bool]:
    """Rows (engine, update, changed %, bytes sent, full bytes, median seconds) and whether outputs matched."""
    llm = make()
    rows = []
    version = iter(range(1, 10_000))
    try:
        plain = adapter_of(llm)
        sd = a
        times, report = [], None
        for r in range(args.repeats + 1):  # one warm-up
            sd = nudged(sd, 0.01, seed=100 + r)
            report = install(plain, sd, next(version), delta=False)
            times.append(report.seconds)
        assert report is not None
        full_bytes = report.num_bytes
        rows.append((kind, "full", 100.0, report.bytes_sent, full_bytes, statistics.median(times[1:])))
        tracked = adapter_of(llm)
        tracked.active_weight_version = plain.active_weight_version
        primed = install(tracked, sd, next(version), delta=True)
        assert primed.delta == "full"
        seed = 1000
        for fraction in args.fractions:
            times, sent = [], []
            for _ in range(args.repeats):
                seed += 1
                sd = nudged(sd, fraction, seed)
                report = install(tracked, sd, next(version), delta=True)
                assert report.delta == "applied", report
                times.append(report.seconds)
                sent.append(report.bytes_sent)
            rows.append(
                (kind, f"delta {fraction:.0%}", fraction * 100, int(statistics.median(sent)), full_bytes,
                 statistics.median(times))
            )  # fmt: skip
            print(f"  {kind} delta {fraction:.0%}: {report}", flush=True)
        outputs = greedy_vllm(llm)
        check = adapter_of(llm)
        check.active_weight_version = tracked.active_weight_version
        install(check, sd, next(version), delta=False)
        same = greedy_vllm(llm) == outputs
    finally:
        stop_engine(llm)
    return rows, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.01, 0.05, 0.2])
    parser.add_argument("--engines", default="inprocess,multiprocess")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = build_tiny_model("qwen2", 1, dtype=dtype, **SIZES[args.size])
    a = {n: t.detach().clone() for n, t in model.state_dict().items()}
    params = sum(t.numel() for t in a.values())
    print(f"model: qwen2 {args.size}, {params / 1e6:.1f}M params, {len(a)} tensors, {args.dtype}", flush=True)
    all_rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(model, Path(tmp) / "a")
        del model
        common = {"dtype": args.dtype}
        if "inprocess" in args.engines:
            rows, same = bench_engine(
                "in-process",
                lambda: start_engine(path, multiprocess=False, **common),
                partial(VLLMInProcessAdapter, install_method="reload"),
                a,
                args,
            )
            all_rows += rows
            ok &= same
        if "multiprocess" in args.engines:
            rows, same = bench_engine(
                "multiprocess (shm)",
                lambda: start_engine(
                    path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION, **common
                ),
                lambda llm: VLLMMultiprocessAdapter(llm, transport="shm"),
                a,
                args,
            )
            all_rows += rows
            ok &= same
    print(f"\n| engine | update | bytes sent | % of full | seconds (median of {args.repeats}) | vs full |")
    print("|---|---|---|---|---|---|")
    full_s = {kind: s for kind, what, _, _, _, s in all_rows if what == "full"}
    for kind, what, _, sent, full_bytes, s in all_rows:
        print(
            f"| {kind} | {what} | {sent / 1e6:.1f} MB | {sent / full_bytes:.1%} | {s:.3f} | {full_s[kind] / s:.2f}x |"
        )
    print(f"\noutputs after the deltas equal a full install of the same weights: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
