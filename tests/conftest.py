"""Shared test configuration: hypothesis profiles (``HYPOTHESIS_PROFILE=slow`` for the long runs), and
:func:`our_shm` for the suites that check what a test left in shared memory, and :func:`poisoned` (a state dict as a
diverged step leaves it: NaN and Inf)."""

from __future__ import annotations

import gc
import os

import torch
from hypothesis import HealthCheck, settings

from hotweights.transports import shm

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def our_shm() -> list[str]:
    """What this test process left in /dev/shm: hotweights segments and private checkpoint directories (other
    processes may be installing too), less the bucket files that live shm transports keep for their next install
    (they go with the transport: tests/unit/test_transports.py)."""
    gc.collect()  # an adapter dropped by a test takes its transport's files with it
    held = {p.name for p in shm._HELD}
    return sorted(p.name for p in shm.SHM_DIR.glob(f"hotweights-{os.getpid()}-*") if p.name not in held)


def poisoned(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state_dict`` as a diverged step leaves it: one NaN in the last layer's down projection, and a final norm of
    Inf only. Returns it and what the refusal must say of each poisoned tensor."""
    sd = dict(state_dict)
    down = sorted(n for n in sd if n.endswith("mlp.down_proj.weight"))[-1]
    sd[down] = sd[down].clone()
    sd[down].view(-1)[7] = float("nan")
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("inf"))
    n = sd["model.norm.weight"].numel()
    return sd, {
        down: f"1 NaN and 0 Inf among {sd[down].numel()} values",
        "model.norm.weight": f"0 NaN and {n} Inf among {n} values",
    }


def refused_as(error: Exception) -> dict[str, str]:
    """What a :class:`~hotweights.NonFiniteWeightsError` names: tensor -> counts."""
    return {m.name: m.actual for m in getattr(error, "mismatches", ()) if m.kind == "nonfinite"}
