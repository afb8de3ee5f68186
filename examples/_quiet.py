"""Keep the examples' output to their own story: silence vLLM's start-up logs and third-party warnings.

Import this module and call :func:`quiet` *before* importing torch, transformers, vLLM or hotweights: PyTorch reads
``TORCH_CPP_LOG_LEVEL`` once, when it is first imported, and vLLM configures its loggers when it is first imported.
Every setting is a default: export e.g. ``VLLM_LOGGING_LEVEL=INFO`` to see vLLM's logs again.

Only the standard library is used here, so importing this module imports nothing heavy.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet"]

_ENV = {
    # the engine runs in the caller's process, so the examples hand tensors over by reference
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's INFO/WARNING start-up logs (config dumps, "Triton is installed, but doesn't include CPU backend", ...)
    "VLLM_LOGGING_LEVEL": "ERROR",
    # C++ warnings printed by c10, e.g. "[W... utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy ..."
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # transformers' "Writing model shards" bar in save_pretrained
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet() -> None:
    """Set the environment and warning filters that keep vLLM, torch and transformers quiet.

    vLLM's own "Loading safetensors checkpoint shards" bar is switched off per engine, with
    ``LLM(..., use_tqdm_on_load=False)``: no environment variable reaches it.
    """
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    # vLLM warns about Triton while it is being imported, before it has configured its own loggers; the message then
    # falls through to Python's last-resort handler unless the "vllm" logger already has a level.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    # torch.distributed.reduce_op FutureWarnings raised while vLLM's Triton shims import
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)
    # in a notebook without ipywidgets, "TqdmWarning: IProgress not found" when vLLM imports tqdm.auto
    warnings.filterwarnings("ignore", message="IProgress not found")
