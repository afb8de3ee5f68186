"""The guard against a family served wrong: proven families pass, the others are probed, refused or trusted.

:func:`check_family` runs before anything is written. A family the conformance matrix proved on this vLLM and device
(:mod:`hotweights.core.families`) passes. Any other family, on the first install into each engine, gets a probe
reference computed from the tensors about to be sent (:mod:`hotweights.core.probe`); the adapter scores the engine
on it after the write, before generation is let back in, and fails closed on a difference. An engine kind that cannot
be scored from here is refused before writing, unless the caller said ``unproven="trust"``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import get_args

import torch

from hotweights.core.errors import UnprovenFamilyError
from hotweights.core.families import FamilyCheck, Unproven, is_proven
from hotweights.core.probe import ProbeReference, reference
from hotweights.handles import EngineHandle

__all__ = ["check_family", "unproven_default"]

log = logging.getLogger("hotweights")
_LOCK = threading.Lock()
#: The handle attribute that names the family probe an install into this engine passed (the first one).
_PROBED = "_hotweights_family_probed"


def unproven_default() -> Unproven:
    """``$HOTWEIGHTS_UNPROVEN`` (``probe``, ``refuse`` or ``trust``), default ``probe``."""
    value = os.environ.get("HOTWEIGHTS_UNPROVEN", "probe").strip().lower()
    if value not in get_args(Unproven):
        raise ValueError(f"HOTWEIGHTS_UNPROVEN must be one of {get_args(Unproven)}, not {value!r}")
    return value  # type: ignore[return-value]


def check_family(
    handle: EngineHandle, tensors: Sequence[tuple[str, torch.Tensor]], unproven: Unproven | None = None
) -> FamilyCheck:
    """Decide, before writing, how this install into ``handle``'s engine is guarded.

    Raises:
        UnprovenFamilyError: the family is not proven on this engine's vLLM and device, and it cannot be probed
            from here (or ``unproven="refuse"``); nothing was written.
    """
    mode = unproven_default() if unproven is None else unproven
    if mode not in get_args(Unproven):
        raise ValueError(f"unproven must be one of {get_args(Unproven)}, not {mode!r}")
    arch, vllm, device = handle.family()
    where = f"vLLM {vllm or '?'} on {device or '?'}"
    if is_proven(arch, vllm=vllm, device=device):
        return FamilyCheck(str(arch), f"proven: {arch} on {where} (conformance matrix)")
    name = arch or "an architecture that cannot be read from here"
    probed = handle.__dict__.get(_PROBED)
    if probed is not None and mode != "refuse":
        return FamilyCheck(str(arch), f"unproven: {probed}")
    if mode == "trust":
        log.warning("hotweights: %s is not proven on %s; installing unchecked (unproven='trust')", name, where)
        return FamilyCheck(str(arch), f"unproven: {name} on {where}, trusted (unproven='trust'), not checked")
    config = handle.model_config()
    why = ""
    if mode == "refuse":
        why = "unproven='refuse'"
    elif config is None or not handle.probes:
        why = f"{handle.describe()} cannot be probed from here (a vllm.LLM in this process can)"
    else:
        dtype = handle.engine_dtype()

        def probe() -> ProbeReference:
            try:
                return reference(config, tensors, dtype)
            except Exception as exc:
                raise UnprovenFamilyError(
                    f"{name} is not proven exact on {where}, and no probe reference could be computed from the "
                    f"tensors ({type(exc).__name__}: {exc}); nothing was written. Pass unproven='trust' to install "
                    "unchecked."
                ) from exc

        def passed(verdict: str) -> None:
            with _LOCK:
                handle.__dict__[_PROBED] = verdict

        return FamilyCheck(str(arch), f"unproven: {name} on {where}, probed", probe, passed)
    raise UnprovenFamilyError(
        f"{name} is not proven exact on {where} (hotweights' conformance matrix has not run it there) and {why}; "
        "nothing was written. Install through a vllm.LLM in this process once (the first install is probed), pass "
        "unproven='trust' to install unchecked, or add the family to the matrix (docs/architectures.md)."
    )
