"""How a worker's install session writes a prepared update into the live model, and reads it back on request.

The session decides at ``begin`` how its commit installs (:func:`~hotweights.vllm.worker.setter.choose_method`):
the direct setter copies each tensor into its slot of the model, else one vLLM layerwise reload takes every tensor
(:func:`~hotweights.vllm.worker.ops.reload_checkpoint_tensors`). With ``verify``, the live parameters are read back
and compared with what was staged (:mod:`hotweights.vllm.worker.readback`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hotweights.vllm.worker.staging import InstallSession

__all__ = ["ModelWriter"]


class ModelWriter:
    """Writes into ``worker``'s model (a vLLM worker, or a facade with its ``model_runner`` and
    ``reload_weights``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def model(self) -> torch.nn.Module:
        """The model the worker serves."""
        from hotweights.vllm.worker.ops import worker_model

        return worker_model(self.worker)

    def write(self, session: InstallSession, items: Any) -> int:
        """Install ``items`` (the session's tensors, in manifest order) by the session's method; returns the tied
        layers refreshed."""
        from hotweights.vllm.worker.ops import after_weights_changed, reload_checkpoint_tensors

        if session.method == "direct":
            from hotweights.core.cast import lazy_mapping
            from hotweights.vllm.worker.setter import apply_direct

            assert session.direct_plan is not None
            refreshed = apply_direct(self.model(), session.direct_plan, lazy_mapping(items))
            after_weights_changed(self.worker)
            return refreshed
        return reload_checkpoint_tensors(self.worker, items)

    def read_back(self, session: InstallSession, items: Any) -> dict[str, int | str | float]:
        """The live parameters compared with ``items``: what was read back equal, what differs, and the seconds
        it took (``readback_seconds``)."""
        from hotweights.vllm.worker.readback import readback

        start = time.perf_counter()
        found: dict[str, int | str | float] = dict(readback(self.model(), session, items))
        found["readback_seconds"] = time.perf_counter() - start
        return found
