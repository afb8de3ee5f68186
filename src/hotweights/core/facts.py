"""What an engine is: the facts an installer reads to pick and shape its path, fixed while the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineFacts"]


@dataclass(frozen=True)
class EngineFacts:
    """What an engine is, read once when its handle is made (a test double keeps the defaults: one worker in another
    process, started with neither hotweights' worker extension nor its weight-transfer backend).

    Example:
        >>> EngineFacts(num_workers=2, worker_extension="my.Extension").inprocess
        False
    """

    num_workers: int = 1
    """Worker processes (tensor x pipeline parallel size, times the data-parallel ranks an ``AsyncLLM`` drives)."""
    worker_extension: str = ""
    """The ``worker_extension_cls`` the engine was started with (``""`` when none)."""
    weight_transfer_backend: str = ""
    """The ``weight_transfer_config.backend`` the engine was started with (``""`` when none)."""
    inprocess: bool = False
    """True when the workers run in this process (tensors can be handed over by reference)."""
    extensible_kv_cache: bool = False
    """Whether the engine's KV cache is vLLM 0.34's extensible one (see
    :func:`hotweights.vllm.worker.runner.kv_cache_lent`)."""
