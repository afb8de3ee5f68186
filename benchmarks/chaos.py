"""Chaos: seeded random schedules of generation and installs into real engines; no hang, no mix, every error typed.

A schedule draws everything from ``random.Random(seed)`` but its engine kind, which is the seed's (``seed % 5``:
any five consecutive seeds cover the five kinds):

- **in-process**: a fresh in-process ``vllm.LLM`` (so generation starts *before* hotweights ever installed into it,
  the case that deadlocked an install three times);
- **multiprocess**: a multiprocess ``LLM`` with the worker extension, shared by the run;
- **fleet**: ``hotweights.Fleet`` of two fresh in-process ``LLM``, installed into with ``fleet.install``;
- **async**: an ``AsyncLLM`` shared by the run (``start_async_engine``: no extension, the weights-path adapter) on
  its own event-loop thread, fed a steady stream of requests; installs are ``install_async`` awaited on that loop,
  each with a ``pause`` mode drawn from "wait", "abort", "keep";
- **killed**: a fresh multiprocess engine whose engine-core process is SIGKILLed at a random moment (0 to 0.5 s in)
  while installs of A, B, A, ... (versions 1, 2, 3, ...) go into it: an ``LLM`` with the worker extension and
  generation threads, or (half the seeds) an ``AsyncLLM`` with request streams and ``install_async`` in a pause
  mode drawn per install.

Generation (every kind but async): 1 to 3 threads (2 or 3 for a fleet, spread over both replicas) loop
``llm.generate`` on 1 to 4 of ``hotweights.testing.PROMPTS`` (greedy, 8 tokens). The callers of one schedule's engines
take turns: a ``vllm.LLM`` runs one generate call at a time, and two in-process engines share process-wide vLLM
state (its forward context), so they must not run a step at the same time either. Some calls go through a
``generate`` looked up before the first hotweights call. Async: 1 to 3 streams each send their 1 to 4 prompts as
concurrent requests (greedy, 8 tokens), again and again.

Actions (every kind but killed): 3 to 6 of

- a full install of A or B (the next version);
- a delta install (``delta=True``; the AsyncLLM's adapter, the weights path, must refuse it, typed);
- a bad one: a wrong shape, a stale version, a wrong dtype, and (multiprocess) a sender killed mid-transfer (an
  adapter whose shared-memory sender raises ``ConnectionError``, as a dead sending process does, after 0 to 4 of its
  256 KiB buckets): each must be refused, typed, with nothing written;
- a pause in which only generation runs.

Every install runs in a thread (async: a future on the loop) joined with a bound (``--hang-s``): one that does not
return is a **hang**, and so is a generation thread or request stream that does not stop.

**Pass** (exit 0) when, over every schedule:

- 0 hangs;
- 0 **mixed** outputs: a generate call's outputs all equal a fresh engine's on A, or all on B. An async request
  equals a fresh engine's output on A or on B (requests are judged one by one: a pause may fall between the
  requests of one gather), except that a request ending with ``finish_reason="abort"`` is not judged (and is allowed
  only if it overlapped a pause="abort" install), and a request that overlapped a pause="keep" install is judged on
  its first token only (A's or B's): frozen, it finishes on the new weights, a mix by design;
- 0 untyped errors (anything not a ``hotweights.HotWeightsError``) from installs, generation and requests;
- the engine's recorded version (each replica's) never goes back, equals the last successful install's (a refused
  one leaves it as it was), and at the end of the schedule the engine serves (greedy outputs of a fresh engine) the
  checkpoint of its last successful install; a fleet's two replicas both serve it after every install;
- killed: the install returns within ``KILL_BOUND_S`` of the kill with ``EngineDiedError`` (or an error chained from
  one), and so does a next install into the dead engine; every generation thread ends (a vLLM ``EngineDeadError``
  from ``generate`` is vLLM's own and accepted there); once the engine is shut down no ``/dev/shm`` file created
  during the schedule is left. The summary gives the longest kill-to-return time;
- no ``hotweights-<pid>-*`` file of this process is left in /dev/shm once every engine is shut down.

A failing schedule prints its seed: ``--replay SEED`` runs that schedule alone.

Run: ``.venv/bin/python benchmarks/chaos.py --profile ci`` (20 schedules, CI) or ``--profile long`` (200).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import itertools
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch

import hotweights
from hotweights.adapters import VLLMMultiprocessAdapter
from hotweights.core.buckets import Bucket
from hotweights.testing import (
    PROMPTS,
    EventLoopThread,
    build_tiny_model,
    greedy_vllm,
    save_tiny_model,
    start_async_engine,
    start_engine,
    stop_engine,
)
from hotweights.transports import shm
from hotweights.transports.transport import Stage

PROFILES = {"ci": 20, "long": 200}
KINDS = ("in-process", "multiprocess", "fleet", "async", "killed")
ACTIONS = ("A", "B", "delta", "bad-shape", "stale", "bad-dtype", "idle")
#: "delta-unsupported": a delta into the AsyncLLM, whose adapter (weights path, no extension) refuses deltas.
REFUSED = ("bad-shape", "stale", "bad-dtype", "sender-killed", "delta-unsupported")
PAUSES = ("wait", "abort", "keep")
#: Seconds an install into a killed engine may take to return, from the kill.
KILL_BOUND_S = 5.0
_request_ids = itertools.count()


@dataclass
class Outcome:
    """What one schedule saw."""

    seed: int
    kind: str
    actions: list[str] = field(default_factory=list)
    calls: int = 0
    kill_s: float | None = None
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def called(self) -> None:
        with self.lock:
            self.calls += 1


class Run:
    """The checkpoints, their fresh-engine outputs, and the engines shared by the run."""

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
        self._async: tuple[EventLoopThread, Any] | None = None
        # what each shared engine ("multiprocess", "async") served when its last schedule ended; a fresh engine
        # serves A. Keyed by kind, not id(): a stopped engine's id is reused by the next one started.
        self.serving_before: dict[str, str] = {}

    def shared(self) -> Any:
        if self._shared is None:
            self._shared = start_engine(
                self.paths["A"], multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION
            )
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return self._shared

    def async_engine(self) -> tuple[EventLoopThread, Any]:
        if self._async is None:
            loop = EventLoopThread()
            self._async = loop, loop.call(start_async_engine, self.paths["A"])  # built on the loop it runs on
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return self._async

    def close(self) -> None:
        if self._shared is not None:
            stop_engine(self._shared)
            self._shared = None
        if self._async is not None:
            loop, engine = self._async
            engine.shutdown()
            loop.close()
            self._async = None

    def which(self, outputs: list[list[int]], prompts: list[int]) -> str:
        """The checkpoint whose fresh engine gives ``outputs`` for ``prompts`` ("neither": a mix)."""
        return next((k for k, f in self.fresh.items() if outputs == [f[i] for i in prompts]), "neither")

    def serving(self, llm: Any) -> str:
        """Which checkpoint the engine serves now (asked with all prompts, no other caller)."""
        return self.which(greedy_vllm(llm), list(range(len(PROMPTS))))


class DyingSender(shm.Transport):
    """A shared-memory sender that dies (``ConnectionError``, as a killed sending process) after ``after`` buckets."""

    def __init__(self, after: int) -> None:
        super().__init__(keep_segments=False)
        self.left = after

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if self.left == 0:
            raise ConnectionError("the sending process died mid-transfer")
        self.left -= 1
        super().send(bucket, tensors, stage)


def version_of(recorded: object) -> int:
    text = str(recorded or "")
    return int(text) if text.isdecimal() else 0


def ours() -> set[str]:
    """This process's hotweights files in /dev/shm."""
    return {p.name for p in shm.SHM_DIR.glob(f"hotweights-{os.getpid()}-*")}


def died(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or is chained from, an ``EngineDiedError``."""
    while exc is not None:
        if isinstance(exc, hotweights.EngineDiedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def bounded(run: Run, outcome: Outcome, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``fn()`` in a thread joined within ``--hang-s``: (True, its value), (False, its error), (False, None): a hang."""
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


def plan(run: Run, rng: random.Random, action: str, version: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The checkpoint an install action sends, its tensors and its keyword arguments."""
    target = action if action in ("A", "B") else rng.choice("AB")
    tensors = dict(run.models[target].state_dict())
    kwargs: dict[str, Any] = {"weight_version": version + 1}
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
    return target, tensors, kwargs


def went_in(outcome: Outcome, action: str, ok: bool, value: Any) -> bool:
    """Whether an install went in; a failure is recorded where one that must be refused was not, or where an error
    is untyped (or, for a good install, anything but a delta whose base the engine lost)."""
    typed = "typed" if isinstance(value, hotweights.HotWeightsError) else "untyped"
    if action in REFUSED:
        if ok:
            outcome.fail(f"{action}: an install that must be refused returned {value}")
        elif typed == "untyped":
            outcome.fail(f"{action}: untyped error {type(value).__name__}: {value}")
        return False
    if not ok and not isinstance(value, hotweights.DeltaBaseMismatchError):
        outcome.fail(f"{action}: {typed} error {type(value).__name__}: {value}")
    return ok


def check_versions(outcome: Outcome, action: str, last: list[int], now: list[int], version: int) -> None:
    for i, (before, after) in enumerate(zip(last, now, strict=True)):
        if after < before:
            outcome.fail(f"replica {i}'s version went back: v{before} -> v{after}")
        if after != version:
            outcome.fail(f"after {action} replica {i} records v{after}, the installs say v{version}")


def generating(
    run: Run,
    outcome: Outcome,
    rng: random.Random,
    llms: list[Any],
    stop: threading.Event,
    accepted: tuple[type[BaseException], ...] = (hotweights.HotWeightsError,),
) -> tuple[list[threading.Thread], threading.Lock]:
    """Start the generation threads (at least one per engine): each loops ``generate`` on its prompts until ``stop``,
    or until an ``accepted`` error ends it (any other is a failure). One call runs at a time over ``llms``: the
    returned lock, which a serving check takes too."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    one_call = threading.Lock()
    thread_rng = random.Random(outcome.seed + 1)

    def loop(llm: Any, prompts: list[int], early: Callable[..., Any]) -> None:
        generate = early
        try:
            while not stop.is_set():
                with one_call:
                    outs = generate([{"prompt_token_ids": list(PROMPTS[i])} for i in prompts], sp, use_tqdm=False)
                outcome.called()
                got = [list(o.outputs[0].token_ids) for o in outs]
                if run.which(got, prompts) == "neither":
                    outcome.fail(f"mixed call: prompts {prompts} -> {got}")
                generate = llm.generate if thread_rng.random() < 0.5 else early
        except accepted:
            pass  # typed (a fenced engine), or vLLM's own word that its engine died
        except BaseException as exc:
            outcome.fail(f"untyped error from generate: {type(exc).__name__}: {exc}")

    threads = []
    for n in range(rng.randint(len(llms), 3)):
        llm = llms[n % len(llms)]
        prompts = sorted(rng.sample(range(len(PROMPTS)), rng.randint(1, len(PROMPTS))))
        threads.append(threading.Thread(target=loop, args=(llm, prompts, llm.generate), daemon=True))
        threads[-1].start()
    time.sleep(rng.uniform(0.0, 0.2))  # generation is under way, possibly before hotweights saw the engine
    return threads, one_call


def joined(run: Run, outcome: Outcome, threads: list[threading.Thread], what: str) -> None:
    for t in threads:
        t.join(run.hang_s)
        if t.is_alive():
            outcome.fail(f"hang: {what} did not stop")


def schedule_llms(run: Run, rng: random.Random, outcome: Outcome) -> None:
    """in-process, multiprocess and fleet schedules: ``vllm.LLM`` engines and generation threads."""
    kind = outcome.kind
    if kind == "multiprocess":
        llms = [run.shared()]
    else:
        llms = [start_engine(run.paths["A"], multiprocess=False) for _ in range(2 if kind == "fleet" else 1)]
    handles = [hotweights.handles.as_engine(llm) for llm in llms]
    last = [version_of(h.get_weight_version()) for h in handles]
    version = max(last)
    stop = threading.Event()
    threads, one_call = generating(run, outcome, rng, llms, stop)
    fleet = hotweights.Fleet(llms) if kind == "fleet" else None
    serving = run.serving_before.get(kind, "A")
    actions = ACTIONS + (("sender-killed",) if kind == "multiprocess" else ())
    for _ in range(rng.randint(3, 6)):
        action = rng.choice(actions)
        if action == "stale" and version == 0:
            action = "idle"  # nothing installed yet: any version is newer than the engine's own weights
        outcome.actions.append(action)
        if action == "idle":
            time.sleep(rng.uniform(0.05, 0.3))
            continue
        target, tensors, kwargs = plan(run, rng, action, version)
        if action == "sender-killed":
            kwargs["adapter"] = VLLMMultiprocessAdapter(
                llms[0], transport=DyingSender(rng.randint(0, 4)), bucket_bytes=256 << 10
            )
        what = f"{action} install (v{kwargs['weight_version']})"
        if fleet is not None:
            ok, value = bounded(run, outcome, what, lambda t=tensors, k=kwargs: fleet.install(t, **k))  # type: ignore[misc]
        else:
            ok, value = bounded(run, outcome, what, lambda t=tensors, k=kwargs: hotweights.install(llms[0], t, **k))  # type: ignore[misc]
        if "adapter" in kwargs:
            kwargs["adapter"].close()
        if not ok and value is None:
            break  # a hang: stop this schedule
        if went_in(outcome, action, ok, value):
            version, serving = kwargs["weight_version"], target
        now = [version_of(h.get_weight_version()) for h in handles]
        check_versions(outcome, action, last, now, version)
        last = now
        if fleet is not None:
            with one_call:
                served = [run.serving(llm) for llm in llms]
            if served != [serving] * len(llms):
                outcome.fail(f"after {what} the replicas serve {served}, the installs say {serving}")
    stop.set()
    joined(run, outcome, threads, "a generating thread")
    for llm in llms:
        served_now = run.serving(llm)
        if served_now != serving:
            outcome.fail(f"after the schedule the engine serves {served_now}, its last install was {serving}")
    if kind == "multiprocess":
        run.serving_before[kind] = served_now
    else:
        for llm in llms:
            stop_engine(llm)


async def request(engine: Any, prompt: list[int]) -> Any:
    """The final output of one greedy 8-token request."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=f"chaos-{next(_request_ids)}"):
        final = out
    return final.outputs[0] if final is not None else None


def schedule_async(run: Run, rng: random.Random, outcome: Outcome) -> None:
    """An ``AsyncLLM`` with streams of requests and ``install_async`` in a pause mode drawn per install."""
    loop, engine = run.async_engine()
    stop = threading.Event()
    finished: list[tuple[int, float, float, list[int], str | None]] = []  # prompt, start, end, tokens, finish_reason
    installs: list[tuple[float, float, str]] = []  # start, end, pause mode

    async def one(i: int) -> None:
        start = time.monotonic()
        try:
            out = await request(engine, list(PROMPTS[i]))
        except hotweights.HotWeightsError:
            return
        except Exception as exc:
            outcome.fail(f"untyped error from a request: {type(exc).__name__}: {exc}")
            return
        if out is None:
            outcome.fail(f"a request on prompt {i} ended without an output")
            return
        finished.append((i, start, time.monotonic(), list(out.token_ids), out.finish_reason))

    async def stream(prompts: list[int]) -> None:
        while not stop.is_set():
            await asyncio.gather(*(one(i) for i in prompts))
            outcome.called()

    def ask(coro: Any, what: str) -> tuple[bool, Any]:
        future = asyncio.run_coroutine_threadsafe(coro, loop.loop)
        if not concurrent.futures.wait([future], run.hang_s).done:
            outcome.fail(f"hang: {what} did not return within {run.hang_s:g} s")
            return False, None
        error = future.exception()
        return (False, error) if error is not None else (True, future.result())

    def recorded() -> int:
        return version_of(ask(engine.get_weight_version(), "get_weight_version")[1])

    version = last = recorded()
    serving = run.serving_before.get("async", "A")
    streams = []
    for _ in range(rng.randint(1, 3)):
        prompts = sorted(rng.sample(range(len(PROMPTS)), rng.randint(1, len(PROMPTS))))
        streams.append(asyncio.run_coroutine_threadsafe(stream(prompts), loop.loop))
    time.sleep(rng.uniform(0.0, 0.2))
    for _ in range(rng.randint(3, 6)):
        action = rng.choice(ACTIONS)
        if action == "stale" and version == 0:
            action = "idle"
        if action == "idle":
            outcome.actions.append(action)
            time.sleep(rng.uniform(0.05, 0.3))
            continue
        mode = rng.choice(PAUSES)
        outcome.actions.append(f"{action}/{mode}")
        target, tensors, kwargs = plan(run, rng, action, version)
        what = f"{action} install_async (v{kwargs['weight_version']}, pause={mode})"
        start = time.monotonic()
        ok, value = ask(hotweights.install_async(engine, tensors, pause=mode, **kwargs), what)  # type: ignore[arg-type]
        installs.append((start, time.monotonic(), mode))
        if not ok and value is None:
            break
        if went_in(outcome, "delta-unsupported" if action == "delta" else action, ok, value):
            version, serving = kwargs["weight_version"], target
        now = recorded()
        check_versions(outcome, action, [last], [now], version)
        last = now
    stop.set()
    for s in streams:
        if not concurrent.futures.wait([s], run.hang_s).done:
            outcome.fail("hang: a request stream did not stop")
    keep_judged = 0
    for i, start, end, tokens, reason in finished:
        during = {mode for s, e, mode in installs if start < e and end > s}
        if reason == "abort":
            if "abort" not in during:
                outcome.fail(f"a request on prompt {i} was aborted without a pause='abort' install ({during})")
        elif "keep" in during:
            keep_judged += 1
            if tokens[:1] not in ([f[i][0]] for f in run.fresh.values()):
                outcome.fail(f"a request on prompt {i} under pause='keep' starts with neither A's nor B's token")
        elif tokens not in (f[i] for f in run.fresh.values()):
            outcome.fail(f"mixed request: prompt {i} -> {tokens} (installs during it: {sorted(during)})")
    outcome.actions.append(f"[{len(finished)} requests, {keep_judged} judged on their first token]")

    async def greedy() -> list[Any]:
        return list(await asyncio.gather(*(request(engine, list(p)) for p in PROMPTS)))

    ok, outs = ask(greedy(), "the serving check")
    served = run.which([list(o.token_ids) for o in outs], list(range(len(PROMPTS)))) if ok else "unknown"
    if served != serving:
        outcome.fail(f"after the schedule the engine serves {served}, its last install was {serving}")
    run.serving_before["async"] = served


def schedule_killed(run: Run, rng: random.Random, outcome: Outcome) -> None:
    """A fresh multiprocess engine whose engine core is SIGKILLed while a thread installs into it: a ``vllm.LLM``
    with the worker extension fed by generation threads, or (half the seeds) an ``AsyncLLM`` fed request streams."""
    (schedule_killed_async if rng.random() < 0.5 else schedule_killed_llm)(run, rng, outcome)


def judge_kill(
    run: Run,
    outcome: Outcome,
    done: Callable[[float], bool],
    ended: dict[str, Any],
    killed: float,
    installed: list[int],
    again: Callable[[], Any],
) -> None:
    """The install under way at the kill returns within :data:`KILL_BOUND_S` with ``EngineDiedError``, and so does
    ``again`` (a next install into the dead engine)."""
    outcome.actions.append(f"SIGKILL after {installed[0]} installs")
    if not done(run.hang_s):
        outcome.fail(f"hang: the install into the killed engine did not return within {run.hang_s:g} s")
        return
    error, outcome.kill_s = ended["error"], ended["at"] - killed
    outcome.actions.append(f"install returned {outcome.kill_s:.2f} s after the kill")
    if outcome.kill_s < 0:
        outcome.fail(f"an install failed before the kill: {type(error).__name__}: {error}")
    elif outcome.kill_s > KILL_BOUND_S:
        outcome.fail(f"the install returned {outcome.kill_s:.1f} s after the kill (bound {KILL_BOUND_S:g} s)")
    if not isinstance(error, hotweights.HotWeightsError) or not died(error):
        outcome.fail(f"the install into the killed engine raised {type(error).__name__}: {error}")
    start = time.monotonic()
    ok, value = bounded(run, outcome, "the next install", again)
    if ok or not died(value):
        outcome.fail(f"the next install into the dead engine gave {type(value).__name__}: {value}")
    elif time.monotonic() - start > KILL_BOUND_S:
        outcome.fail(f"the next install into the dead engine took {time.monotonic() - start:.1f} s")


def schedule_killed_llm(run: Run, rng: random.Random, outcome: Outcome) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    before = ours()
    llm = start_engine(run.paths["A"], multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    pid = llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
    stop = threading.Event()
    threads, _ = generating(run, outcome, rng, [llm], stop, (hotweights.HotWeightsError, EngineDeadError))
    ended: dict[str, Any] = {}
    installed = [0]

    def installs() -> None:
        try:
            for v in itertools.count(1):
                hotweights.install(llm, dict(run.models["BA"[v % 2]].state_dict()), weight_version=v)
                installed[0] = v
        except BaseException as exc:
            ended.update(error=exc, at=time.monotonic())

    installer = threading.Thread(target=installs, daemon=True)
    installer.start()
    time.sleep(rng.uniform(0.0, 0.5))
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def done(wait: float) -> bool:
        installer.join(wait)
        return not installer.is_alive()

    judge_kill(
        run,
        outcome,
        done,
        ended,
        killed,
        installed,
        lambda: hotweights.install(llm, run.models["A"].state_dict(), weight_version=10**6),
    )
    stop.set()
    joined(run, outcome, threads, "a generating thread of the killed engine")
    ok, value = bounded(run, outcome, "stopping the killed engine", lambda: stop_engine(llm))
    if not ok and value is not None:
        outcome.actions.append(f"(stopping it: {type(value).__name__})")
    left = sorted(ours() - before)
    if left:
        outcome.fail(f"the killed engine's files are left in /dev/shm: {left}")


def schedule_killed_async(run: Run, rng: random.Random, outcome: Outcome) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    outcome.actions.append("AsyncLLM")
    before = ours()
    loop = EventLoopThread()
    engine = loop.call(start_async_engine, run.paths["A"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    pid = engine.engine_core.resources.engine_manager.processes[0].pid
    stop = threading.Event()

    async def stream(prompts: list[int]) -> None:
        try:
            while not stop.is_set():
                await asyncio.gather(*(request(engine, list(PROMPTS[i])) for i in prompts))
                outcome.called()
        except (hotweights.HotWeightsError, EngineDeadError):
            pass  # typed, or vLLM's own word that its engine died
        except BaseException as exc:
            outcome.fail(f"untyped error from a request: {type(exc).__name__}: {exc}")

    streams = [
        asyncio.run_coroutine_threadsafe(
            stream(sorted(rng.sample(range(len(PROMPTS)), rng.randint(1, len(PROMPTS))))), loop.loop
        )
        for _ in range(rng.randint(1, 3))
    ]
    ended: dict[str, Any] = {}
    installed = [0]

    async def installs() -> None:
        try:
            for v in itertools.count(1):
                tensors = dict(run.models["BA"[v % 2]].state_dict())
                await hotweights.install_async(engine, tensors, weight_version=v, pause=rng.choice(PAUSES))
                installed[0] = v
        except BaseException as exc:
            ended.update(error=exc, at=time.monotonic())

    installer = asyncio.run_coroutine_threadsafe(installs(), loop.loop)
    time.sleep(rng.uniform(0.0, 0.5))
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def again() -> Any:
        coro = hotweights.install_async(engine, run.models["A"].state_dict(), weight_version=10**6)
        return asyncio.run_coroutine_threadsafe(coro, loop.loop).result(run.hang_s)

    judge_kill(
        run,
        outcome,
        lambda wait: bool(concurrent.futures.wait([installer], wait).done),
        ended,
        killed,
        installed,
        again,
    )
    stop.set()
    for s in streams:
        if not concurrent.futures.wait([s], run.hang_s).done:
            outcome.fail("hang: a request stream of the killed engine did not stop")
    ok, value = bounded(run, outcome, "stopping the killed engine", engine.shutdown)
    if not ok and value is not None:
        outcome.actions.append(f"(stopping it: {type(value).__name__})")
    loop.close()
    left = sorted(ours() - before)
    if left:
        outcome.fail(f"the killed engine's files are left in /dev/shm: {left}")


def schedule(run: Run, seed: int) -> Outcome:
    outcome = Outcome(seed, KINDS[seed % len(KINDS)])
    kinds = {"async": schedule_async, "killed": schedule_killed}
    kinds.get(outcome.kind, schedule_llms)(run, random.Random(seed), outcome)
    return outcome


def leftovers() -> list[str]:
    """This process's hotweights files in /dev/shm once its engines are gone (less the buckets live transports keep
    for their next install)."""
    gc.collect()  # handles and adapters dropped with their engines take their files with them
    held = {p.name for p in shm._HELD}
    return sorted(ours() - held)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("HOTWEIGHTS_CHAOS_SEED", "2026")))
    parser.add_argument("--replay", type=int, default=None, help="run the schedule of this seed alone")
    parser.add_argument("--hang-s", type=float, default=120.0, help="an install or a thread past this is a hang")
    args = parser.parse_args(argv)
    seeds = [args.replay] if args.replay is not None else [args.seed + i for i in range(PROFILES[args.profile])]
    failed: list[Outcome] = []
    kills: list[float] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hotweights-chaos-") as tmp:
        run = Run(Path(tmp), args.hang_s)
        try:
            for seed in seeds:
                t0 = time.perf_counter()
                outcome = schedule(run, seed)
                status = "ok" if not outcome.failures else "FAIL"
                print(
                    f"seed {seed}: {status} ({outcome.kind}; {outcome.calls} calls; {' '.join(outcome.actions)}; "
                    f"{time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
                if outcome.kill_s is not None:
                    kills.append(outcome.kill_s)
                if outcome.failures:
                    failed.append(outcome)
                    for f in outcome.failures[:5]:
                        print(f"  - {f}", flush=True)
        finally:
            run.close()
    left = leftovers()
    kill = f"{max(kills):.2f} s over {len(kills)} kills" if kills else "no kills"
    print(
        f"{len(seeds)} schedules in {time.perf_counter() - start:.0f} s: {len(failed)} failed; "
        f"kill-to-return max {kill}; /dev/shm left: {left}"
    )
    for outcome in failed:  # again at the end, where a CI log's tail shows it
        print(f"seed {outcome.seed} ({outcome.kind}; {' '.join(outcome.actions)}) failed:")
        for f in outcome.failures[:5]:
            print(f"  - {f}")
        print(f"replay: .venv/bin/python benchmarks/chaos.py --replay {outcome.seed}")
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
