"""Asynchronous RL: what an install costs an ``AsyncLLM`` that never stops serving.

One ``AsyncLLM`` (multiprocess, hotweights' worker extension) serves a steady load: ``--streams`` concurrent
requests, each a fixed prompt of 16 tokens and ``--max-tokens`` output tokens (greedy, ``ignore_eos``), replaced as
soon as it finishes. Every profile runs ``--seconds`` of that load; all but ``idle`` install B, A, B, ... every
``--every`` seconds from a trainer coroutine on the same event loop:

- ``idle``: no installs (the reference tokens/s);
- ``wait``, ``abort``, ``keep``, ``recompute``: ``hotweights.install_async(..., pause=mode)``, atomic commit (the
  default adapter). ``keep``: requests in flight go on with their KV cache from the old weights; ``recompute``: they
  are prefilled again on the new weights, and the install's stall counts that re-prefill;
- ``streaming``: ``pause="wait"`` through ``VLLMMultiprocessAdapter(engine, commit="streaming")``;
- ``aside``: ``pause="keep"`` through ``VLLMMultiprocessAdapter(engine, install_method="aside")``: the new layers are
  built (loaded and re-packed) in a twin of the model while the engine serves, the commit swaps them in;
- ``native``: vLLM's own flow on the same engine, no hotweights in the path: ``pause_generation(mode="keep")``,
  the weights written as one safetensors file in /dev/shm, ``collective_rpc("reload_weights", weights_path=...)``,
  ``reset_prefix_cache``, ``resume_generation``.

Per profile it prints: output tokens/s and its ratio to ``idle``; per install (medians): the whole install time, the
stall (``report.stall_s``: generation held off, from the pause to the resume; for ``native`` the same span timed
here) and the longest gap between two consecutive tokens of one stream during the install (within a request, or from
one request's last token to the next one's first); in ``keep`` and ``recompute`` mode, how many requests finished
with tokens of two versions and what happened to their KV cache (``hotweights.weight_versions_of``: ``kv``). After
the last install the engine's greedy tokens must equal HF's on the last checkpoint installed (exit 1 otherwise).

Then the same for an in-process ``vllm.LLM`` driven by another thread (``--inprocess``, on by default): a thread calls
``llm.generate`` on ``--streams`` prompts at a time, back to back, while the main thread installs every ``--every``
seconds: ``llm-idle``, ``llm-reload`` (``hotweights.install``'s default adapter) and ``llm-aside``
(``VLLMInProcessAdapter(llm, install_method="aside")``). A ``vllm.LLM`` has no scheduler to pause: the stall is the
time hotweights' gate held new generation calls (``report.stall_s``); token gaps are not seen (a call returns whole).

Run: ``.venv/bin/python benchmarks/bench_async.py`` (the 150m model: ~150M-param fp32 Qwen2, 612 MB) or
``--size tiny`` (seconds, for a smoke run); ``--profiles idle,keep`` picks profiles.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import hotweights
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.handles import as_engine
from hotweights.testing import (
    EventLoopThread,
    build_tiny_model,
    greedy_hf,
    greedy_vllm,
    start_async_engine,
    start_engine,
    stop_engine,
)

PROFILES = ("idle", "wait", "abort", "keep", "recompute", "streaming", "aside", "native")
LLM_PROFILES = ("llm-idle", "llm-reload", "llm-aside")
SIZES: dict[str, dict[str, int]] = {
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}
PROMPT = list(range(100, 116))


@dataclass
class Load:
    """What the request streams saw: token arrival times per stream (its requests one after the other), finished
    outputs."""

    tokens: int = 0
    arrivals: list[list[float]] = field(default_factory=list)
    finished: list[Any] = field(default_factory=list)
    stop: bool = False


@dataclass
class Install:
    start: float
    end: float
    stall_s: float
    recompute_s: float = 0.0
    """``recompute``: the part of the stall spent waiting for the preempted requests' re-prefill."""


async def stream(engine: Any, load: Load, max_tokens: int, ids: Any) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    times: list[float] = []
    load.arrivals.append(times)
    while not load.stop:
        seen, final = 0, None
        async for out in engine.generate({"prompt_token_ids": PROMPT}, sp, request_id=f"bench-{next(ids)}"):
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter()
            times.extend([now] * (n - seen))
            load.tokens += n - seen
            seen, final = n, out
        if final is not None:
            load.finished.append(final.outputs[0])


def longest_gap(load: Load, install: Install) -> float:
    """The longest wait between two consecutive tokens of one stream (within a request, or from a request's last
    token to the next one's first: a request that arrived during a pause waits for its first) that overlaps the
    install."""
    gaps = (
        b - a for times in load.arrivals for a, b in itertools.pairwise(times) if b > install.start and a < install.end
    )
    return max(gaps, default=0.0)


async def native_install(engine: Any, sd: dict[str, torch.Tensor], version: int, tmp: Path) -> float:
    """vLLM's own flow; returns the seconds generation was paused."""
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-async-native-"))
    await asyncio.to_thread(save_file, {k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    paused = time.perf_counter()
    await engine.pause_generation(mode="keep")
    try:
        await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
        await engine.reset_prefix_cache()
        await engine.update_weight_version(str(version))
    finally:
        await engine.resume_generation()
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    return time.perf_counter() - paused


async def run_profile(
    engine: Any, profile: str, pair: list[dict[str, torch.Tensor]], args: argparse.Namespace, state: dict[str, Any]
) -> dict[str, Any]:
    load, installs = Load(), []
    ids = state["ids"]
    streams = [asyncio.create_task(stream(engine, load, args.max_tokens, ids)) for _ in range(args.streams)]
    await asyncio.sleep(1.0)  # warm: every stream is decoding
    tokens0, start = load.tokens, time.perf_counter()
    deadline = start + args.seconds
    while profile != "idle" and time.perf_counter() + args.every < deadline:
        await asyncio.sleep(args.every)
        state["version"] += 1
        version = state["version"]
        sd = pair[version % 2]
        t0 = time.perf_counter()
        if profile == "native":
            stall = await native_install(engine, sd, version, args.tmp)
        else:
            options: dict[str, Any] = {"pause": {"streaming": "wait", "aside": "keep"}.get(profile, profile)}
            if profile in ("streaming", "aside"):
                if profile not in state:
                    chosen: dict[str, Any] = (
                        {"commit": "streaming"} if profile == "streaming" else {"install_method": "aside"}
                    )
                    state[profile] = await asyncio.to_thread(partial(VLLMMultiprocessAdapter, engine, **chosen))
                options["adapter"] = state[profile]
            report = await hotweights.install_async(engine, sd, weight_version=version, **options)
            stall = report.stall_s or 0.0
        gate = getattr(as_engine(engine), "gate", None)
        waited = getattr(gate, "recompute_s", None) if profile == "recompute" else None
        installs.append(Install(t0, time.perf_counter(), stall, waited or 0.0))
        state["last"] = version % 2
    await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
    elapsed, tokens = time.perf_counter() - start, load.tokens - tokens0
    load.stop = True
    await asyncio.gather(*streams)
    gap = statistics.median(longest_gap(load, i) for i in installs) if installs else 0.0
    crossed = [hotweights.weight_versions_of(o) for o in load.finished]
    mixed = sum(1 for v in crossed if v.mixed)
    kv = sorted({str(v.kv) for v in crossed if v.mixed})
    row = {**summary(profile, tokens / elapsed, installs, gap, mixed, len(load.finished)), "kv": "/".join(kv)}
    if profile == "recompute" and installs:
        row["recompute_s"] = statistics.median(i.recompute_s for i in installs)
    return row


def summary(
    profile: str, tok_s: float, installs: list[Install], gap_s: float, mixed: int, requests: int
) -> dict[str, Any]:
    """One profile's row: its rate, and the medians over its installs."""
    return {
        "profile": profile,
        "tok_s": tok_s,
        "installs": len(installs),
        "install_s": statistics.median(i.end - i.start for i in installs) if installs else 0.0,
        "stall_s": statistics.median(i.stall_s for i in installs) if installs else 0.0,
        "gap_s": gap_s,
        "mixed": mixed,
        "requests": requests,
    }


def run_llm_profile(
    llm: Any, profile: str, pair: list[dict[str, torch.Tensor]], args: argparse.Namespace, state: dict[str, Any]
) -> dict[str, Any]:
    """The same load and installs for an in-process ``vllm.LLM``: a thread generates, this one installs."""
    from vllm import SamplingParams

    from hotweights.adapters import VLLMInProcessAdapter

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": PROMPT}] * args.streams
    load = Load()

    def generate() -> None:
        while not load.stop:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            load.tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            load.finished += [o.outputs[0] for o in outs]

    thread = threading.Thread(target=generate, name="bench-generate")
    thread.start()
    installs: list[Install] = []
    try:
        time.sleep(1.0)
        tokens0, start = load.tokens, time.perf_counter()
        deadline = start + args.seconds
        adapter = VLLMInProcessAdapter(llm, install_method="aside") if profile == "llm-aside" else None
        while profile != "llm-idle" and time.perf_counter() + args.every < deadline:
            time.sleep(args.every)
            state["version"] += 1
            version = state["version"]
            t0 = time.perf_counter()
            report = hotweights.install(llm, pair[version % 2], weight_version=version, adapter=adapter)
            installs.append(Install(t0, time.perf_counter(), report.stall_s or 0.0))
            state["last"] = version % 2
        time.sleep(max(0.0, deadline - time.perf_counter()))
        elapsed, tokens = time.perf_counter() - start, load.tokens - tokens0
    finally:
        load.stop = True
        thread.join()
    return summary(profile, tokens / elapsed, installs, float("nan"), 0, len(load.finished))


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['profile']:>10}: {row['tok_s']:7.1f} tok/s, {row['installs']} installs, install "
        f"{row['install_s']:.2f} s, stall {row['stall_s']:.2f} s, longest token gap {row['gap_s']:.2f} s, "
        f"{row['mixed']}/{row['requests']} requests with two versions"
        + (f" (KV {row['kv']})" if row.get("kv") else "")
        + (f", of the stall {row['recompute_s']:.2f} s re-prefill" if "recompute_s" in row else ""),
        flush=True,
    )


async def greedy(engine: Any) -> list[list[int]]:
    from vllm import SamplingParams

    from hotweights.testing import PROMPTS

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": list(prompt)}, sp, request_id=f"bench-check-{i}"):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--seconds", type=float, default=30.0, help="load per profile")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between installs")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--inprocess", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = set(profiles) - set(PROFILES) - set(LLM_PROFILES)
    if unknown:
        parser.error(f"unknown profiles {sorted(unknown)}; choose from {PROFILES + LLM_PROFILES}")
    if args.inprocess and not set(profiles) & set(LLM_PROFILES):
        profiles += LLM_PROFILES
    models = [build_tiny_model("qwen2", seed=s, **SIZES[args.size]) for s in (1, 2)]
    pair = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    nbytes = sum(t.nbytes for t in pair[0].values())
    refs = [greedy_hf(m) for m in models]
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        args.tmp = Path(tmp)
        path = Path(tmp) / "A"
        models[0].save_pretrained(path, safe_serialization=True)
        loop = EventLoopThread()
        engine = loop.call(start_async_engine, path, worker_extension_cls=hotweights.WORKER_EXTENSION)
        state: dict[str, Any] = {"version": 0, "last": 0, "ids": iter(range(10**9))}
        rows = []
        try:
            print(
                f"{args.size}: {nbytes / 1e6:.0f} MB fp32; {args.streams} streams x {args.max_tokens} tokens; "
                f"installs every {args.every:g} s over {args.seconds:g} s per profile",
                flush=True,
            )
            for profile in [p for p in profiles if p in PROFILES]:
                row = loop.run(run_profile(engine, profile, pair, args, state), timeout=args.seconds * 4 + 600)
                rows.append(row)
                _print_row(row)
            served = loop.run(greedy(engine))
        finally:
            engine.shutdown()
            loop.close()
        if served != (refs[state["last"]] if state["version"] else refs[0]):
            print(f"FAIL: after the last AsyncLLM install the engine serves {served}")
            return 1
        chosen = [p for p in profiles if p in LLM_PROFILES]
        if chosen:
            llm = start_engine(path, multiprocess=False)
            llm_state: dict[str, Any] = {"version": 0, "last": 0}
            try:
                for profile in chosen:
                    row = run_llm_profile(llm, profile, pair, args, llm_state)
                    rows.append(row)
                    _print_row(row)
                served = greedy_vllm(llm)
            finally:
                stop_engine(llm)
            state = llm_state
    idle = {
        kind: next((r["tok_s"] for r in rows if r["profile"] == name), None)
        for kind, name in (("async", "idle"), ("llm", "llm-idle"))
    }
    print("\n| profile | tok/s | vs idle | installs | install s | stall s | stall / install | longest gap s | mixed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = idle["llm" if r["profile"].startswith("llm-") else "async"]
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        share = f"{r['stall_s'] / r['install_s']:.2f}" if r["install_s"] else "-"
        print(
            f"| {r['profile']} | {r['tok_s']:.1f} | {ratio} | {r['installs']} | {r['install_s']:.2f} | "
            f"{r['stall_s']:.2f} | {share} | {r['gap_s']:.2f} | {r['mixed']}/{r['requests']} {r.get('kv', '')} |"
        )
    expected = refs[state["last"]] if state["version"] else refs[0]
    if served != expected:
        print(f"FAIL: after the last install the engine serves {served}, HF on that checkpoint gives {expected}")
        return 1
    print("engine equals HF on the last checkpoint installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
