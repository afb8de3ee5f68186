"""Install speed into a remote ``vllm serve`` process, through ``hotweights.connect``.

Starts one server (``python -m hotweights.serve``: dev routes, hotweights' worker extension, loopback) on model A,
connects, and installs B, A, B, ... ``--repeats`` times through ``hotweights.install`` (shm transport, the default
for a server on this host), then the same through a ``VLLMMultiprocessAdapter`` with the collective transport (what
a trainer on another host uses; forced here on loopback). Reports median seconds, GB/s and the median phases per
path, and (fp32) whether greedy completions after the last install equal HF transformers'; exits non-zero
otherwise. The server is killed (process group) at the end. Then, in the same run, the same model is served by a
multiprocess ``vllm.LLM`` with the worker extension in this process and installed the same way: the remote/local
ratio, the HTTP overhead per bucket (remote minus local transfer phase, per bucket) and the round trip of an empty
worker call (``hotweights_engine("status")``) over HTTP and locally.

Run: ``flock /tmp/hotweights-engine.lock .venv/bin/python benchmarks/bench_remote.py [--size tiny|150m]
[--repeats 5]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

import hotweights
import hotweights.adapters
import hotweights.core.buckets
import hotweights.handles
from hotweights.serve import server_command, server_env
from hotweights.testing import PROMPTS, build_tiny_model, greedy_hf, save_tiny_model

SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # hidden 128, 2 layers, vocab 1000: 2.2 MB
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
}
CPU_FLAGS = [
    "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
    "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4", "--seed", "0",
]  # fmt: skip


@contextlib.contextmanager
def running_server(model: Path, log: Path, token: str | None = None) -> Iterator[str]:
    """A server on ``model`` (its url while it runs); with ``token``, behind hotweights' guard (which also scores the
    family probe), as ``python -m hotweights.serve`` starts it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = server_command(str(model), port=port, extra=CPU_FLAGS, guard=token is not None)
    env = server_env(token) if token is not None else {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
                if httpx.get(f"{url}/v1/models", headers=auth, timeout=2.0, trust_env=False).is_success:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def completions(url: str, model: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0, trust_env=False).json()
        out.append(answer["choices"][0]["token_ids"])
    return out


def summarize(name: str, reports: list[Any]) -> None:
    seconds = statistics.median(r.seconds for r in reports)
    gbps = reports[0].num_bytes / seconds / 1e9
    phases = {k: statistics.median(r.phases.get(k, 0.0) for r in reports) for k in reports[0].phases}
    detail = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items())
    print(f"{name}: median {seconds:.3f} s ({gbps:.2f} GB/s) over {len(reports)} installs: {detail}")


def ping_ms(call: Any, n: int = 20) -> float:
    """Median milliseconds of an empty worker call (``hotweights_engine("status")``) through ``call``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call("hotweights_engine", "status", "{}", timeout=30.0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def local_engine(path: Path, states: dict[int, dict[str, torch.Tensor]], repeats: int) -> tuple[list[Any], float]:
    """Installs into a multiprocess ``vllm.LLM`` with the worker extension, in this process (the same way)."""
    from hotweights.testing import start_engine, stop_engine

    llm = start_engine(path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    try:
        reports = []
        for i in range(repeats + 1):
            report = hotweights.install(llm, states[2 if i % 2 == 0 else 1], weight_version=i + 1)
            if i:
                reports.append(report)
        return reports, ping_ms(hotweights.handles.as_engine(llm).workers.call)
    finally:
        stop_engine(llm)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    models = {s: build_tiny_model("qwen2", s, **SIZES[args.size]) for s in (1, 2)}
    states = {s: dict(m.state_dict()) for s, m in models.items()}
    nbytes = sum(t.nbytes for t in states[1].values())
    print(f"model: {args.size}, {len(states[1])} tensors, {nbytes / 1e6:.1f} MB fp32")
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(models[1], Path(tmp) / "A")
        with running_server(path, Path(tmp) / "server.log") as url:
            t0 = time.perf_counter()
            engine = hotweights.connect(url, timeout=60.0)
            print(f"connect: {time.perf_counter() - t0:.3f} s ({engine.describe()})")
            version, shm_reports = 0, []
            for i in range(args.repeats + 1):
                version += 1
                report = hotweights.install(engine, states[2 if i % 2 == 0 else 1], weight_version=version)
                if i:  # the first install warms up
                    shm_reports.append(report)
            summarize("install (shm, default)", shm_reports)
            remote_ping = ping_ms(engine.call)
            buckets = len(hotweights.core.buckets.plan_buckets(
                hotweights.WeightUpdateManifest.from_state_dict(states[1], weight_version=1),
                hotweights.adapter_for(engine).bucket_size,  # type: ignore[attr-defined]
            ))  # fmt: skip
            collective_reports = []
            with hotweights.adapters.VLLMMultiprocessAdapter(engine, transport="collective") as adapter:
                for i in range(args.repeats + 1):
                    version += 1
                    state = states[2 if i % 2 == 0 else 1]
                    manifest = hotweights.WeightUpdateManifest.from_state_dict(state, weight_version=version)
                    report = adapter.install(manifest, state)
                    if i:
                        collective_reports.append(report)
            summarize("VLLMMultiprocessAdapter (collective, gloo)", collective_reports)
            last = 2 if args.repeats % 2 == 0 else 1
            ok = completions(url, str(path)) == greedy_hf(models[last])
            print(f"greedy completions after the last install equal HF: {ok}")
            engine.close()
        local_reports, local_ping = local_engine(path, states, args.repeats)
    summarize("local multiprocess LLM, extension (shm, default)", local_reports)
    remote_s = statistics.median(r.seconds for r in shm_reports)
    local_s = statistics.median(r.seconds for r in local_reports)
    transfer = {
        name: statistics.median(r.phases.get("transfer", 0.0) for r in reports)
        for name, reports in (("remote", shm_reports), ("local", local_reports))
    }
    print(
        f"remote / local install time: {remote_s / local_s:.2f}x ({remote_s:.3f} s vs {local_s:.3f} s); "
        f"HTTP overhead per bucket: {(transfer['remote'] - transfer['local']) / buckets * 1e3:.1f} ms over "
        f"{buckets} buckets; empty worker call: {remote_ping:.2f} ms over HTTP, {local_ping:.2f} ms locally"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
