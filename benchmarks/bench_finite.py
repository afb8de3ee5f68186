"""What the NaN/Inf check costs: the default install with it, against the same install with ``allow_nonfinite=True``.

One multiprocess ``vllm.LLM`` with hotweights' worker extension serves the 150m model (~150M-param fp32 Qwen2, 147
tensors, 612 MB). Installs of B, A, B, ... alternate between the check on (the default: each shm bucket is summed
by the worker as it stages it, while the trainer packs the next) and off, ``--repeats`` timed installs each after
one warm-up of each. It prints the median wall time of each, their ratio, and the time of the check alone
(:func:`hotweights.core.finite.nonfinite` over the whole update, one thread: what it would cost as an extra pass).
After the last install the engine's greedy tokens must equal HF's on that checkpoint, and a poisoned update must be
refused (exit 1 otherwise).

Run: ``.venv/bin/python benchmarks/bench_finite.py`` (~2 min on 2 cores) or ``--size tiny``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import hotweights
from hotweights.core.finite import nonfinite
from hotweights.testing import build_tiny_model, greedy_hf, greedy_vllm, start_engine, stop_engine

SIZES: dict[str, dict[str, int]] = {
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    models = [build_tiny_model("qwen2", seed=s, **SIZES[args.size]) for s in (1, 2)]
    pair = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    refs = [greedy_hf(m) for m in models]
    nbytes = sum(t.nbytes for t in pair[0].values())
    torch.set_num_threads(1)
    start = time.perf_counter()
    assert nonfinite(pair[0].items()) == []
    alone = time.perf_counter() - start
    torch.set_num_threads(2)
    versions = itertools.count(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a"
        models[0].save_pretrained(path, safe_serialization=True)
        llm = start_engine(path, multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION)
        try:
            times: dict[bool, list[float]] = {True: [], False: []}
            last = 0
            for i in range(2 * (args.repeats + 1)):
                checked = i % 2 == 0
                last = (i // 2 + 1) % 2
                start = time.perf_counter()
                hotweights.install(llm, pair[last], weight_version=next(versions), allow_nonfinite=not checked)
                if i >= 2:  # one warm-up of each
                    times[checked].append(time.perf_counter() - start)
            ok = greedy_vllm(llm) == refs[last]
            bad = dict(pair[1 - last])
            bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
            try:
                hotweights.install(llm, bad, weight_version=next(versions))
                refused = False
            except hotweights.NonFiniteWeightsError:
                refused = greedy_vllm(llm) == refs[last]
        finally:
            stop_engine(llm)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"model {args.size}: {nbytes / 1e6:.0f} MB, {len(pair[0])} tensors, {args.repeats} timed installs each")
    print(f"  install, check on (default):        {on:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in times[True])})")
    print(f"  install, allow_nonfinite=True:      {off:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in times[False])})")
    print(f"  ratio on/off:                       {on / off:.3f}  ({(on - off) * 1e3:+.1f} ms)")
    print(f"  the check alone as an extra pass:   {alone:.3f} s ({alone / off:.1%} of the install, one thread)")
    print(f"  greedy equal to HF after the last install: {ok}; a NaN update refused, old weights serving: {refused}")
    return 0 if ok and refused else 1


if __name__ == "__main__":
    sys.exit(main())
