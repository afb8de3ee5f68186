"""Delta installs, the worker side: a host copy of the weights last installed, and deltas applied against it.

On CPU a vLLM engine keeps no checkpoint-format copy of its weights (linear weights are repacked into oneDNN
handles, and the layerwise reload rebuilds whole layers), so a worker cannot patch a few elements in place. Once
the trainer uses deltas on an engine (``SessionOptions.keep_base``), each worker keeps a :class:`~hotweights.core.
delta.DeltaBase`: a CPU copy of every tensor it installed, in checkpoint format (one extra copy of the model per
worker, on top of the trainer's one per engine), refreshed by every atomic install and dropped by a streaming one.
An in-process worker keeps none: the trainer's own copy (on the engine's handle) is lent to it for each delta, so
there is one copy in all.

A delta session (:mod:`hotweights.vllm.worker.session` with ``delta`` set) is all or nothing:

1. ``begin``: refused (:class:`~hotweights.DeltaBaseMismatchError`, with the delta's versions and what the worker
   serves) unless the copy is exactly the delta's base version; its wire tensors (indices, values, whole tensors)
   then come as buckets through any transport and are checked against their manifest as they arrive.
2. ``prepare``: every wire tensor arrived; the delta is checked completely (indices in range, sorted, unique,
   counts, dtypes, digests) and the new tensors rebuilt aside. Nothing is written either way.
3. ``commit``: every tensor of each block the delta touched (unchanged parts from the copy: fused q/k/v and gate/up
   are rebuilt from complete parts) goes in by one layerwise reload or the direct setter; only then does the copy
   move to the new version. A failure while writing drops the copy: the next delta is refused until a full install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hotweights.core.delta import DeltaBase, StagedDelta
from hotweights.core.delta_wire import DeltaManifest
from hotweights.core.manifest import TensorSpec, WeightUpdateManifest
from hotweights.transports.shm_base import MappedBase, map_base

if TYPE_CHECKING:
    from hotweights.vllm.worker.staging import InstallSession, StagingArea

__all__ = ["Prepared", "WorkerBase", "begin", "commit", "prepare"]


@dataclass
class WorkerBase:
    """What one worker keeps for delta installs."""

    tracking: bool = False
    """Keep a private copy of every installed version (set once the trainer uses deltas on this engine and cannot
    share its own copy with this worker)."""
    copy: DeltaBase | None = None
    """The weights this worker serves, with their version, for the open delta or kept privately; None: a delta is
    refused unless the trainer shares its copy."""
    served: int | None = None
    """The version this worker's last complete install put in (None: unknown, e.g. after a failed write)."""
    mapped: MappedBase | None = None
    """The trainer's copy, mapped read-only from shared memory (:mod:`hotweights.transports.shm_base`)."""

    def remember(self, manifest: WeightUpdateManifest, items: Any) -> None:
        """After a full install: what it installed, and a private copy of it while tracking."""
        self.served = manifest.weight_version
        self.copy = DeltaBase.capture(items, manifest.weight_version) if self.tracking else None

    def forget(self) -> None:
        """The model changes in a way the copy does not follow (an install starts writing, a streaming one)."""
        self.copy = None
        self.served = None

    def stop(self) -> bool:
        """Stop tracking and free the copy and the mapping; True when there was either."""
        had = self.copy is not None or self.mapped is not None
        self.copy, self.mapped, self.tracking = None, None, False
        return had

    def share(self, descriptor: dict[str, Any]) -> None:
        """Use the trainer's copy in shared memory instead of a private one (mapped once per file)."""
        if self.mapped is None or str(self.mapped.path) != str(descriptor.get("path")):
            self.mapped = map_base(descriptor)
        self.tracking = False
        self.copy = None  # a private copy is no longer needed: free it

    def serving(self, delta: DeltaManifest, shared: bool = False) -> str | None:
        """What this worker serves when it is not ``delta``'s base (None: it is). With ``shared``, the trainer's
        mapped copy must hold the delta's base and this worker must have installed that version last."""
        if shared:
            assert self.mapped is not None
            held = self.mapped.version
            if self.served != delta.base_version:
                return "a version it did not install" if self.served is None else f"v{self.served}"
            if held != delta.base_version:
                return f"v{self.served}, but the trainer's shared copy holds v{held}"
            self.copy = self.mapped.base()
            return None
        if self.copy is None:
            return "a version it keeps no copy of"
        return None if self.copy.version == delta.base_version else f"v{self.copy.version}"


@dataclass
class Prepared:
    """A session ready to commit: what to install, and, for a delta, the delta rebuilt aside."""

    session: InstallSession | None
    items: Any = ()
    staged: StagedDelta | None = None
    delta: DeltaManifest | None = None


def begin(base: WorkerBase, staging: StagingArea, delta: DeltaManifest, wire_json: str | WeightUpdateManifest) -> None:
    """Open the staging of ``delta``'s wire tensors (this worker holds its base: see :meth:`WorkerBase.serving`)."""
    assert base.copy is not None
    want = delta.wire_specs()
    if not want:
        if wire_json:
            raise ValueError(f"delta {delta.update_id} changes nothing but came with a wire manifest")
        return
    if not wire_json:
        raise ValueError(f"delta {delta.update_id} changes {len(delta.entries)} tensors but came without a wire")
    wire = wire_json if isinstance(wire_json, WeightUpdateManifest) else WeightUpdateManifest.from_json(wire_json)
    got = {n: TensorSpec(shape=t.shape, dtype=t.dtype) for n, t in wire.tensors.items()}
    if wire.update_id != delta.update_id or got != want:
        raise ValueError(f"delta {delta.update_id}: the wire manifest does not describe the delta's tensors")
    limit = 2 * base.copy.nbytes + (1 << 20)  # indices and values of every element stay under twice the copy
    if wire.total_bytes > limit:
        raise ValueError(
            f"delta {delta.update_id}: its wire tensors claim {wire.total_bytes} bytes, more than a delta of this "
            f"model can hold ({limit}); send a full update (delta=False)"
        )
    staging.begin(wire_json, check=False)


def prepare(base: WorkerBase, staging: StagingArea, delta: DeltaManifest) -> Prepared:
    """Check the delta against the copy and rebuild its tensors aside; raises
    :class:`~hotweights.WeightManifestValidationError` naming every problem. Nothing is written either way."""
    if base.copy is None:
        raise RuntimeError(f"delta {delta.update_id}: this worker dropped its copy since begin")
    wire: dict[str, Any] = {}
    if delta.entries:
        items, _session = staging.take(delta.update_id)  # raises if a bucket never arrived
        wire = dict(items)
    return Prepared(None, staged=base.copy.apply(delta, wire), delta=delta)


def commit(worker: Any, base: WorkerBase, prepared: Prepared, method: str) -> dict[str, int | str | float]:
    """Install the prepared delta's blocks (``method`` as for a full install), then move the copy on."""
    from hotweights.vllm.worker.ops import after_weights_changed, reload_checkpoint_tensors, worker_model
    from hotweights.vllm.worker.setter import apply_direct, choose_method

    staged, delta = prepared.staged, prepared.delta
    assert staged is not None and delta is not None
    copy = base.copy
    if copy is None:
        raise RuntimeError(f"delta {delta.update_id}: this worker dropped its copy since prepare")
    shared = base.mapped is not None and copy.tensors is base.mapped.tensors
    refreshed, ran, reason = 0, "none", "nothing changed"
    if staged.items:
        specs = {n: TensorSpec.of(t) for n, t in staged.items}
        plan, ran, reason = choose_method(lambda: worker_model(worker), specs, method)
        base.copy = None  # while writing, the copy does not describe the model
        if plan is not None:
            refreshed = apply_direct(worker_model(worker), plan, dict(staged.items))
            after_weights_changed(worker)
        else:
            refreshed = reload_checkpoint_tensors(worker, staged.items)
        base.copy = copy
    base.served = staged.version
    if shared:  # the trainer moves its shared copy once every worker installed the delta
        base.copy = None
    else:
        copy.commit(staged)
    return {
        "tensors": len(staged.items),
        "bytes": staged.nbytes,
        "digests_verified": sum(e.digest is not None for e in delta.entries.values()),
        "tied_layers_refreshed": refreshed,
        "install_method": ran,
        "install_reason": reason,
    }
