"""A LoRA run's weight sync: the adapter alone (``hotweights.install_lora``) against the merged model
(``hotweights.install``), into in-process engines on the same base model.

The base is the 150m model (~150M-param fp32 Qwen2, 612 MB; ``--size tiny`` for a smoke run); two PEFT adapters of
rank ``--rank`` on every linear layer (q, k, v, o, gate, up, down), their A and B drawn at random, alternate:

- ``lora``: an engine started with ``enable_lora=True, max_lora_rank=rank`` takes ``install_lora(adapter)``;
- ``merged``: an engine without LoRA takes ``install(merged model)`` (what a LoRA trainer syncs otherwise: PEFT's
  ``merge_and_unload``).

Per path (one untimed warm-up, then ``--repeats`` timed, medians): bytes sent, install seconds; then the ratios.
After the last install each engine's greedy tokens must equal HF PEFT's on that adapter (exit 1 otherwise).

Run: ``.venv/bin/python benchmarks/bench_lora.py [--size tiny] [--rank 16] [--repeats 5]``.
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
from hotweights.testing import PROMPTS, build_tiny_model, greedy_hf, start_engine, stop_engine

SIZES: dict[str, dict[str, int]] = {
    "150m": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072, "vocab": 32000},
    "tiny": {},
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(size: str, rank: int, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        build_tiny_model("qwen2", seed=1, **SIZES[size]),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0),
    )
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def greedy(llm: Any, lora: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], sp, lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    from peft import get_peft_model_state_dict

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="150m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    models = [adapter(args.size, args.rank, seed) for seed in (3, 4)]
    config = models[0].peft_config["default"]
    refs = [greedy_hf(m) for m in models]
    adapters = [{k: v.detach().clone() for k, v in get_peft_model_state_dict(m).items()} for m in models]
    merged = [
        {k: v.detach().clone() for k, v in m.merge_and_unload().state_dict().items()}
        for m in (adapter(args.size, args.rank, seed) for seed in (3, 4))
    ]
    ok = True
    rows: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        base = Path(tmp) / "base"
        build_tiny_model("qwen2", seed=1, **SIZES[args.size]).save_pretrained(base, safe_serialization=True)
        for path in ("lora", "merged"):
            extra = {"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 1} if path == "lora" else {}
            llm = start_engine(base, multiprocess=False, **extra)
            times, nbytes = [], 0
            try:
                for i in range(args.repeats + 1):
                    which = i % 2
                    start = time.perf_counter()
                    if path == "lora":
                        report = hotweights.install_lora(
                            llm, adapters[which], name="policy", weight_version=i + 1, config=config
                        )
                    else:
                        report = hotweights.install(llm, merged[which], weight_version=i + 1)
                    if i:
                        times.append(time.perf_counter() - start)
                    nbytes = report.num_bytes
                lora = hotweights.lora_request(llm, "policy") if path == "lora" else None
                if greedy(llm, lora) != refs[args.repeats % 2]:
                    print(f"FAIL: {path}: the engine differs from HF PEFT on the last adapter installed")
                    ok = False
            finally:
                stop_engine(llm)
            rows[path] = (statistics.median(times), nbytes)
            print(f"{path:>7}: {nbytes / 1e6:9.2f} MB sent, install {rows[path][0] * 1e3:8.1f} ms (median)", flush=True)
    (lt, lb), (mt, mb) = rows["lora"], rows["merged"]
    print(f"adapter alone: {mb / lb:.1f}x fewer bytes, {mt / lt:.1f}x faster than the merged model")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
