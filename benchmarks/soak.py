"""Soak benchmark: many installs into two live engines while both serve, watching for leaks and mixed outputs.

Two tiny fp32 Qwen2 checkpoints, A and B (``build_tiny_model("qwen2", seed=1 / 2)``), and two engines, both started
with ``worker_extension_cls=hotweights.WORKER_EXTENSION``:

- a multiprocess ``vllm.LLM`` (on A): the main thread installs B, A, B, ... into it with
  ``hotweights.install(llm, sd, weight_version=i)`` (``--installs`` times) while a thread calls ``llm.generate`` on
  ``hotweights.testing.PROMPTS`` without pause;
- an ``AsyncLLM`` (on B) on its own event-loop thread: ``--async-streams`` coroutines send greedy requests without
  pause, and after every ``--async-every``-th install into the ``LLM`` the main thread awaits one
  ``hotweights.install_async`` (A, B, ... alternating; ``pause="wait"``) on that loop.

Every output is compared with the greedy tokens of a freshly started engine on A and on B (each engine's own output
before its first install; HF transformers' are printed beside them). An output is **mixed** when it equals neither,
when its tokens carry more than one weight version (``hotweights.weight_versions_of``), or, for an ``LLM`` call,
when its prompts disagree on A vs B. An output equal to the other checkpoint than the one its version label names
is counted as **mislabelled** (a stale prefix cache, or a version recorded at the wrong time).

Every ``--every`` installs it records: the RSS of the trainer (this process) and of each engine's processes (its
EngineCore and workers), open fds and threads (Python's and the OS's) of the trainer and the engines, this
process's ``hotweights-<pid>-*`` files in /dev/shm (count, bytes) and /dev/shm's total use, installs/s and the
median install time in the interval. A table goes to stdout, everything to ``--out`` (JSON).

**Pass** (exit 0) when: 0 mixed and 0 mislabelled outputs; 0 untyped errors (exceptions that are not a
``hotweights.HotWeightsError``) from installs and from generation; from the first sample after ``--warmup``
installs to the last, RSS of the trainer and of each engine grew by at most ``--rss-frac`` + ``--rss-mb``, fds and
threads by at most ``--fd-slack`` / ``--thread-slack``; at most ``--max-shm-files`` of our files in /dev/shm at any
sample (the buckets the default transports keep for reuse) and none after the engines shut down.

This soak found that an install's calls (``is_sleeping``, ``collective_rpc``) and the generating thread's
``add_request`` raced on the ``LLM`` core client's zmq socket, which aborts the process (libzmq: ``Assertion
failed: !_current_out (src/router.cpp:166)``); hotweights now serialises those sends itself
(``patches.serialize_core_sends``), and the soak runs hotweights as shipped.

Run: ``.venv/bin/python benchmarks/soak.py`` (the full profile: 1,000 installs, a sample every 100) or
``.venv/bin/python benchmarks/soak.py --profile ci`` (100 installs, every 25: about 2 minutes on 2 cores, most
of it the two engines' start); ``--out soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import psutil
import torch

import hotweights
from hotweights.testing import (
    PROMPTS,
    EventLoopThread,
    build_tiny_model,
    greedy_hf,
    save_tiny_model,
    start_async_engine,
    start_engine,
    stop_engine,
)
from hotweights.transports import shm

PROFILES: dict[str, dict[str, int]] = {
    "full": {"installs": 1000, "every": 100},
    "ci": {"installs": 100, "every": 25},
}
MB = 1 << 20


@dataclass
class Tally:
    """Outputs and errors of one engine (updated from several threads: under ``lock``)."""

    outputs: int = 0
    calls: int = 0
    mixed: int = 0
    mislabelled: int = 0
    by_ckpt: Counter[str] = field(default_factory=Counter)
    typed_errors: Counter[str] = field(default_factory=Counter)
    untyped_errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def error(self, exc: BaseException) -> None:
        with self.lock:
            kind = self.typed_errors if isinstance(exc, hotweights.HotWeightsError) else self.untyped_errors
            kind[type(exc).__name__] += 1
            self._example(f"{type(exc).__name__}: {exc}")

    def _example(self, text: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(text[:300])

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {
                "calls": self.calls,
                "outputs": self.outputs,
                "mixed": self.mixed,
                "mislabelled": self.mislabelled,
                "by_checkpoint": dict(self.by_ckpt),
                "typed_errors": dict(self.typed_errors),
                "untyped_errors": dict(self.untyped_errors),
                "examples": list(self.examples),
            }


class Checker:
    """Classifies outputs against the fresh-engine references of A and B."""

    def __init__(self, refs: dict[str, list[list[int]]], start: str) -> None:
        self.refs = refs
        self.start = start
        """The checkpoint the engine started on (version None); version v is then the other one for odd v."""

    def expected(self, version: int | None) -> str:
        other = "B" if self.start == "A" else "A"
        return self.start if version is None or version % 2 == 0 else other

    def check(self, tally: Tally, outs: Sequence[Any], prompt_ids: Sequence[int]) -> None:
        """One generation call's outputs (``outs[k]`` answers ``PROMPTS[prompt_ids[k]]``)."""
        candidates: set[str] = set(self.refs)
        problems: list[str] = []
        mixed = mislabelled = 0
        names: list[str] = []
        for out, p in zip(outs, prompt_ids, strict=True):
            tokens = list(out.outputs[0].token_ids)
            match = {name for name, ref in self.refs.items() if ref[p] == tokens}
            try:
                version = hotweights.weight_version_of(out)
            except ValueError as exc:
                mixed += 1
                problems.append(f"prompt {p}: {exc}")
                continue
            if not match:
                mixed += 1
                problems.append(f"prompt {p} (v{version}): {tokens} equals neither A nor B")
                continue
            if self.expected(version) not in match:
                mislabelled += 1
                problems.append(f"prompt {p}: labelled v{version} ({self.expected(version)}) but equals {match}")
            candidates &= match
            names.append("/".join(sorted(match)))
        if not candidates and len(outs) > 1 and not mixed:
            mixed += 1
            problems.append(f"one call's prompts disagree: {names}")
        with tally.lock:
            tally.calls += 1
            tally.outputs += len(outs)
            tally.mixed += mixed
            tally.mislabelled += mislabelled
            for name in names:
                tally.by_ckpt[name] += 1
            for text in problems:
                tally._example(text)


def sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def llm_generate(llm: Any, max_tokens: int) -> list[Any]:
    return list(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling(max_tokens), use_tqdm=False))


_request_ids = itertools.count()


async def async_generate(engine: Any, prompt: Sequence[int], max_tokens: int) -> Any:
    final = None
    async for out in engine.generate(
        {"prompt_token_ids": list(prompt)}, sampling(max_tokens), request_id=f"soak{next(_request_ids)}"
    ):
        final = out
    return final


async def async_greedy(engine: Any, max_tokens: int) -> list[list[int]]:
    outs = await asyncio.gather(*(async_generate(engine, p, max_tokens) for p in PROMPTS))
    return [list(o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------- resources


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def proc_stats(pids: set[int]) -> dict[str, float]:
    """Summed RSS (MB), fds and threads of the live processes in ``pids``."""
    rss = fds = threads = 0
    alive = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                rss += p.memory_info().rss
                fds += p.num_fds()
                threads += p.num_threads()
            alive += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {"rss_mb": rss / MB, "fds": fds, "threads": threads, "procs": alive}


def our_shm_files() -> list[Path]:
    return sorted(shm.SHM_DIR.glob(f"hotweights-{os.getpid()}-*"))


def shm_bytes(paths: Sequence[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
        except OSError:
            continue
    return total


def os_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def sample(
    i: int,
    t0: float,
    groups: dict[str, set[int]],
    window: list[float],
    counts: dict[str, int],
    last: dict[str, Any] | None,
) -> dict[str, Any]:
    me = psutil.Process()
    files = our_shm_files()
    st = os.statvfs(shm.SHM_DIR)
    now = time.perf_counter() - t0
    row: dict[str, Any] = {
        "installs": i,
        "t_s": round(now, 2),
        "trainer_rss_mb": me.memory_info().rss / MB,
        "trainer_fds": len(os.listdir("/proc/self/fd")),
        "py_threads": threading.active_count(),
        "os_threads": os_threads(),
        "shm_files": len(files),
        "shm_bytes": shm_bytes(files),
        "shm_used_mb": (st.f_blocks - st.f_bfree) * st.f_frsize / MB,
        **{f"{name}_{k}": v for name, pids in groups.items() for k, v in proc_stats(pids).items()},
        **counts,
    }
    if last is not None and now > last["t_s"]:
        row["installs_per_s"] = (i - last["installs"]) / (now - last["t_s"])
    row["install_ms_median"] = statistics.median(window) * 1e3 if window else None
    return row


# ---------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--installs", type=int, help="installs into the LLM (default: the profile's)")
    parser.add_argument("--every", type=int, help="sample every N installs (default: the profile's)")
    parser.add_argument("--warmup", type=int, help="growth is measured from the first sample at or after this")
    parser.add_argument("--async-every", type=int, default=5, help="one install_async after every N-th install")
    parser.add_argument("--async-streams", type=int, default=2, help="concurrent request loops on the AsyncLLM")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gen-pause", type=float, default=0.0, help="seconds between generation calls")
    parser.add_argument("--rss-frac", type=float, default=0.10, help="RSS growth allowed: this fraction ...")
    parser.add_argument("--rss-mb", type=float, default=20.0, help="... plus this many MB")
    parser.add_argument("--fd-slack", type=int, default=2)
    parser.add_argument("--thread-slack", type=int, default=2)
    parser.add_argument("--max-shm-files", type=int, default=2, help="our /dev/shm files allowed at any sample")
    parser.add_argument("--out", type=Path, help="write the samples and totals as JSON")
    args = parser.parse_args()
    installs = args.installs or PROFILES[args.profile]["installs"]
    every = args.every or PROFILES[args.profile]["every"]
    warmup = every if args.warmup is None else args.warmup
    t_start = time.perf_counter()

    import vllm

    print(
        f"vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; {installs} installs, a sample every {every}, one install_async every "
        f"{args.async_every} installs, {args.async_streams} async streams, max_tokens {args.max_tokens}",
        flush=True,
    )
    models = {"A": build_tiny_model("qwen2", seed=1), "B": build_tiny_model("qwen2", seed=2)}
    sds = {k: {n: t.detach().clone() for n, t in m.state_dict().items()} for k, m in models.items()}
    hf = {k: greedy_hf(m, max_tokens=args.max_tokens) for k, m in models.items()}
    llm_tally, async_tally, install_errors = Tally(), Tally(), Tally()
    stop = threading.Event()
    samples: list[dict[str, Any]] = []
    llm_ms: list[float] = []
    async_ms: list[float] = []
    phases: list[dict[str, float]] = []
    failures: list[str] = []
    loop = EventLoopThread()
    llm = engine = None
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: save_tiny_model(m, Path(tmp) / k) for k, m in models.items()}
        before = descendants()
        t0 = time.perf_counter()
        llm = start_engine(paths["A"], multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
        llm_pids = descendants() - before
        t1 = time.perf_counter()
        engine = loop.call(start_async_engine, paths["B"], worker_extension_cls=hotweights.WORKER_EXTENSION)
        async_pids = descendants() - before - llm_pids
        t2 = time.perf_counter()
        print(f"engines up: LLM {t1 - t0:.1f} s, AsyncLLM {t2 - t1:.1f} s", flush=True)
        try:
            ref_a = [list(o.outputs[0].token_ids) for o in llm_generate(llm, args.max_tokens)]
            ref_b = loop.run(async_greedy(engine, args.max_tokens))
            refs = {"A": ref_a, "B": ref_b}
            print(f"fresh engines equal HF: A {ref_a == hf['A']}, B {ref_b == hf['B']}; A != B on "
                  f"{sum(a != b for a, b in zip(ref_a, ref_b, strict=True))}/{len(PROMPTS)} prompts")  # fmt: skip
            if ref_a == ref_b:
                sys.exit("A and B give the same greedy tokens: the check could not tell them apart")
            llm_check, async_check = Checker(refs, "A"), Checker(refs, "B")

            def generate_forever() -> None:
                while not stop.is_set():
                    try:
                        llm_check.check(llm_tally, llm_generate(llm, args.max_tokens), range(len(PROMPTS)))
                    except Exception as exc:
                        llm_tally.error(exc)
                        time.sleep(0.05)
                    if args.gen_pause:
                        time.sleep(args.gen_pause)

            async def stream(k: int) -> None:
                for p in itertools.cycle(range(k, k + len(PROMPTS))):
                    p %= len(PROMPTS)
                    try:
                        out = await async_generate(engine, PROMPTS[p], args.max_tokens)
                        async_check.check(async_tally, [out], [p])
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        async_tally.error(exc)
                        await asyncio.sleep(0.05)
                    if args.gen_pause:
                        await asyncio.sleep(args.gen_pause)

            async def start_streams() -> list[asyncio.Task[None]]:
                return [asyncio.create_task(stream(k)) for k in range(args.async_streams)]

            gen_thread = threading.Thread(target=generate_forever, name="soak-generate", daemon=True)
            gen_thread.start()
            tasks = loop.run(start_streams())
            groups = {"llm": llm_pids, "async": async_pids}
            async_version = 0

            def counts() -> dict[str, int]:
                return {
                    "gen_calls": llm_tally.calls,
                    "async_requests": async_tally.outputs,
                    "async_installs": async_version,
                }

            window: list[float] = []
            samples.append(sample(0, t_start, groups, window, counts(), None))
            print(f"sample 0 at {samples[-1]['t_s']:.1f} s", flush=True)
            for i in range(1, installs + 1):
                sd = sds["B" if i % 2 else "A"]
                t = time.perf_counter()
                try:
                    report = hotweights.install(llm, sd, weight_version=i)
                    window.append(time.perf_counter() - t)
                    llm_ms.append(window[-1] * 1e3)
                    phases.append(report.phases)
                except Exception as exc:
                    install_errors.error(exc)
                if i % args.async_every == 0:
                    async_version += 1
                    sd = sds["A" if async_version % 2 else "B"]
                    t = time.perf_counter()
                    try:
                        loop.run(hotweights.install_async(engine, sd, weight_version=async_version), timeout=120)
                        async_ms.append((time.perf_counter() - t) * 1e3)
                    except Exception as exc:
                        install_errors.error(exc)
                if i % every == 0 or i == installs:
                    samples.append(sample(i, t_start, groups, window, counts(), samples[-1]))
                    window = []
                    s = samples[-1]
                    print(
                        f"  {i:5d} installs at {s['t_s']:6.1f} s: trainer {s['trainer_rss_mb']:.0f} MB, "
                        f"{s.get('installs_per_s', 0):.1f} installs/s, gen calls {s['gen_calls']}",
                        flush=True,
                    )
            stop.set()
            gen_thread.join(timeout=60)
            for task in tasks:
                task.get_loop().call_soon_threadsafe(task.cancel)
            time.sleep(0.5)
            # the last checkpoints installed, read by fresh calls
            last_llm = "B" if installs % 2 else "A"
            last_async = "A" if async_version % 2 else "B"
            final_llm = [list(o.outputs[0].token_ids) for o in llm_generate(llm, args.max_tokens)]
            final_async = loop.run(async_greedy(engine, args.max_tokens))
            if final_llm != refs[last_llm]:
                failures.append(f"after the run the LLM does not serve {last_llm}")
            if final_async != refs[last_async]:
                failures.append(f"after the run the AsyncLLM does not serve {last_async}")
        finally:
            stop.set()
            if llm is not None:
                stop_engine(llm)
            if engine is not None:
                loop.call(engine.shutdown)  # on its loop: its output handler is cancelled there
            loop.close()
    llm = engine = None
    gc.collect()
    left = [p.name for p in our_shm_files()]
    wall = time.perf_counter() - t_start

    # ------------------------------------------------------------ report
    cols = [
        ("installs", "installs", "{:d}"),
        ("t s", "t_s", "{:.1f}"),
        ("trainer MB", "trainer_rss_mb", "{:.1f}"),
        ("LLM MB", "llm_rss_mb", "{:.1f}"),
        ("AsyncLLM MB", "async_rss_mb", "{:.1f}"),
        ("trainer fds", "trainer_fds", "{:d}"),
        ("engine fds", None, "{:d}"),
        ("threads py/os", None, "{}"),
        ("engine threads", None, "{:d}"),
        ("shm files", "shm_files", "{:d}"),
        ("shm KB", "shm_bytes", None),
        ("/dev/shm MB", "shm_used_mb", "{:.1f}"),
        ("installs/s", "installs_per_s", "{:.2f}"),
        ("install ms", "install_ms_median", "{:.1f}"),
        ("gen calls", "gen_calls", "{:d}"),
        ("async reqs", "async_requests", "{:d}"),
    ]
    print("\n| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "|".join("---:" for _ in cols) + "|")
    for s in samples:
        cells = []
        for label, key, fmt in cols:
            if label == "engine fds":
                cells.append(str(s["llm_fds"] + s["async_fds"]))
            elif label == "threads py/os":
                cells.append(f"{s['py_threads']}/{s['os_threads']}")
            elif label == "engine threads":
                cells.append(str(s["llm_threads"] + s["async_threads"]))
            elif label == "shm KB":
                cells.append(f"{s['shm_bytes'] / 1024:.0f}")
            else:
                v = s.get(key) if key else None
                cells.append("-" if v is None else fmt.format(v))  # type: ignore[union-attr]
        print("| " + " | ".join(cells) + " |")

    base = next((s for s in samples if s["installs"] >= warmup), samples[0])
    last = samples[-1]
    for key in ("trainer_rss_mb", "llm_rss_mb", "async_rss_mb"):
        allowed = base[key] * args.rss_frac + args.rss_mb
        if last[key] - base[key] > allowed:
            failures.append(f"{key} grew {base[key]:.1f} -> {last[key]:.1f} MB (allowed +{allowed:.1f})")
    for key, slack in (
        ("trainer_fds", args.fd_slack),
        ("llm_fds", args.fd_slack),
        ("async_fds", args.fd_slack),
        ("os_threads", args.thread_slack),
        ("py_threads", args.thread_slack),
        ("llm_threads", args.thread_slack),
        ("async_threads", args.thread_slack),
    ):
        if last[key] - base[key] > slack:
            failures.append(f"{key} grew {base[key]} -> {last[key]} (allowed +{slack})")
    if max(s["shm_files"] for s in samples) > args.max_shm_files:
        failures.append(
            f"up to {max(s['shm_files'] for s in samples)} files in /dev/shm (allowed {args.max_shm_files})"
        )
    if left:
        failures.append(f"left in /dev/shm after shutdown: {left}")
    tallies = {"llm_generation": llm_tally, "async_generation": async_tally, "installs": install_errors}
    totals = {name: t.summary() for name, t in tallies.items()}
    mixed = llm_tally.mixed + async_tally.mixed
    mislabelled = llm_tally.mislabelled + async_tally.mislabelled
    untyped = sum(sum(t.untyped_errors.values()) for t in tallies.values())
    typed = sum(sum(t.typed_errors.values()) for t in tallies.values())
    if mixed:
        failures.append(f"{mixed} mixed outputs")
    if mislabelled:
        failures.append(f"{mislabelled} mislabelled outputs")
    if untyped:
        failures.append(f"{untyped} untyped errors")
    if llm_tally.calls == 0 or async_tally.outputs == 0:
        failures.append("a generator produced nothing")

    def med(xs: Sequence[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    phase_med = {k: med([p[k] * 1e3 for p in phases if k in p]) for k in (phases[0] if phases else {})}
    print(
        f"\nLLM installs: {len(llm_ms)} ok, median {med(llm_ms):.1f} ms (p90 "
        f"{(statistics.quantiles(llm_ms, n=10)[-1] if len(llm_ms) > 9 else float('nan')):.1f}); phases "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in phase_med.items())
    )
    print(f"AsyncLLM installs: {len(async_ms)} ok, median {med(async_ms):.1f} ms")
    errs = totals["installs"]
    print(f"install errors: typed {errs['typed_errors']}, untyped {errs['untyped_errors']}")
    for ex in errs["examples"][:3]:
        print(f"    e.g. {ex}")
    for name, t in totals.items():
        if name == "installs":
            continue
        print(
            f"{name}: calls {t['calls']}, outputs {t['outputs']} {t['by_checkpoint']}, mixed {t['mixed']}, "
            f"mislabelled {t['mislabelled']}, typed errors {t['typed_errors']}, untyped {t['untyped_errors']}"
        )
        for ex in t["examples"][:3]:
            print(f"    e.g. {ex}")
    print(f"typed errors {typed}, untyped {untyped}; hotweights files left in /dev/shm: {len(left)}")
    print(f"wall {wall:.1f} s; load average now {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "config": {
                        **vars(args),
                        "out": str(args.out),
                        "installs": installs,
                        "every": every,
                        "warmup": warmup,
                    },
                    "samples": samples,
                    "totals": totals,
                    "llm_install_ms": llm_ms,
                    "async_install_ms": async_ms,
                    "phases_median_ms": phase_med,
                    "left_in_shm": left,
                    "failures": failures,
                    "wall_s": wall,
                },
                indent=1,
            )
        )
    if failures:
        print("FAIL: " + "; ".join(failures))
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
