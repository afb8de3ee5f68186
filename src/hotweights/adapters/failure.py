"""What an install does when it fails: the error the caller gets (:func:`raise_failure`: hotweights' own as it is,
anything else as an :class:`InstallError` that says whether the model was touched), recovery after a write that may
have been partial, and failing closed (:func:`refuse_serving`) until a full install."""

from __future__ import annotations

from typing import NoReturn

from hotweights.adapters.call import InstallCall
from hotweights.adapters.protocols import RecoveringAdapter
from hotweights.core.errors import HotWeightsError, InstallError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.telemetry import best_effort

__all__ = ["described", "raise_failure", "refuse_serving", "serving"]


def raise_failure(
    adapter: RecoveringAdapter, exc: BaseException, manifest: WeightUpdateManifest, timer: InstallCall
) -> NoReturn:
    """Raise for ``exc``, which ended the install's write: after recovering the engine where it may have been
    written (the next delta install then sends everything), failing closed until a full install."""
    if timer.may_have_written:  # the engine may hold anything: the next delta install sends everything
        adapter._delta.base = None
    if not isinstance(exc, Exception):  # KeyboardInterrupt & co.: recover if needed, keep the interrupt
        if timer.may_have_written:
            with best_effort("recover after an interrupted write"):
                adapter._recover()
            refuse_serving(adapter, manifest)
        raise exc
    what = described(exc)
    if not timer.may_have_written:
        if isinstance(exc, HotWeightsError) and not (isinstance(exc, InstallError) and exc.origin):
            raise exc  # hotweights' own (also from an engine's process, decoded): as it is
        raise InstallError(
            f"update {manifest.update_id} (v{manifest.weight_version}) failed before the model was touched: "
            f"{what}. Still serving: {serving(adapter)}. Fix the cause and install again."
        ) from exc
    try:
        cleared = adapter._recover()
    except Exception as rec:
        cleared = f"recovery failed too ({type(rec).__name__}: {rec}); restart the engine"
    closed = " Generation calls raise PartialUpdateError until then." if refuse_serving(adapter, manifest) else ""
    raise InstallError(
        f"the engine failed while writing update {manifest.update_id} (v{manifest.weight_version}): "
        f"{what}. Some layers may hold new weights; {cleared}. Install a full update "
        f"again before serving.{closed}"
    ) from exc


def refuse_serving(adapter: RecoveringAdapter, manifest: WeightUpdateManifest, reason: str | None = None) -> bool:
    """Fail closed after a partial write: generation through the gate raises until a full install succeeds."""
    if adapter.gate is None:
        return False
    adapter.gate.refuse(
        reason
        or f"generation refused: update {manifest.update_id} (v{manifest.weight_version}) failed while writing, "
        "so this engine may hold a mix of old and new weights. Install a full update first (the active version "
        "did not change, so the same weight_version is accepted), or call adapter.reopen_serving() to generate "
        "anyway."
    )
    return True


def serving(adapter: RecoveringAdapter) -> str:
    """What the engine serves, in an error message."""
    v = adapter.active_weight_version
    return "the engine's initial weights" if v is None else f"v{v}"


def described(exc: BaseException) -> str:
    """``exc`` in an install error's message: its type and message (an error an engine's worker raised that is not
    hotweights' own already starts with its type's name: :attr:`InstallError.origin`)."""
    if isinstance(exc, InstallError) and exc.origin:
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
