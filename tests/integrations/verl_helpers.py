"""verl's own code on CPU, for tests/integrations/test_verl.py: a CPU platform for verl, its sender, and the baseline.

verl 0.9.1 has no CPU platform (it falls back to "nvidia" and calls ``torch.cuda.synchronize``): :func:`use_cpu`
registers one through verl's own platform API (``verl.plugin.platform.set_platform``), in the trainer's process only
(the engine's worker never calls verl's device helpers on hotweights' path). Run as a script (``python -m
tests.integrations.verl_helpers send|baseline ...``) it is a verl trainer in a process of its own, one a test can kill.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch


def use_cpu() -> None:
    """verl's platform in this process: the CPU (no IPC, so verl's sender uses shared memory)."""
    from verl.plugin.platform import PlatformBase, set_platform

    class CPUPlatform(PlatformBase):  # type: ignore[misc]
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = SimpleNamespace(
            synchronize=lambda *a: None,
            empty_cache=lambda: None,
            ipc_collect=lambda: None,
            is_available=lambda: True,
            memory_allocated=lambda *a: 0,  # verl's log_gpu_memory_usage reads these on its update_weights path
            memory_reserved=lambda *a: 0,
            mem_get_info=lambda *a: (0, 0),
        )

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(CPUPlatform())


class _Remote:
    """One method of a stand-in Ray actor: ``.remote(...)`` starts it at once in a thread of its own (as Ray sends
    the call at once: verl's sender then blocks the event loop on its ZMQ socket) and returns the awaitable verl
    awaits (a Ray ``ObjectRef`` in verl)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self.fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return asyncio.wrap_future(future)


class ServerActor:
    """What verl's ``ServerAdapter`` asks of its server actor (``vLLMHttpServer``, vllm_async_server.py:249, 864,
    924), on an engine reached without Ray: ``rpc(method, kwargs)`` runs a worker call (an in-process ``LLM``'s
    ``collective_rpc``, or a server's ``/collective_rpc``), ``reset()`` resets its prefix cache. As verl's server,
    ``collective_rpc`` drops the workers' answers and raises their error."""

    def __init__(self, rpc: Any, reset: Any) -> None:
        self.global_steps: int | None = None
        self.calls: list[str] = []

        def collective_rpc(method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> None:
            self.calls.append(method)
            rpc(method, dict(kwargs or {}))

        def set_global_steps(steps: int) -> None:
            self.global_steps = steps

        self.collective_rpc = _Remote(collective_rpc)
        self.clear_kv_cache = _Remote(lambda: reset())
        self.set_global_steps = _Remote(set_global_steps)
        self.wake_up = _Remote(lambda tags=None: None)


def for_llm(llm: Any) -> ServerActor:
    """A stand-in server actor for an in-process ``vllm.LLM``."""
    return ServerActor(lambda m, kw: llm.collective_rpc(m, kwargs=kw), llm.reset_prefix_cache)


def for_url(url: str) -> ServerActor:
    """A stand-in server actor for a ``vllm serve`` process with the dev routes (``VLLM_SERVER_DEV_MODE=1``)."""
    import httpx

    def post(path: str, body: Any = None) -> None:
        with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
            answer = client.post(path, json=body)
        if not answer.is_success:
            raise RuntimeError(f"{path} answered {answer.status_code}: {answer.text[-2000:]}")

    return ServerActor(
        lambda m, kw: post("/collective_rpc", {"method": m, "kwargs": kw}), lambda: post("/reset_prefix_cache")
    )


def verl_worker_env() -> None:
    """The environment verl's Ray workers run with (rank 0 of 1, a free port for the gloo group verl's
    ``CheckpointEngineWorker`` starts), and a Ray runtime context whose job id is ``VERL_RAY_JOB_ID`` (verl's
    ``ServerAdapter`` names its ZMQ socket by it), so verl's classes build without a Ray cluster."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", RAY_LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = os.environ.get("VERL_RAY_JOB_ID", "0")
    ray.get_runtime_context = lambda: SimpleNamespace(get_job_id=lambda: job)


def server_adapter(actor: ServerActor, bucket_mb: int = 1, **config: Any) -> Any:
    """verl's own ``ServerAdapter`` (its rollout's client of the server), on ``actor``."""
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    engine = CheckpointEngineConfig(update_weights_bucket_megabytes=bucket_mb)
    rollout = RolloutConfig(name="vllm", free_cache_engine=False, checkpoint_engine=engine, **config)
    adapter = ServerAdapter(config=rollout, model_config=None, device_mesh=None)
    adapter.server_handle = actor
    return adapter


def trainer_worker(rollout: Any, per_tensor_param: Any, *, base_sync_done: bool) -> Any:
    """A stand-in for verl's trainer worker (Ray builds the real one with an FSDP engine), as much of it as
    ``ActorRolloutRefWorker.update_weights`` reads: its rollout (verl's ``ServerAdapter``) and its actor's
    ``get_per_tensor_param`` (``(weights, peft_config)``), colocated (mode ``naive``), without layered summon."""
    from omegaconf import OmegaConf

    return SimpleNamespace(
        config=OmegaConf.create({"rollout": {"name": "vllm", "free_cache_engine": False}}),
        rollout=rollout,
        actor=SimpleNamespace(
            engine=SimpleNamespace(get_per_tensor_param=per_tensor_param, is_param_offload_enabled=False)
        ),
        layered_summon=False,
        peft_merge=False,
        base_sync_done=base_sync_done,
    )


def zmq_handle(rank: int = 0) -> str:
    """The handle verl's ``ServerAdapter`` and its worker extension both derive (job id, replica 0, ``rank``): the
    job id is ``VERL_RAY_JOB_ID``, which a test sets once for its engine and its senders."""
    job = os.environ.get("VERL_RAY_JOB_ID", "0")
    return f"ipc:///tmp/rl-colocate-zmq-{job}-replica-0-rank-{rank}.sock"


def send(handle: str, weights: dict[str, torch.Tensor], bucket_mb: int = 1, stall_after: int | None = None) -> None:
    """verl's ``BucketedWeightSender`` (shared memory) sends ``weights`` in order; with ``stall_after``, it stops
    producing after that many tensors, says ``stalled`` on stdout, and waits to be killed."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(weights.items()):
            if stall_after is not None and i == stall_after:
                print("stalled", flush=True)
                time.sleep(3600)
            yield item

    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=bucket_mb, use_shm=True)
    asyncio.run(sender.async_send_weights(produce()))


def _chain(exc: BaseException | None) -> list[str]:
    out = []
    while exc is not None:
        out.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__context__ or exc.__cause__
    return out


def baseline(model: str, weights_file: str, wait_s: float, peft_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """verl's own extension on this vLLM: the RPC's error chain, and whether the sender still waits ``wait_s``
    seconds after it (verl's sender has no time-out). With ``peft_config``, a LoRA adapter sync into an engine
    started with LoRA (rank up to ``peft_config["r"]``)."""
    from safetensors.torch import load_file

    from hotweights.testing import start_engine

    lora = {"enable_lora": True, "max_lora_rank": peft_config["r"], "max_loras": 1} if peft_config else {}
    llm = start_engine(
        model,
        "bfloat16",
        worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
        **lora,
    )
    weights = load_file(weights_file)
    errors: list[str] = []
    thread = threading.Thread(target=lambda: send(zmq_handle(), weights), daemon=True)
    thread.start()
    try:
        llm.collective_rpc(
            "update_weights_from_ipc", kwargs={"peft_config": peft_config, "base_sync_done": True, "use_shm": True}
        )
    except BaseException as exc:
        errors = _chain(exc)
    thread.join(wait_s)
    return {"errors": errors, "sender_waiting": thread.is_alive()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["send", "baseline"])
    parser.add_argument("--weights", required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--wait", type=float, default=5.0)
    parser.add_argument("--lora", default="", help="a LoRA adapter sync with this peft_config (JSON)")
    args = parser.parse_args()
    use_cpu()
    if args.mode == "send":
        from safetensors.torch import load_file

        weights = load_file(args.weights)
        print("ready", flush=True)  # imports done: the engine's worker may start waiting now
        send(zmq_handle(), weights, stall_after=args.stall_after)
        print("sent", flush=True)
        return
    found = baseline(args.model, args.weights, args.wait, json.loads(args.lora) if args.lora else None)
    print(json.dumps(found), flush=True)
    sys.stdout.flush()
    os._exit(0)  # verl's sender thread never returns


if __name__ == "__main__":
    main()
