"""The install session's trainer side (:class:`SessionPath`): an installer's path through a wire and a transport.

``begin`` -> every bucket through the transport -> ``prepare`` on every worker -> ``commit``, or ``abort``
(:mod:`hotweights.vllm.worker.session` is the engine's side; :mod:`~hotweights.adapters.sending` moves the
buckets). The wire (:mod:`hotweights.adapters.wires`) carries the session's calls; the transport
(:mod:`hotweights.transports`) the bytes; the installer's :class:`~hotweights.adapters.options.InstallerOptions`
say how the workers install.
"""

from __future__ import annotations

from typing import Any

from hotweights.adapters import sending
from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.options import PathAbilities
from hotweights.adapters.protocols import PathOwner
from hotweights.adapters.sending import bucket_default
from hotweights.adapters.traits import BarePath
from hotweights.core.cast import item_names, lazy_mapping
from hotweights.core.delta import DeltaBase, EncodedDelta, StagedDelta
from hotweights.core.errors import DeltaBaseMismatchError
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.telemetry import best_effort
from hotweights.transports import WeightTransport
from hotweights.transports.shm_base import SharedDeltaBase

__all__ = ["SessionPath"]


class SessionPath(BarePath):
    """The path of an installer that runs the install session: its ``wire``, ``transport`` and ``options``
    (read from the installer at each install). ``label``: the installer's name in reports, where it is not
    made of its name, transport, method and commit mode."""

    def __init__(self, installer: PathOwner, label: str | None = None) -> None:
        self.installer = installer
        self.fixed_label = label

    def label(self, name: str) -> str:
        if self.fixed_label is not None:
            return self.fixed_label
        options, transport = self.installer.options, self.installer.transport
        method = "" if options.install_method in ("auto", "reload") else f"-{options.install_method}"
        commit = "" if options.commit == "atomic" else f"-{options.commit}"
        via = "" if transport.by_reference else f"-{transport.name}"
        return f"{name}{via}{method}{commit}"

    def abilities(self, label: str) -> PathAbilities:
        wire = self.installer.wire
        assert wire is not None  # a session path has a wire
        return PathAbilities(label, reads_back=wire.reads_back, deltas=True, releases_segments=wire.releases_segments)

    @property
    def stages_apart(self) -> bool:
        return self.installer.options.commit == "atomic"

    @property
    def bucket_size(self) -> int | None:
        """Bytes per bucket: ``bucket_bytes``, or the transport's preferred size capped by free memory; None where
        the transport hands the whole update over by reference (one bucket, nothing packed)."""
        transport, options = self.installer.transport, self.installer.options
        if transport.by_reference:
            return None
        return options.bucket_bytes or bucket_default(transport.preferred_bucket_bytes, options.install_method)

    @property
    def sends_bytes(self) -> bool:
        return not self.installer.transport.by_reference

    @property
    def shared_transport(self) -> WeightTransport | None:
        transport = self.installer.transport
        return transport if transport.shareable else None

    # ------------------------------------------------------------------ installs
    def install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, Any]:
        installer = self.installer
        keep = installer._delta.tracking and self.keeps_base_on_workers and not self.shares_base
        sent = _sent_manifest(manifest, item_names(items))
        options = sending.session_options(installer, timer, keep_base=keep)
        return sending.run(installer, sent, options, lazy_mapping(items), timer)

    def install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, Any]:
        installer = self.installer
        dm = delta.manifest
        wire = dm.wire_manifest(delta.wire if manifest.has_digests else None)
        shared = self._shared_base() if self.shares_base else None
        options = sending.session_options(  # a delta is atomic and never read back (check_call refused the others)
            installer,
            timer,
            delta=dm.to_json(),
            keep_base=self.keeps_base_on_workers and shared is None,
            shared_base=shared.descriptor() if shared is not None else None,
        )
        try:
            return sending.run(installer, wire, options, delta.wire, timer)
        except DeltaBaseMismatchError:  # the workers' own, typed: the versions that met are in it
            installer._delta.base = None  # the next install sends everything
            raise

    # ------------------------------------------------------------------ the delta base
    @property
    def keeps_base_on_workers(self) -> bool:
        """Whether the workers keep their own copy for deltas (in-process, the trainer's copy is lent instead)."""
        return not self.installer.transport.by_reference

    @property
    def shares_base(self) -> bool:
        """Whether the workers map the trainer's copy from this host's shared memory instead of keeping their own
        (one copy per host: :mod:`hotweights.transports.shm_base`)."""
        return not self.installer.transport.by_reference and self.installer.engine.workers.same_host

    def capture_base(self, items: Items, version: int) -> DeltaBase:
        if self.shares_base:
            return SharedDeltaBase.capture(items, version)
        return DeltaBase.capture(items, version)

    def _shared_base(self) -> SharedDeltaBase:
        """The trainer's copy, moved into shared memory if it was taken elsewhere (e.g. by another adapter)."""
        state = self.installer._delta
        base = state.base
        assert base is not None
        if not isinstance(base, SharedDeltaBase):
            base = state.base = SharedDeltaBase(base.version, base.tensors)
        return base

    def forget_base(self) -> None:
        if self.keeps_base_on_workers:
            with best_effort("stop the workers' delta copies"):
                self.installer.engine_op("forget_base")

    def close(self) -> None:
        self.installer.transport.close()


def _sent_manifest(manifest: WeightUpdateManifest, tensors: Any) -> WeightUpdateManifest:
    """The manifest of what is actually sent (tensors the engine ignores are left out)."""
    if len(manifest.tensors) == len(names := list(tensors)):
        return manifest
    return manifest.model_copy(update={"tensors": {n: manifest.tensors[n] for n in names}})
