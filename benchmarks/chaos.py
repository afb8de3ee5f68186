"""Chaos: seeded random schedules of generation and installs into real engines; no hang, no mix, every error typed.

Each schedule (``random.Random(seed)``) takes an engine: a fresh in-process ``vllm.LLM`` (so generation starts
*before* hotweights ever saw it, the case that deadlocked an install three times), or a multiprocess ``LLM`` with the
worker extension shared by the run. It starts 1 to 3 threads that loop ``llm.generate`` on 1 to 4 of
``hotweights.testing.PROMPTS`` (taking turns: a ``vllm.LLM`` runs one generate call at a time; some calls through a
``generate`` looked up before the first hotweights call), then runs 3 to 7 actions:

- a full install of A or B (the next version);
- a delta install (``delta=True``);
- a bad one: a wrong shape, a stale version, a wrong dtype (each must be refused before writing, typed);
- a pause in which only generation runs.

Every install runs in a thread joined with a bound (``--hang-s``): one that does not return is a **hang**.

**Pass** (exit 0) when, over every schedule: 0 hangs; 0 **mixed** calls (a call's outputs must all equal a fresh
engine's on A, or all on B); 0 untyped errors (anything not a ``hotweights.HotWeightsError``) from installs or
generation; the engine's recorded version never goes back; a refused install leaves the version as it was; and no
``hotweights-<pid>-*`` file of this process is left in /dev/shm once the engines are shut down. A failing schedule
prints its seed: ``--replay SEED`` runs that schedule alone.

Run: ``.venv/bin/python benchmarks/chaos.py --profile ci`` (20 schedules, CI) or ``--profile long`` (200).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch

import hotweights
from hotweights.testing import PROMPTS, build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine
from hotweights.transports import shm

PROFILES = {"ci": 20, "long": 200}


@dataclass
class Outcome:
    """What one schedule saw."""

    seed: int
    engine: str
    actions: list[str] = field(default_factory=list)
    calls: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


class Run:
    """The checkpoints, their fresh-engine outputs, and the shared multiprocess engine."""

    def __init__(self, tmp: Path, hang_s: float) -> None:
        self.hang_s = hang_s
        self.models = {k: build_tiny_model("qwen2", seed) for k, seed in (("A", 1), ("B", 2))}
        self.paths = {k: save_tiny_model(m, tmp / k) for k, m in self.models.items()}
        self.fresh: dict[str, list[list[int]]] = {}
        for k, path in self.paths.items():
            llm = start_engine(path, multiprocess=False)
            self.fresh[k] = greedy_vllm(llm)
            stop_engine(llm)
        assert self.fresh["A"] != self.fresh["B"], "A and B give the same tokens: the run would prove nothing"
        self._shared: Any = None
        self.serving_before: dict[int, str] = {}

    def shared(self) -> Any:
        if self._shared is None:
            self._shared = start_engine(
                self.paths["A"], multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION
            )
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return self._shared

    def close(self) -> None:
        if self._shared is not None:
            stop_engine(self._shared)
            self._shared = None

    def serving(self, llm: Any) -> str:
        """Which checkpoint the engine serves now (asked with all prompts, no other caller)."""
        out = greedy_vllm(llm)
        return next((k for k, f in self.fresh.items() if f == out), "neither")


def schedule(run: Run, seed: int) -> Outcome:
    rng = random.Random(seed)
    inprocess = rng.random() < 0.5
    outcome = Outcome(seed, "in-process (fresh)" if inprocess else "multiprocess (extension, shared)")
    llm = start_engine(run.paths["A"], multiprocess=False) if inprocess else run.shared()
    handle = hotweights.handles.as_engine(llm)
    version = int(handle.get_weight_version() or 0) if (handle.get_weight_version() or "").isdecimal() else 0
    stop = threading.Event()
    one_call = threading.Lock()  # vLLM's LLM runs one generate call at a time: its callers take turns, as users must

    def generate_loop(prompts: list[int], early: Callable[..., Any]) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        generate = early
        try:
            while not stop.is_set():
                with one_call:
                    outs = generate([{"prompt_token_ids": list(PROMPTS[i])} for i in prompts], sp, use_tqdm=False)
                got = [list(o.outputs[0].token_ids) for o in outs]
                with outcome.lock:
                    outcome.calls += 1
                if not any(got == [run.fresh[k][i] for i in prompts] for k in run.fresh):
                    outcome.fail(f"mixed call: prompts {prompts} -> {got}")
                generate = llm.generate if rng_thread.random() < 0.5 else early
        except hotweights.HotWeightsError:
            pass  # typed (e.g. a fenced engine); counted by the install side
        except BaseException as exc:
            outcome.fail(f"untyped error from generate: {type(exc).__name__}: {exc}")

    rng_thread = random.Random(seed + 1)
    threads = []
    for _ in range(rng.randint(1, 3)):
        prompts = sorted(rng.sample(range(len(PROMPTS)), rng.randint(1, len(PROMPTS))))
        t = threading.Thread(target=generate_loop, args=(prompts, llm.generate), daemon=True)
        threads.append(t)
        t.start()
    time.sleep(rng.uniform(0.0, 0.2))  # generation is under way, possibly before hotweights saw the engine

    def bounded(what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:
                result["error"] = exc

        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(run.hang_s)
        if t.is_alive():
            outcome.fail(f"hang: {what} did not return within {run.hang_s:g} s")
            return False, None
        if "error" in result:
            return False, result["error"]
        return True, result.get("value")

    last_recorded = version
    serving = run.serving_before.get(id(llm), "A")
    for _ in range(rng.randint(3, 7)):
        action = rng.choice(["A", "B", "delta", "bad-shape", "stale", "bad-dtype", "idle"])
        if action == "stale" and version == 0:
            action = "idle"  # nothing installed yet: any version is newer than the engine's own weights
        outcome.actions.append(action)
        if action == "idle":
            time.sleep(rng.uniform(0.05, 0.3))
            continue
        target = rng.choice("AB") if action in ("delta", "bad-shape", "stale", "bad-dtype") else action
        tensors = dict(run.models[target].state_dict())
        next_version = version + 1
        kwargs: dict[str, Any] = {"weight_version": next_version}
        if action == "delta":
            kwargs["delta"] = True
        elif action == "bad-shape":
            name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
            tensors[name] = tensors[name][:, :-1]
        elif action == "stale":
            kwargs["weight_version"] = version  # not newer
        elif action == "bad-dtype":
            name = next(iter(tensors))
            tensors[name] = tensors[name].to(torch.float16)
        what = f"{action} install (v{kwargs['weight_version']})"
        ok, value = bounded(what, lambda t=tensors, k=kwargs: hotweights.install(llm, t, **k))  # type: ignore[misc]
        if not ok and value is None:
            break  # a hang: stop this schedule
        if action in ("bad-shape", "stale", "bad-dtype"):
            if ok:
                outcome.fail(f"{action}: an install that must be refused returned {value}")
            elif not isinstance(value, hotweights.HotWeightsError):
                outcome.fail(f"{action}: untyped error {type(value).__name__}: {value}")
        elif not ok:
            kind = "typed" if isinstance(value, hotweights.HotWeightsError) else "untyped"
            if kind == "untyped" or not isinstance(value, hotweights.DeltaBaseMismatchError):
                outcome.fail(f"{action}: {kind} error {type(value).__name__}: {value}")
        else:
            version, serving = next_version, target
        recorded = handle.get_weight_version()
        now = int(recorded) if recorded and recorded.isdecimal() else 0
        if now < last_recorded:
            outcome.fail(f"the engine's version went back: v{last_recorded} -> v{now}")
        if now != version:
            outcome.fail(f"after {action} the engine records v{now}, the installs say v{version}")
        last_recorded = now
    stop.set()
    for t in threads:
        t.join(run.hang_s)
        if t.is_alive():
            outcome.fail("hang: a generating thread did not stop")
    served = run.serving(llm)
    if served != serving:
        outcome.fail(f"after the schedule the engine serves {served}, its last install was {serving}")
    run.serving_before[id(llm)] = served
    if inprocess:
        stop_engine(llm)
    return outcome


def leftovers() -> list[str]:
    """This process's hotweights files in /dev/shm once its engines are gone (less the buckets live transports keep
    for their next install)."""
    gc.collect()  # handles and adapters dropped with their engines take their files with them
    held = {p.name for p in shm._HELD}
    return sorted(p.name for p in shm.SHM_DIR.glob(f"hotweights-{os.getpid()}-*") if p.name not in held)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("HOTWEIGHTS_CHAOS_SEED", "2026")))
    parser.add_argument("--replay", type=int, default=None, help="run the schedule of this seed alone")
    parser.add_argument("--hang-s", type=float, default=120.0, help="an install or a thread past this is a hang")
    args = parser.parse_args(argv)
    seeds = [args.replay] if args.replay is not None else [args.seed + i for i in range(PROFILES[args.profile])]
    failed: list[Outcome] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hotweights-chaos-") as tmp:
        run = Run(Path(tmp), args.hang_s)
        try:
            for seed in seeds:
                t0 = time.perf_counter()
                outcome = schedule(run, seed)
                status = "ok" if not outcome.failures else "FAIL"
                print(
                    f"seed {seed}: {status} ({outcome.engine}; {outcome.calls} calls; {' '.join(outcome.actions)}; "
                    f"{time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
                if outcome.failures:
                    failed.append(outcome)
                    for f in outcome.failures[:5]:
                        print(f"  - {f}", flush=True)
        finally:
            run.close()
    left = leftovers()
    print(f"{len(seeds)} schedules in {time.perf_counter() - start:.0f} s: {len(failed)} failed; /dev/shm left: {left}")
    for outcome in failed:
        print(f"replay: .venv/bin/python benchmarks/chaos.py --replay {outcome.seed}")
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
