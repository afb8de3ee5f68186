"""Run by ``test_data_parallel.py`` in its own process (vLLM's data-parallel engines need a ``__main__`` guard): an
``AsyncLLM`` with ``data_parallel_size=2`` and the worker extension; installs B then A through
``hotweights.install_async``, and prints, as one JSON line, what each rank answers and generates.

Usage: ``python dp_engine.py <checkpoint A> <checkpoint B>``
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


async def greedy(engine: Any, rank: int, tag: str) -> list[list[int]]:
    from vllm import SamplingParams

    from hotweights.testing import PROMPTS

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    async def one(i: int, prompt: list[int]) -> list[int]:
        last = None
        async for out in engine.generate(
            {"prompt_token_ids": prompt}, sp, request_id=f"{tag}-{rank}-{i}", data_parallel_rank=rank
        ):
            last = out
        assert last is not None
        return list(last.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, list(p)) for i, p in enumerate(PROMPTS))))


async def main(a: Path, b: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    import hotweights
    from hotweights.handles import as_engine
    from hotweights.testing import start_async_engine

    engine = start_async_engine(a, data_parallel_size=2, worker_extension_cls=hotweights.WORKER_EXTENSION)
    try:
        handle = as_engine(engine)
        handle.bind(asyncio.get_running_loop(), "wait")  # type: ignore[attr-defined]
        out: dict[str, Any] = {"describe": handle.describe(), "num_workers": handle.facts.num_workers}
        status = await asyncio.to_thread(handle.workers.call, "hotweights_engine", "status", "{}", timeout=30.0)
        out["status_answers"] = len(status)
        out["start"] = [await greedy(engine, r, "a0") for r in (0, 1)]
        for tag, path, version in (("b", b, 1), ("a", a, 2)):
            sd = load_file(str(path / "model.safetensors"))
            report = await hotweights.install_async(engine, sd, weight_version=version, verify=True)
            out[tag] = {
                "adapter": report.adapter,
                "ranks": [await greedy(engine, r, tag) for r in (0, 1)],
                "engine_version": await engine.get_weight_version(),  # raises if the two ranks differ
                "readback_verified": report.readback_verified,
                "readback_unreadable": report.readback_unreadable,
            }
        return out
    finally:
        engine.shutdown()


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
    print("RESULT " + json.dumps(result), flush=True)
