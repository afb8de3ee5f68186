"""Fleet installs: ``hotweights.Fleet`` over N = 1, 2, 3 local replicas against N separate installs, the bytes the
trainer wrote, the cost model's predictions (``hotweights.fleet.estimate``) against the measurements, and, with
``--ray``, a fleet of 2 engines in Ray actors against the local path.

Per model ("150m": ~150M-param fp32 Qwen2, 147 tensors, 612 MB; "many": 291 small tensors, 15 MB) it starts three
multiprocess engines with hotweights' worker extension on checkpoint A (their workers bound to cores 0, 1, 0;
``--bind nobind``: left to the OS), then alternates installs of B and A (one untimed warm-up, then ``--repeats``
timed, medians):

- ``fleet N``: ``Fleet(replicas[:N]).install(...)`` (two phases; one shm copy of each bucket for the N);
- ``separate N``: ``hotweights.install`` into each of the N replicas, one after the other.

After the last install every replica's greedy tokens must equal HF's on that checkpoint (exit 1 otherwise).

Cost model: calibrated on this machine from the one-replica fleet installs only (trainer write, workers' stage,
install; the rest is the trainer's calls into that replica, ``per_replica_s``; ``host_parallelism`` = this machine's
cores), it predicts N = 1, 2, 3; the error printed is (predicted - measured) / measured. "fleet / one install" divides
by one plain ``hotweights.install`` into one engine (the ``separate 1`` median).

Run: ``.venv/bin/python benchmarks/bench_fleet.py [--models 150m,many] [--repeats 5] [--ray] [--size tiny]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hotweights
from hotweights.adapters.installer import Installer
from hotweights.fleet import Calibration, estimate
from hotweights.testing import PROMPTS, build_tiny_model, greedy_hf, greedy_vllm, start_engine, stop_engine

StateDict = dict[str, torch.Tensor]

MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "150m": {
        "full": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
        "tiny": {},
    },
    "many": {"full": {"layers": 24}, "tiny": {"layers": 6}},
}


class StageClock:
    """Seconds the trainer spends inside the workers' ``stage`` calls (the rest of a transfer is its write)."""

    def __init__(self, adapter: Installer) -> None:
        self.seconds = 0.0
        stage = adapter.wire.stage

        def timed(*args: Any) -> None:
            start = time.perf_counter()
            try:
                stage(*args)
            finally:
                self.seconds += time.perf_counter() - start

        adapter.wire.stage = timed  # type: ignore[method-assign]


#: How replicas' workers are bound to cores: ``"spread"`` (replica i on core ``i % cores``) or ``"nobind"`` (left
#: to the OS scheduler). vLLM's default binds every engine's worker to core 0, whatever the number of cores.
BIND = {"mode": "spread"}


def start_replica(path: Path, index: int) -> Any:
    """A multiprocess engine with the extension, its worker bound as :data:`BIND` says."""
    spread = str(index % (os.cpu_count() or 1))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spread if BIND["mode"] == "spread" else "nobind"
    try:
        return start_engine(path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_model(name: str, size: str, repeats: int, tmp: Path) -> tuple[list[dict[str, Any]], bool]:
    config = dict(MODELS[name][size])
    models = [build_tiny_model("qwen2", seed=s, **config) for s in (1, 2)]
    path = tmp / name
    models[0].save_pretrained(path, safe_serialization=True)
    pair: list[StateDict] = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    nbytes = sum(t.nbytes for t in pair[0].values())
    print(f"\n== {name}: {len(pair[0])} tensors, {nbytes / 1e6:.1f} MB fp32", flush=True)
    refs = [greedy_hf(m) for m in models]
    llms = [start_replica(path, i) for i in range(3)]
    rows: list[dict[str, Any]] = []
    version = 0
    try:
        clocks = []
        for llm in llms:
            adapter = hotweights.adapter_for(llm)
            assert isinstance(adapter, Installer)
            clocks.append(StageClock(adapter))

        def step(fn: Any) -> float:
            nonlocal version
            version += 1
            start = time.perf_counter()
            fn(pair[version % 2], version)
            return time.perf_counter() - start

        calibration: dict[str, float] = {}
        for n in (1, 2, 3):
            fleet = hotweights.Fleet(llms[:n])
            reports: list[Any] = []

            def fleet_install(sd: StateDict, v: int, fleet: hotweights.Fleet = fleet, out: list[Any] = reports) -> None:
                out.append(fleet.install(sd, weight_version=v))

            def separate(sd: StateDict, v: int, n: int = n) -> None:
                for llm in llms[:n]:
                    hotweights.install(llm, sd, weight_version=v)

            step(fleet_install)  # warm-up
            fleet_times, separate_times, stage_s, phases = [], [], [], []
            for _ in range(repeats):
                before = clocks[0].seconds
                fleet_times.append(step(fleet_install))
                stage_s.append(clocks[0].seconds - before)
                phases.append(reports[-1].replicas[0].phases)
                separate_times.append(step(separate))
            last = reports[-1]
            row = {
                "model": name,
                "n": n,
                "bytes": nbytes,
                "fleet_s": median(fleet_times),
                "separate_s": median(separate_times),
                "bytes_written": last.bytes_written,
                "stage_s": median(stage_s),
                "transfer_s": median([p.get("transfer", 0.0) for p in phases]),
                "install_s": median([p.get("install", 0.0) for p in phases]),
            }
            rows.append(row)
            print(
                f"[{name}] N={n}: fleet {row['fleet_s']:.3f} s, {n} separate installs {row['separate_s']:.3f} s; "
                f"trainer wrote {row['bytes_written'] / 1e6:.1f} MB for {n} x {nbytes / 1e6:.1f} MB "
                f"(rounds: {', '.join(f'{t:.3f}' for t in fleet_times)})",
                flush=True,
            )
            if n == 1:
                write_s = max(row["transfer_s"] - row["stage_s"], 1e-6)
                calibration = {  # everything but the transfer and the install: the trainer's calls into it
                    "write_gbps": nbytes / write_s / 1e9,
                    "stage_gbps": nbytes / max(row["stage_s"], 1e-6) / 1e9,
                    "install_gbps": nbytes / max(row["install_s"], 1e-6) / 1e9,
                    "per_replica_s": max(row["fleet_s"] - row["transfer_s"] - row["install_s"], 0.0),
                }
        ok = True
        for llm in llms:
            got = greedy_vllm(llm, PROMPTS)
            want = refs[version % 2]
            if got != want:
                print(f"[{name}] MISMATCH: a replica's greedy tokens differ from HF's on the installed checkpoint")
                ok = False
        cores = os.cpu_count() or 1
        cal = Calibration(**calibration, per_bucket_s=0.0, fixed_s=0.0, host_parallelism=cores, machine="this one")
        print(f"[{name}] calibration from the one-replica installs: {cal}", flush=True)
        single = rows[0]["separate_s"]  # one plain hotweights.install into one engine
        for row in rows:
            bucket = hotweights.adapter_for(llms[0]).bucket_size  # type: ignore[attr-defined]
            pred = estimate(
                nbytes, replicas_per_host=row["n"], bucket_bytes=bucket, buckets_in_flight=1, calibration=cal
            )
            row["predicted_s"] = pred.total_s
            row["error"] = (pred.total_s - row["fleet_s"]) / row["fleet_s"]
            row["vs_single"] = row["fleet_s"] / single
        return rows, ok
    finally:
        for llm in llms:
            stop_engine(llm)


def bench_ray(name: str, size: str, repeats: int, tmp: Path, local_s: float) -> dict[str, Any]:
    """A fleet of 2 engines in Ray actors (in-process engines), the trainer in this driver."""
    import ray

    from hotweights.integrations.ray import EngineActor, engine

    class Host(EngineActor):
        def __init__(self, path: str) -> None:
            self.llm = start_engine(path, worker_extension_cls=hotweights.WORKER_EXTENSION)

        def greedy(self) -> list[list[int]]:
            return greedy_vllm(self.llm)

    config = dict(MODELS[name][size])
    models = [build_tiny_model("qwen2", seed=s, **config) for s in (1, 2)]
    path = tmp / f"ray-{name}"
    models[0].save_pretrained(path, safe_serialization=True)
    pair = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    refs = [greedy_hf(m) for m in models]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}})  # fmt: skip
    try:
        actors = [ray.remote(Host).options(num_cpus=0, max_concurrency=2).remote(str(path)) for _ in range(2)]
        ray.get([a.greedy.remote() for a in actors], timeout=600)
        fleet = hotweights.Fleet([engine(a) for a in actors])
        times, version, report = [], 0, None
        for i in range(repeats + 1):
            version += 1
            start = time.perf_counter()
            report = fleet.install(pair[version % 2], weight_version=version)
            if i:
                times.append(time.perf_counter() - start)
        ok = ray.get([a.greedy.remote() for a in actors]) == [refs[version % 2]] * 2
        assert report is not None
        row = {"model": name, "ray_s": median(times), "local_s": local_s, "bytes_written": report.bytes_written,
               "bytes": report.update_bytes, "ok": ok}  # fmt: skip
        print(
            f"[{name}] Ray, 2 actors: fleet {row['ray_s']:.3f} s (local fleet of 2: {local_s:.3f} s, "
            f"{row['ray_s'] / local_s:.2f}x); one object-store copy: {report.bytes_written / 1e6:.1f} MB for "
            f"2 x {report.update_bytes / 1e6:.1f} MB; outputs equal HF: {ok}",
            flush=True,
        )
        return row
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="150m,many")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--ray", action="store_true", help="also time a fleet of 2 engines in Ray actors")
    parser.add_argument("--bind", choices=("spread", "nobind"), default="spread", help="replicas' core binding")
    args = parser.parse_args()
    BIND["mode"] = args.bind
    ok = True
    rows: list[dict[str, Any]] = []
    ray_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_rows, model_ok = bench_model(name, args.size, args.repeats, Path(tmp))
            rows += model_rows
            ok &= model_ok
            if args.ray:
                local_2 = next(r["fleet_s"] for r in model_rows if r["n"] == 2)
                ray_row = bench_ray(name, args.size, args.repeats, Path(tmp), local_2)
                ray_rows.append(ray_row)
                ok &= bool(ray_row["ok"])
    print("\n| model | N | fleet (s) | N separate (s) | fleet / one install | trainer wrote | predicted (s) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['n']} | {r['fleet_s']:.3f} | {r['separate_s']:.3f} | {r['vs_single']:.2f}x | "
            f"{r['bytes_written'] / 1e6:.1f} MB of {r['n'] * r['bytes'] / 1e6:.1f} | {r['predicted_s']:.3f} | "
            f"{r['error']:+.0%} |"
        )
    for r in ray_rows:
        print(f"| {r['model']} | Ray 2 | {r['ray_s']:.3f} | | {r['ray_s'] / r['local_s']:.2f}x the local fleet of 2 | "
              f"{r['bytes_written'] / 1e6:.1f} MB of {2 * r['bytes'] / 1e6:.1f} | | |")  # fmt: skip
    three = [r for r in rows if r["n"] == 3]
    for r in three:
        verdict = "meets" if r["vs_single"] <= 1.5 else "misses"
        print(f"[{r['model']}] fleet of 3 = {r['vs_single']:.2f}x one install: {verdict} the 1.5x target")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
