"""GPU check: the install paths that only a GPU runs, in one script that prints one line per check.

Run it first whenever a session is lent a GPU (one CUDA GPU, vLLM 0.33 or 0.34 installed as on a GPU machine:
``pip install -e '.[vllm,dev]'``); it must finish in under 8 minutes::

    python benchmarks/gpu_check.py            # every check
    python benchmarks/gpu_check.py --only v2-reload,nccl

Two tiny bf16 Qwen2 checkpoints A and B (and a tiny Qwen3-MoE pair for ``moe``) are built locally; every check
installs B into an engine started on A and compares the engine's greedy tokens with a fresh engine's on B (started
once per model, same settings), after first asserting that A and B give different tokens. Checks:

- ``v2-reload``: an in-process ``LLM`` with CUDA graphs (``enforce_eager=False``): ``hotweights.install`` (auto:
  the direct setter where proven, else vLLM's reload) into whatever runner vLLM picked (Model Runner V2 is the GPU
  default since 0.32, the only one in 0.34; the line names it), then generation through the captured graphs;
- ``v2-direct``: the same engine, ``install_method="direct"`` (parameters written in place under the graphs);
- ``v2-reload-forced``: the same engine, ``install_method="reload"`` (vLLM's layerwise reload, tied-head mend);
- ``aside-refused``: the same engine, ``install_method="aside"`` (CPU only: CUDA graphs hold the parameters'
  addresses) is refused before writing, its version unchanged, and the engine still serves B;
- ``sleep-wake``: that engine asleep (level 1) refuses the install typed, then installs after ``wake_up``;
- ``extension-shm``: a multiprocess ``LLM`` with the worker extension, buckets through shm;
- ``cuda-ipc``: the same engine, CUDA tensors through the ``cuda_ipc`` transport (same GPU);
- ``nccl``: the same engine, the ``collective`` transport with ``backend="nccl"``;
- ``vllm-nccl``: the same engine, the ``vllm_nccl`` transport (vLLM's own packed NCCL broadcast and receive loop,
  into the session's staging);
- ``transfer-api``: an engine with ``weight_transfer_config={"backend": "hotweights"}``, the ``collective``
  transport (NCCL), then ``vllm_nccl``;
- ``kv-loan``: an in-process engine sized by ``gpu_memory_utilization=0.9`` (no fixed KV size: vLLM 0.34's
  extensible KV cache takes the rest of the GPU), installed into three times;
- ``moe``: a tiny Qwen3-MoE in-process, experts on the GPU;
- ``verl-settle``: no engine: verl's receiver (``hotweights.integrations.verl_update.Update``) copies a 512 MB
  bucket out of a GPU buffer, then the buffer is rewritten on another stream, as verl's sender rewrites its CUDA IPC
  buffer once answered: the copies must hold the first bucket's values.

Each line: ``PASS|FAIL|SKIP <check> <seconds> s <detail>``; exit 1 when any check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hotweights
from hotweights.adapters import (
    VLLMInProcessAdapter,
    VLLMMultiprocessAdapter,
    VLLMWeightTransferAdapter,
)
from hotweights.testing import build_tiny_model, greedy_vllm, start_engine, stop_engine

CHECKS = (
    "v2-reload",
    "v2-direct",
    "v2-reload-forced",
    "aside-refused",
    "sleep-wake",
    "extension-shm",
    "cuda-ipc",
    "nccl",
    "vllm-nccl",
    "transfer-api",
    "kv-loan",
    "moe",
    "verl-settle",
)
#: Every engine of the check, the fresh references included: the same settings give the same kernels (on CPU,
#: vLLM's compiled model and its eager one differ in bf16 from the first token on).
GPU = {"dtype": "bfloat16", "enforce_eager": False}


def gpu_transport(name: str) -> Any:
    """``name`` with NCCL on the current GPU where it has a backend (a bare ``"collective"`` is gloo on the CPU)."""
    from hotweights.transports import make_transport

    if name in ("collective", "vllm_nccl"):
        return make_transport(name, backend="nccl", device=f"cuda:{torch.cuda.current_device()}")
    return make_transport(name)


class Pair:
    """Checkpoints A and B of one family, their bf16 state dicts, and a fresh engine's tokens on B."""

    def __init__(self, family: str, tmp: Path) -> None:
        models = [build_tiny_model(family, seed=s).to(torch.bfloat16) for s in (1, 2)]
        self.paths = []
        for name, model in zip("AB", models, strict=True):
            path = tmp / f"{family}-{name}"
            model.save_pretrained(path, safe_serialization=True)
            self.paths.append(path)
        self.sd = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
        self.fresh: list[list[list[int]]] = []
        for path in self.paths:
            llm = start_engine(path, multiprocess=False, **GPU)
            self.fresh.append(greedy_vllm(llm))
            stop_engine(llm)
        if self.fresh[0] == self.fresh[1]:
            raise AssertionError(f"{family}: A and B give the same tokens, so no check could fail")

    def b(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in self.sd[1].items()}

    def a(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in self.sd[0].items()}


def verl_settle() -> str:
    """A bucket copied out of a GPU buffer by verl's receiver holds its values after the buffer is rewritten on
    another stream right after ``stage`` returns (when the receiver answers verl's sender)."""
    import types

    from hotweights.integrations.verl_update import Update

    n = 128 << 20  # float32 elements: 512 MB
    buffer = torch.arange(n, dtype=torch.float32, device="cuda").remainder_(65536).view(torch.uint8)
    expected = buffer.view(torch.float32).to(torch.bfloat16)
    torch.cuda.synchronize()
    update = Update(types.SimpleNamespace(), version=1, expected=None, dtype=torch.bfloat16)
    update.stage(buffer, [("w", torch.Size([n]), torch.float32, 0)])
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # verl's sender, told to go on
        buffer.zero_()
    torch.cuda.synchronize()
    ((_, packed),) = update.pending
    if not torch.equal(packed.view(torch.bfloat16), expected):
        raise AssertionError("the bucket copied out of verl's buffer holds the sender's next writes")
    return "512 MB copied out before the answer"


def runner_of(llm: Any) -> str:
    """The model runner an in-process engine's worker uses (``vllm.v1.worker.gpu.model_runner``: Model Runner V2)."""
    driver = llm.llm_engine.model_executor.driver_worker
    runner = type(getattr(driver, "worker", driver).model_runner)
    return f"{runner.__module__}.{runner.__name__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated checks (default: all)")
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke run of this script on CPU: the checks that need no GPU"
    )
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    device = "cuda"
    if args.cpu:
        device = "cpu"
        only = [c for c in only if c not in ("cuda-ipc", "kv-loan", "aside-refused", "verl-settle")]  # aside: CPU
    elif not torch.cuda.is_available():
        print("SKIP all: no CUDA GPU here (--cpu: a smoke run of the checks that need none)")
        return 0
    import vllm

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {where}", flush=True)
    failed = 0
    version = [0]

    def check(name: str, fn: Callable[[], str]) -> None:
        nonlocal failed
        if name not in only:
            return
        start = time.perf_counter()
        try:
            detail = fn()
            print(f"PASS {name} {time.perf_counter() - start:.1f} s {detail}", flush=True)
        except Exception as exc:
            failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(
                f"FAIL {name} {time.perf_counter() - start:.1f} s {type(exc).__name__}: {str(exc)[:300]} "
                f"({Path(where.filename).name}:{where.lineno})",
                flush=True,
            )

    def installed(llm: Any, pair: Pair, tensors: dict[str, torch.Tensor], which: int, **options: Any) -> str:
        version[0] += 1
        report = hotweights.install(llm, tensors, weight_version=version[0], **options)
        got = greedy_vllm(llm)
        if got != pair.fresh[which]:
            raise AssertionError(f"served {got[:2]}..., a fresh engine on {'AB'[which]} gives {pair.fresh[which][:2]}")
        stall = f"{report.stall_s * 1e3:.0f} ms" if report.stall_s is not None else "none"
        return f"{report.adapter} {report.install_method or ''} {report.seconds * 1e3:.0f} ms, stall {stall}"

    check("verl-settle", verl_settle)
    with tempfile.TemporaryDirectory(prefix="hotweights-gpu-") as tmp:
        qwen = Pair("qwen2", Path(tmp))
        inprocess = {"v2-reload", "v2-direct", "v2-reload-forced", "aside-refused", "sleep-wake"}
        if inprocess & set(only):
            llm = start_engine(qwen.paths[0], multiprocess=False, **GPU)
            try:
                check("v2-reload", lambda: f"{runner_of(llm)}: " + installed(llm, qwen, qwen.b(), 1))
                check(
                    "v2-direct",
                    lambda: installed(
                        llm, qwen, qwen.a(), 0, adapter=VLLMInProcessAdapter(llm, install_method="direct")
                    ),
                )
                check(
                    "v2-reload-forced",
                    lambda: installed(
                        llm, qwen, qwen.b(), 1, adapter=VLLMInProcessAdapter(llm, install_method="reload")
                    ),
                )

                def aside_refused() -> str:
                    before = llm.llm_engine.get_weight_version()
                    aside = VLLMInProcessAdapter(llm, install_method="aside")
                    try:
                        hotweights.install(llm, qwen.a(), weight_version=version[0] + 1, adapter=aside)
                    except hotweights.HotWeightsError as exc:  # an InstallError: failed before the model was touched
                        if "install_method='aside'" not in str(exc):
                            raise
                    else:
                        raise AssertionError("install_method='aside' was taken on a GPU engine")
                    if llm.llm_engine.get_weight_version() != before:
                        raise AssertionError(f"the refused install moved the version from {before}")
                    if greedy_vllm(llm) != qwen.fresh[1]:
                        raise AssertionError("after the refused aside install the engine no longer serves B")
                    return f"refused, still v{before} serving B"

                check("aside-refused", aside_refused)

                def sleep_wake() -> str:
                    llm.sleep(level=1)
                    try:
                        hotweights.install(llm, qwen.a(), weight_version=version[0] + 1)
                    except hotweights.EngineSleepingError:
                        pass
                    else:
                        raise AssertionError("an asleep engine took an install")
                    llm.wake_up()
                    return "refused asleep; " + installed(llm, qwen, qwen.a(), 0)

                check("sleep-wake", sleep_wake)
            finally:
                stop_engine(llm)
        if {"extension-shm", "cuda-ipc", "nccl", "vllm-nccl"} & set(only):
            llm = start_engine(
                qwen.paths[0], multiprocess=True, worker_extension_cls=hotweights.WORKER_EXTENSION, **GPU
            )
            try:
                check("extension-shm", lambda: installed(llm, qwen, qwen.b(), 1))
                for name, transport, which in (
                    ("cuda-ipc", "cuda_ipc", 0),
                    ("nccl", "collective", 1),
                    ("vllm-nccl", "vllm_nccl", 0),
                ):

                    def through(transport: str = transport, which: int = which) -> str:
                        with VLLMMultiprocessAdapter(llm, transport=gpu_transport(transport)) as adapter:
                            tensors = qwen.a(device) if which == 0 else qwen.b(device)
                            return installed(llm, qwen, tensors, which, adapter=adapter)

                    check(name, through)
            finally:
                stop_engine(llm)
        if "transfer-api" in only:
            llm = start_engine(
                qwen.paths[0], multiprocess=True, weight_transfer_config={"backend": "hotweights"}, **GPU
            )
            try:

                def transfer_api() -> str:
                    with VLLMWeightTransferAdapter(llm, transport=gpu_transport("collective")) as api:
                        done = installed(llm, qwen, qwen.b(device), 1, adapter=api)
                    with VLLMWeightTransferAdapter(llm, transport=gpu_transport("vllm_nccl")) as api:
                        return done + "; vllm_nccl: " + installed(llm, qwen, qwen.a(device), 0, adapter=api)

                check("transfer-api", transfer_api)
            finally:
                stop_engine(llm)
        if "kv-loan" in only:
            llm = start_engine(
                qwen.paths[0], multiprocess=False, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, **GPU
            )
            try:
                check(
                    "kv-loan",
                    lambda: " | ".join(
                        installed(llm, qwen, sd, w) for sd, w in ((qwen.b(), 1), (qwen.a(), 0), (qwen.b(), 1))
                    ),
                )
            finally:
                stop_engine(llm)
        if "moe" in only:
            try:
                moe = Pair("qwen3_moe", Path(tmp))
            except Exception as exc:
                print(f"FAIL moe 0 s the MoE pair could not be built: {type(exc).__name__}: {exc}", flush=True)
                return 1
            llm = start_engine(moe.paths[0], multiprocess=False, **GPU)
            try:
                check("moe", lambda: installed(llm, moe, moe.b(), 1))
            finally:
                stop_engine(llm)
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
