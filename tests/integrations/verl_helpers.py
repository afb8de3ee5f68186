"""verl's own code on CPU, for tests/integrations/test_verl.py: a CPU platform for verl, its sender, and the baseline.

verl 0.9.1 has no CPU platform (it falls back to "nvidia" and calls ``torch.cuda.synchronize``): :func:`use_cpu`
registers one through verl's own platform API (``verl.plugin.platform.set_platform``), in the trainer's process only
(the engine's worker never calls verl's device helpers on hotweights' path). Run as a script (``python -m
tests.integrations.verl_helpers send|baseline ...``) it is a verl trainer in a process of its own, one a test can kill.
"""

from __future__ import annotations

import argparse
import asyncio
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
            synchronize=lambda *a: None, empty_cache=lambda: None, ipc_collect=lambda: None, is_available=lambda: True
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


def baseline(model: str, weights_file: str, wait_s: float) -> dict[str, Any]:
    """verl's own extension on this vLLM: the RPC's error chain, and whether the sender still waits ``wait_s``
    seconds after it (verl's sender has no time-out)."""
    from safetensors.torch import load_file

    from hotweights.testing import start_engine

    llm = start_engine(
        model, "bfloat16", worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
    )
    weights = load_file(weights_file)
    errors: list[str] = []
    thread = threading.Thread(target=lambda: send(zmq_handle(), weights), daemon=True)
    thread.start()
    try:
        llm.collective_rpc(
            "update_weights_from_ipc", kwargs={"peft_config": None, "base_sync_done": True, "use_shm": True}
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
    args = parser.parse_args()
    use_cpu()
    if args.mode == "send":
        from safetensors.torch import load_file

        weights = load_file(args.weights)
        print("ready", flush=True)  # imports done: the engine's worker may start waiting now
        send(zmq_handle(), weights, stall_after=args.stall_after)
        print("sent", flush=True)
        return
    print(json.dumps(baseline(args.model, args.weights, args.wait)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # verl's sender thread never returns


if __name__ == "__main__":
    main()
