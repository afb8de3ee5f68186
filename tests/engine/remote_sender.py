"""A sender process for fault tests: packs the buckets it is asked for into shared memory, from its own copy of
the weights, and reports each segment as one JSON line. The test kills it at random points."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from safetensors.torch import load_file

from hotweights.core.buckets import Bucket
from hotweights.transports.shm import Transport


def main() -> None:
    tensors = load_file(sys.argv[1])
    delay = float(sys.argv[2])
    shm = Transport()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        bucket = Bucket.model_validate_json(line)
        time.sleep(delay)  # widen the window in which a kill lands mid-transfer

        def stage(descriptor: Any) -> None:
            print(json.dumps(descriptor.to_wire()), flush=True)  # its wire form, as it crosses a process
            if sys.stdin.readline().strip() != "ack":  # the engine staged it; shm.send then unlinks the file
                raise ConnectionError("engine side went away")

        shm.send(bucket, tensors, stage)


if __name__ == "__main__":
    main()
