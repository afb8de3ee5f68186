"""The write of a checked update and what follows it (:func:`commit`): the installer's path writes the engine, the
read-back is held to ``verify``, the family probe is scored, the delta base and the active version move on, the
prefix cache is reset and the version recorded in the engine; then the :class:`InstallReport`."""

from __future__ import annotations

import logging
from typing import Any

from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.failure import raise_failure
from hotweights.adapters.probe_step import check_family
from hotweights.adapters.protocols import InstallingAdapter
from hotweights.core.cast import CastItems, item_names
from hotweights.core.delta import EncodedDelta, StagedDelta
from hotweights.core.errors import InstallError
from hotweights.core.families import FamilyCheck
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.probe import ProbeReference
from hotweights.core.report import InstallReport

__all__ = ["commit"]

logger = logging.getLogger("hotweights")


def commit(
    adapter: InstallingAdapter,
    manifest: WeightUpdateManifest,
    send: Items,
    skipped: list[tuple[str, str]],
    timer: InstallCall,
    delta: tuple[EncodedDelta, StagedDelta] | None = None,
    delta_asked: bool = False,
    family: FamilyCheck | None = None,
    probe: ProbeReference | None = None,
) -> InstallReport:
    """Write ``send`` (or ``delta``) through ``adapter``'s hooks and finish the install; the report."""
    try:
        if delta is not None:
            summary = adapter._install_delta(manifest, *delta, timer) or {}
        else:
            summary = adapter._install(manifest, send, timer) or {}
        _check_strict_readback(summary, timer)
    except BaseException as exc:
        raise_failure(adapter, exc, manifest, timer)
    path = timer.path
    family_check = check_family(adapter, manifest, family, probe, timer)
    previous = adapter.active_weight_version
    nbytes = sum(manifest.tensors[n].expected_nbytes for n in item_names(send))
    state = adapter._delta
    if delta is not None and state.base is not None:
        state.base.commit(delta[1])
    elif state.tracking:
        state.base = adapter._capture_base(send, manifest.weight_version)
    # The new weights are in: from here on the engine serves them, whatever happens next.
    adapter.reopen_serving()  # a complete install heals a failed one
    adapter.active_weight_version = manifest.weight_version
    adapter.active_update_id = manifest.update_id
    reset = False
    try:
        if adapter.prefix_cache == "reset":
            with timer("reset_prefix_cache"):
                reset = adapter._reset_prefix_cache()
        with timer("record_version"):
            engine_version = adapter._record_engine_version(str(manifest.weight_version))
        state.engine_version = engine_version
    except Exception as exc:
        raise InstallError(
            f"v{manifest.weight_version} was installed, but the follow-up step failed: {type(exc).__name__}: "
            f"{exc}. Call llm.reset_prefix_cache() before serving, so no output reuses the old weights' KV "
            "blocks."
        ) from exc
    return InstallReport(
        update_id=manifest.update_id,
        weight_version=manifest.weight_version,
        previous_version=previous,
        adapter=adapter.label,
        num_tensors=len(send),
        num_bytes=nbytes,
        skipped=tuple(f"{n}: {why}" for n, why in skipped),
        prefix_cache_reset=reset,
        engine_weight_version=engine_version,
        digests_verified=int(summary.get("digests_verified", 0)),
        install_method=path[0] if path else None,
        install_reason=path[1] if path else None,
        readback_verified=int(summary.get("readback_verified", 0)) if timer.verify else None,
        readback_unreadable=int(summary.get("readback_unreadable", 0)) if timer.verify else None,
        readback_note=_readback_note(summary) if timer.verify else None,
        phases=timer.phases,
        bytes_sent=delta[0].bytes_sent if delta is not None else nbytes,
        cast_tensors=send.cast_tensors if isinstance(send, CastItems) else 0,
        delta="applied" if delta is not None else "full" if delta_asked else "off",
        delta_changed=len(delta[0].manifest.entries) if delta is not None else 0,
        family_check=family_check,
    )


def _check_strict_readback(summary: dict[str, Any], call: InstallCall) -> None:
    unreadable = int(summary.get("readback_unreadable", 0))
    if call.verify and call.strict and unreadable:
        why = summary.get("readback_note") or "their parameters hold no data to read"
        raise ValueError(
            f'verify="strict": {unreadable} tensor(s) could not be read back ({why}), so the install is not '
            "proven; use verify=True to accept an install that is verified only where it can be read"
        )


def _readback_note(summary: dict[str, Any]) -> str | None:
    verified, unreadable = int(summary.get("readback_verified", 0)), int(summary.get("readback_unreadable", 0))
    note = str(summary["readback_note"]) if summary.get("readback_note") else None
    if verified == 0 and unreadable:
        note = f"nothing could be read back: {note or 'no parameter of the update holds readable data'}"
        logger.warning("verify=True read nothing back (%d tensors unreadable): %s", unreadable, note)
    return note
