"""What an install checks before its first write: the engine awake, the layout, the version, the tensors against
their manifest and the manifest against what the engine expects (:func:`validate`); the cast to the engine's dtypes
(:func:`cast`); and a delta against the host copy it is computed from (:func:`encode_delta`). Each raises before
anything is written."""

from __future__ import annotations

from hotweights.adapters.call import Items
from hotweights.adapters.protocols import CheckedAdapter
from hotweights.core.cast import Cast, CastItems, cast_targets, item_names
from hotweights.core.delta import EncodedDelta, StagedDelta
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    EngineSleepingError,
    StaleWeightVersionError,
    WeightManifestValidationError,
    WeightVersionUnknownError,
)
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.report import PhaseTimer

__all__ = ["cast", "encode_delta", "validate"]


def validate(
    adapter: CheckedAdapter, manifest: WeightUpdateManifest, items: Items, force: bool
) -> tuple[Items, list[tuple[str, str]]]:
    """``items`` checked against ``manifest`` and ``manifest`` against the engine, all before any write: what to
    send (tensors the engine ignores left out) and what was skipped, with why."""
    engine = adapter.engine
    if (
        engine is not None and engine.pausing.weights_asleep()
    ):  # its weights may be offloaded or discarded: writing crashes it
        raise EngineSleepingError(
            f"the engine ({engine.describe()}) is asleep, so its weights cannot be written; nothing was "
            "written. Wake it first (llm.wake_up(), or `await engine.wake_up()` for an AsyncLLM; waking only "
            "the weights, wake_up(tags=['weights']), is enough), then install again. An engine that slept before "
            "hotweights first saw it is judged by vLLM's is_sleeping(), which is also True while its scheduler is "
            "paused: resume it too."
        )
    manifest.layout.validate_supported(adapter.formats, adapter.sharded)
    try:
        active = adapter._version.checked()
    except Exception as exc:  # never "no version": an older update would pass
        if not force:
            raise WeightVersionUnknownError(manifest.weight_version, exc) from exc
        active = None
    if active is not None and manifest.weight_version <= active and not force:
        raise StaleWeightVersionError(manifest.weight_version, active)
    checked = isinstance(items, CastItems)  # by cast(), against the caller's own manifest and bytes
    problems = [] if checked else manifest.mismatches(items)
    if adapter.expected is not None:
        problems += adapter.expected.mismatches(manifest)
    if not problems and not checked and adapter.verifies_digests_locally and manifest.has_digests:
        problems += manifest.digest_mismatches(items)
    if problems:
        raise WeightManifestValidationError(problems)
    ignored = adapter.expected.ignored if adapter.expected is not None else {}
    skipped = [(n, ignored[n]) for n in item_names(items) if n in ignored]
    if isinstance(items, CastItems):
        return items.without(ignored), skipped
    return [(n, t) for n, t in items if n not in ignored], skipped


def cast(
    adapter: CheckedAdapter, manifest: WeightUpdateManifest, items: Items, to: Cast
) -> tuple[WeightUpdateManifest, CastItems]:
    """Check ``items`` against the caller's ``manifest``, then both as the engine will receive them (cast lazily,
    see :mod:`hotweights.core.cast`)."""
    if isinstance(items, CastItems):  # already lazy (a sharded state dict): its manifest was made of it
        lazy = items.recast(cast_targets(manifest, to, adapter.expected))
        return lazy.manifest(manifest), lazy
    problems = manifest.mismatches(items)
    if not problems and manifest.has_digests:
        problems += manifest.digest_mismatches(items)
    if problems:
        raise WeightManifestValidationError(problems)
    lazy = CastItems(items, cast_targets(manifest, to, adapter.expected))
    return lazy.manifest(manifest), lazy


def encode_delta(
    adapter: CheckedAdapter, manifest: WeightUpdateManifest, send: Items, timer: PhaseTimer
) -> tuple[EncodedDelta, StagedDelta]:
    """The delta from the host copy to ``send``, and the same delta staged on the copy (nothing written yet)."""
    state = adapter._delta
    base = state.base
    assert base is not None
    now = adapter._engine_version_now()
    if now is not None and state.engine_version is not None and now != state.engine_version:
        state.base = None  # someone else installed: the next install sends everything
        serving = f"v{now}" if now.isdecimal() else f"version {now!r}"
        raise DeltaBaseMismatchError(manifest.weight_version, base.version, serving)
    with timer("delta_encode"):
        encoded = base.encode(
            send, weight_version=manifest.weight_version, update_id=manifest.update_id, digests=manifest.has_digests
        )
        return encoded, base.staged(encoded)
