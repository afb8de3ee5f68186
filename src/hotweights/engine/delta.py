"""Delta installs, the worker side: a host copy of the weights last installed, and deltas applied against it.

On CPU a vLLM engine keeps no checkpoint-format copy of its weights (linear weights are repacked into oneDNN
handles, and the layerwise reload rebuilds whole layers), so a worker cannot patch a few elements in place. Once
the trainer asks for deltas (``hotweights_delta_track``), each worker keeps a :class:`~hotweights.core.delta.
DeltaBase`: a CPU copy of every tensor it installed, in checkpoint format (one extra copy of the model per worker).

A delta session mirrors a full one, and is all or nothing:

1. ``begin``: refuse (``{"ok": False, "serving": ...}``) unless the copy is exactly the delta's base version; then
   open an ordinary staging session for the delta's wire tensors (indices, values, whole tensors), which come as
   buckets through any transport and are checked against their manifest as they arrive.
2. ``prepare``: every wire tensor arrived; check the delta completely (indices in range, sorted, unique, counts,
   dtypes, digests) and rebuild the new tensors aside. Returns the problems found (nothing written either way).
3. ``commit``: install every tensor of each block the delta touched (unchanged parts from the copy: fused q/k/v
   and gate/up are rebuilt from complete parts) in one layerwise reload, or by the direct setter; only then does
   the copy move to the new version. A failure while writing drops the copy: the next delta is refused until a
   full install.

A full install (``hotweights_finish``) refreshes the copy while tracking; a streaming one drops it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hotweights.core.delta import DeltaBase, DeltaManifest, StagedDelta
from hotweights.core.errors import WeightManifestValidationError
from hotweights.core.manifest import TensorSpec, WeightUpdateManifest

if TYPE_CHECKING:
    from hotweights.engine.staging import StagingArea

__all__ = ["WorkerDelta", "abort", "begin", "commit", "forget", "prepare", "remember", "state", "track"]

_ATTR = "_hotweights_delta_state"


@dataclass
class WorkerDelta:
    """What one worker keeps for delta installs."""

    tracking: bool = False
    """Keep a copy of every installed version (set by the trainer's first delta install)."""
    base: DeltaBase | None = None
    """Host copy of the weights this worker serves, with their version; None: a delta must be refused."""
    pending: DeltaManifest | None = None
    """The delta of the open session."""
    staged: StagedDelta | None = None
    """The open delta, checked and rebuilt aside (after ``prepare``)."""


def state(worker: Any) -> WorkerDelta:
    """The worker's delta state (created on first use)."""
    s = getattr(worker, _ATTR, None)
    if s is None:
        s = WorkerDelta()
        setattr(worker, _ATTR, s)
    assert isinstance(s, WorkerDelta)
    return s


def track(worker: Any, on: bool) -> bool:
    """Start keeping copies of installed weights (from the next full install on), or stop and free the copy."""
    s = state(worker)
    s.tracking = bool(on)
    if not s.tracking:
        s.base = None
    return s.base is not None


def remember(worker: Any, manifest: WeightUpdateManifest, items: list[tuple[str, torch.Tensor]]) -> None:
    """After a full install: keep a copy of what was installed (while tracking)."""
    s = state(worker)
    s.base = DeltaBase.capture(items, manifest.weight_version) if s.tracking else None


def forget(worker: Any) -> None:
    """The model changes in a way the copy does not follow (a full install starts writing, a streaming one)."""
    state(worker).base = None


def begin(worker: Any, staging: StagingArea, delta_json: str, wire_json: str) -> dict[str, Any]:
    """Open a delta session if this worker holds the delta's base; ``{"ok": bool, "serving": str}``."""
    delta = DeltaManifest.from_json(delta_json)
    s = state(worker)
    s.pending = s.staged = None
    if s.base is None or s.base.version != delta.base_version:
        serving = "a version it keeps no copy of" if s.base is None else f"v{s.base.version}"
        return {"ok": False, "serving": serving}
    want = delta.wire_specs()
    if wire_json:
        wire = WeightUpdateManifest.from_json(wire_json)
        got = {n: TensorSpec(shape=t.shape, dtype=t.dtype) for n, t in wire.tensors.items()}
        if wire.update_id != delta.update_id or got != want:
            raise ValueError(f"delta {delta.update_id}: the wire manifest does not describe the delta's tensors")
        limit = 2 * s.base.nbytes + (1 << 20)  # indices and values of every element stay under twice the copy
        if wire.total_bytes > limit:
            raise ValueError(
                f"delta {delta.update_id}: its wire tensors claim {wire.total_bytes} bytes, more than a delta of this "
                f"model can hold ({limit}); send a full update (delta=False)"
            )
        staging.begin(wire_json, check=False)
    elif want:
        raise ValueError(f"delta {delta.update_id} changes {len(delta.entries)} tensors but came without a wire")
    s.pending = delta
    return {"ok": True, "serving": f"v{s.base.version}"}


def prepare(worker: Any, staging: StagingArea, update_id: str) -> list[dict[str, str]]:
    """Check the delta against the copy and rebuild its tensors aside; the problems found (as dicts of
    :class:`~hotweights.Mismatch` fields), empty when it applies. Nothing is written either way."""
    s = state(worker)
    delta = s.pending
    if delta is None or delta.update_id != update_id or s.base is None:
        raise RuntimeError(f"no open delta session {update_id!r} on this worker")
    wire: dict[str, torch.Tensor] = {}
    if delta.entries:
        items, _session = staging.take(update_id)  # raises if a bucket never arrived; the session keeps buffers
        wire = dict(items)
    try:
        s.staged = s.base.apply(delta, wire)
    except WeightManifestValidationError as exc:
        s.pending = None
        return [{k: str(v) for k, v in dataclasses.asdict(m).items()} for m in exc.mismatches]
    return []


def commit(worker: Any, update_id: str, method: str) -> dict[str, int | str]:
    """Install the prepared delta's blocks (``method``: ``"auto"``, ``"reload"`` or ``"direct"``, as for a full
    install), then move the copy on."""
    from hotweights.engine.direct import apply_direct, choose_method
    from hotweights.engine.worker_ops import after_weights_changed, reload_checkpoint_tensors, worker_model

    s = state(worker)
    staged, delta = s.staged, s.pending
    if staged is None or delta is None or delta.update_id != update_id or s.base is None:
        raise RuntimeError(f"delta {update_id!r} was not prepared on this worker")
    s.pending = s.staged = None
    refreshed, ran, reason = 0, "none", "nothing changed"
    if staged.items:
        specs = {n: TensorSpec.of(t) for n, t in staged.items}
        plan, ran, reason = choose_method(lambda: worker_model(worker), specs, method)
        base, s.base = s.base, None  # while writing, the copy does not describe the model
        if plan is not None:
            refreshed = apply_direct(worker_model(worker), plan, dict(staged.items))
            after_weights_changed(worker)
        else:
            refreshed = reload_checkpoint_tensors(worker, staged.items)
        s.base = base
    s.base.commit(staged)
    return {
        "tensors": len(staged.items),
        "bytes": staged.nbytes,
        "digests_verified": sum(e.digest is not None for e in delta.entries.values()),
        "tied_layers_refreshed": refreshed,
        "install_method": ran,
        "install_reason": reason,
    }


def abort(worker: Any, staging: StagingArea, update_id: str | None) -> bool:
    """Drop the open delta session (only ``update_id``'s when given); the model and the copy are untouched."""
    s = state(worker)
    if s.pending is None or (update_id is not None and s.pending.update_id != update_id):
        return False
    staging.abort(s.pending.update_id)
    s.pending = s.staged = None
    return True
