"""A trainer process for the SIGKILL test: connects to a server and installs a checkpoint in small buckets,
printing one line per bucket sent (so the test can kill it mid-transfer)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

import torch
from safetensors.torch import load_file

import hotweights
import hotweights.adapters
from hotweights.core.buckets import Bucket
from hotweights.transports import Stage
from hotweights.transports.shm import Transport


class SlowShm(Transport):
    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        super().send(bucket, tensors, stage)
        print(f"bucket {bucket.index}", flush=True)
        time.sleep(0.05)


def main() -> None:
    url, weights, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tensors = load_file(weights)
    engine = hotweights.connect(url, timeout=20.0)
    adapter = hotweights.adapters.VLLMMultiprocessAdapter(engine, transport=SlowShm(), bucket_bytes=16 << 10)
    manifest = hotweights.WeightUpdateManifest.from_state_dict(tensors, weight_version=version)
    print("connected", flush=True)
    print(adapter.install(manifest, tensors), flush=True)


if __name__ == "__main__":
    main()
