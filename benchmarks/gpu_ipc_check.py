"""GPU check for the CUDA IPC path (needs one CUDA GPU and torch; vLLM is not needed).

A trainer process packs a ~0.5 GB module's state dict into CUDA buckets and shares them through hotweights'
``cuda_ipc`` transport; a second process opens the handles, stages the views against the manifest and copies them
into its own module's parameters in place (the direct-setter pattern). Prints GB/s per phase and checks that the
receiver's parameters equal the sender's and kept their storage (same data_ptr).

    python benchmarks/gpu_ipc_check.py [--mb 512]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import torch

from hotweights import WeightUpdateManifest
from hotweights.core.buckets import Bucket, plan_buckets, unpack
from hotweights.transports import make_transport


def build(mb: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    n = max(1, mb // 16)  # 2048 x 2048 fp32 = 16 MiB per layer
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(n)]).cuda()


def receiver(conn: Any, manifest_json: str, mb: int) -> None:
    from hotweights.transports.cuda_ipc import Receiver

    model = build(mb, seed=0)
    params = dict(model.named_parameters())
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    manifest = WeightUpdateManifest.from_json(manifest_json)
    copy_s = 0.0
    while (msg := conn.recv()) is not None:
        bucket_json, descriptor = msg
        buffer, keep = Receiver.open(Receiver.parse(descriptor))
        start = time.perf_counter()
        with torch.no_grad():
            for name, view in unpack(buffer, Bucket.model_validate_json(bucket_json), manifest):
                params[name].copy_(view)
        torch.cuda.synchronize()
        copy_s += time.perf_counter() - start
        del buffer, keep
        conn.send("staged")
    same_ptrs = all(p.data_ptr() == ptrs[k] for k, p in params.items())
    conn.send((copy_s, same_ptrs, {k: p.detach().sum().item() for k, p in params.items()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--bucket-mb", type=int, default=128)
    args = parser.parse_args()
    sd = {k: v.detach() for k, v in build(args.mb, seed=1).state_dict().items()}
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, manifest.to_json(), args.mb))
    proc.start()
    transport = make_transport("cuda_ipc")
    start = time.perf_counter()
    for bucket in plan_buckets(manifest, args.bucket_mb << 20):

        def stage(descriptor: dict[str, Any], b: Bucket = bucket) -> None:
            parent.send((b.model_dump_json(), descriptor))
            assert parent.recv() == "staged"

        transport.send(bucket, sd, stage)
    total = time.perf_counter() - start
    parent.send(None)
    copy_s, same_ptrs, sums = parent.recv()
    proc.join(60)
    gb = manifest.total_bytes / 1e9
    exact = all(abs(sums[k] - sd[k].sum().item()) < 1e-3 for k in sd)
    print(
        f"{gb:.2f} GB in {total:.3f} s end to end ({gb / total:.1f} GB/s); in-place copy {copy_s:.3f} s "
        f"({gb / copy_s:.1f} GB/s); values equal: {exact}; storage kept (same data_ptr): {same_ptrs}"
    )
    raise SystemExit(0 if exact and same_ptrs else 1)


if __name__ == "__main__":
    main()
