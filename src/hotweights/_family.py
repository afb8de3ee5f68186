"""The guard against a family served wrong: proven families pass, the others are probed, refused or trusted.

:func:`check_family` runs before anything is written. A family the conformance matrix proved on this vLLM and device
(:mod:`hotweights.core.families`) passes. Any other family, on the first install into each engine, gets a probe
reference computed from the tensors about to be sent (:mod:`hotweights.core.probe`); the adapter scores the engine
on it after the write, before generation is let back in, and fails closed on a difference. An engine kind that cannot
be scored from here (a server without hotweights' guard) is refused before writing, unless the caller said
``unproven="trust"``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import get_args

import torch

from hotweights.core.errors import EngineNotSupportedError, UnprovenFamilyError
from hotweights.core.families import FamilyCheck, Unproven, is_proven
from hotweights.core.probe import ProbeReference, reference
from hotweights.handles import EngineHandle
from hotweights.vllm import compat, fixes

__all__ = ["check_family", "unproven_default"]

log = logging.getLogger("hotweights")
_LOCK = threading.Lock()
#: The handle attribute that names the family probe an install into this engine passed (the first one).
_PROBED = "_hotweights_family_probed"
#: The handle attribute set once the mends its model needs were found in place.
_MENDED = "_hotweights_mends_checked"
_IDENTITY = "_hotweights_family_identity"


def check_mends(handle: EngineHandle) -> None:
    """Refuse before writing when the engine's model needs a mend of vLLM's reload that is not in place where its
    workers run (e.g. hotweights' vLLM plugin kept out by ``VLLM_PLUGINS``, or a runner the mend does not reach).

    Only the mends this vLLM needs count (:func:`~hotweights.vllm.fixes.vllm_needs_fix`): a model that needs a mend
    on another vLLM installs unmended here.

    Raises:
        EngineNotSupportedError: names the mends, what each mends, and the vLLM version; nothing was written.
    """
    if handle.__dict__.get(_MENDED):
        return
    config = handle.model.config()
    needed = fixes.vllm_fixes_for(config) if config is not None else ()
    applied = handle.model.vllm_fixes() if needed else ()
    if applied is None:
        return  # cannot be told from here: the engine's own processes apply them (hotweights' vLLM plugin)
    missing = [n for n in needed if n not in applied]
    if missing:
        why = "; ".join(f"{n}: {fixes.VLLM_FIXES[n].why}" for n in missing)
        raise EngineNotSupportedError(
            f"this model needs hotweights' mend(s) of vLLM {compat.vllm_version() or '?'}'s weight reload, and they "
            f"are not in place in the engine's workers ({why}); nothing was written. Let hotweights' vLLM plugin "
            "load in the engine's processes (add 'hotweights' to VLLM_PLUGINS, or unset it) and restart the engine."
        )
    handle.__dict__[_MENDED] = True


def _identity(handle: EngineHandle) -> tuple[str | None, str, str]:
    """``handle.model.family()``, asked once per engine (it does not change while the engine runs)."""
    known: tuple[str | None, str, str] | None = handle.__dict__.get(_IDENTITY)
    if known is None:
        known = handle.__dict__[_IDENTITY] = handle.model.family()
    return known


def unproven_default() -> Unproven:
    """``$HOTWEIGHTS_UNPROVEN`` (``probe``, ``refuse`` or ``trust``), default ``probe``."""
    value = os.environ.get("HOTWEIGHTS_UNPROVEN", "probe").strip().lower()
    if value not in get_args(Unproven):
        raise ValueError(f"HOTWEIGHTS_UNPROVEN must be one of {get_args(Unproven)}, not {value!r}")
    return value  # type: ignore[return-value]


def _vllm_compiled_the_class(exc: BaseException) -> bool:
    """Whether building a transformers model failed because vLLM's Transformers backend, serving in this process,
    compiled that very class in place (its ``__init__`` then asks for a vLLM config that only the engine sets)."""
    return isinstance(exc, AssertionError) and "vLLM config is not set" in str(exc)


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
    if not handle.guards_family:
        return FamilyCheck(handle.kind, f"not guarded: {handle.describe()} serves the tensors it stores")
    check_mends(handle)
    arch, vllm, device = _identity(handle)
    where = f"vLLM {vllm or '?'} on {device or '?'}"
    if is_proven(arch, vllm=vllm, device=device):
        return FamilyCheck(str(arch), f"proven: {arch} on {where} (conformance matrix)")
    name = arch or "an architecture that cannot be read from here"
    probed = handle.__dict__.get(_PROBED)
    if probed is not None and mode != "refuse":
        return FamilyCheck(str(arch), probed)  # the verdict of the probe it passed, as that install reported it
    if mode == "trust":
        log.warning("hotweights: %s is not proven on %s; installing unchecked (unproven='trust')", name, where)
        return FamilyCheck(str(arch), f"unproven: {name} on {where}, trusted (unproven='trust'), not checked")
    config = handle.model.config()
    why = ""
    if mode == "refuse":
        why = "unproven='refuse'"
    elif config is None or not handle.model.probes:
        why = (
            f"{handle.describe()} cannot be probed from here: its model config cannot be read (a server probes "
            "through hotweights' guard: start it with `python -m hotweights.serve` or add `--middleware "
            "hotweights.serve_guard.HotWeightsGuard`)"
        )
    elif handle.pausing.scheduler_paused() and not handle.pausing.weights_asleep() and handle.gate.refusal is None:
        # weights asleep: the adapter refuses that first; paused by a failed install (failing closed): this one lifts it
        # the probe generates: on a paused scheduler (vLLM keeps it paused after a partial wake_up, e.g.
        # wake_up(tags=["weights"]) with the KV cache still asleep) its generate never returns (seen: a hang)
        why = (
            f"the scheduler of {handle.describe()} is paused (asleep, or woken only partly: vLLM resumes it once the "
            "KV cache is awake too), so the probe cannot generate; wake the engine fully before its first install"
        )
    else:
        dtype = handle.model.dtype()

        def probe() -> ProbeReference:
            log.info(
                "hotweights: %s is not proven on %s: probing this first install into the engine (a transformers "
                "reference from the sent tensors, then the engine scores it before serving)",
                name,
                where,
            )
            start = time.perf_counter()
            try:
                ref = reference(config, tensors, dtype)
            except Exception as exc:
                if _vllm_compiled_the_class(exc):
                    raise UnprovenFamilyError(
                        f"{name} is not proven exact on {where}, and its probe reference could not be built in this "
                        "process: vLLM serves this family through its Transformers backend, which compiled "
                        "transformers' own model class in place in this process, so transformers cannot build it "
                        f"here ({type(exc).__name__}: Current vLLM config is not set); nothing was written. Pass "
                        "unproven='trust' (or set HOTWEIGHTS_UNPROVEN=trust) to install without the probe, or run the "
                        "engine multiprocess (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default), where the reference "
                        "is built apart from the engine."
                    ) from exc
                raise UnprovenFamilyError(
                    f"{name} is not proven exact on {where}, and no probe reference could be computed from the "
                    f"tensors ({type(exc).__name__}: {exc}); nothing was written. Pass unproven='trust' to install "
                    "unchecked."
                ) from exc
            log.info("hotweights: probe reference for %s built in %.2f s", name, time.perf_counter() - start)
            return ref

        def passed(verdict: str) -> None:
            with _LOCK:
                handle.__dict__[_PROBED] = verdict

        return FamilyCheck(str(arch), f"unproven: {name} on {where}, probed", probe, passed)
    raise UnprovenFamilyError(
        f"{name} is not proven exact on {where} (hotweights' conformance matrix has not run it there) and {why}; "
        "nothing was written. Pass unproven='trust' to install unchecked, or add the family to the conformance "
        "matrix (docs/architectures.md)."
    )
