"""An engine started from a Hub id (a snapshot in a private Hugging Face cache, offline): run as a script by
test_hub_id.py, since the Hub's offline switch is read when huggingface_hub is imported. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def main() -> None:
    cache, repo = Path(sys.argv[1]), sys.argv[2]
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    import hotweights
    from hotweights import WeightManifestValidationError
    from hotweights.testing import build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    save_tiny_model(build_tiny_model("qwen2", 1), root / "snapshots" / COMMIT)  # A
    b = dict(build_tiny_model("qwen2", 2).state_dict())
    llm = start_engine(repo, worker_extension_cls=hotweights.WORKER_EXTENSION)
    out: dict[str, object] = {"a": greedy_vllm(llm)}
    adapter = hotweights.adapter_for(llm)
    out["trainer_knows"] = adapter.expected is not None
    q, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    bad = {n: t for n, t in b.items() if n != norm} | {q: b[q][:-1]}
    out["version_before"] = llm.llm_engine.get_weight_version()
    adapter.expected = None  # the trainer's check off: the worker's own is what remains
    try:
        hotweights.install(llm, bad, weight_version=1)
        out["worker_refused"] = []
    except WeightManifestValidationError as exc:
        out["worker_refused"] = sorted([m.kind, m.name] for m in exc.mismatches)
    out["after_refusal"] = greedy_vllm(llm)
    out["version_after_refusal"] = llm.llm_engine.get_weight_version()
    out["report"] = str(hotweights.install(llm, b, weight_version=1))
    out["b"] = greedy_vllm(llm)
    stop_engine(llm)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
