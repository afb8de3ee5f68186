"""The engine side of every multiprocess transport, as a vLLM worker extension.

Start the engine with ``LLM(..., worker_extension_cls=hotweights.WORKER_EXTENSION)``; the methods below are then
reachable by name through ``collective_rpc`` (strings, ints, bytes and JSON only: no pickle anywhere).

An install is a *session*: ``begin`` (manifest) -> ``stage`` per bucket -> ``finish``. Staging only maps or
copies bytes aside and checks them against the manifest; nothing touches the model until ``finish``, which
installs every staged tensor in one layerwise reload. So a fused parameter whose parts arrive in different buckets
is still correct, and ``abort`` (or a trainer that never comes back) leaves the previous weights serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hotweights.core.buckets import Bucket, unpack
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.engine.worker_ops import reload_checkpoint_tensors
from hotweights.transports import engine_side

__all__ = ["HotWeightsWorkerExtension", "InstallSession"]

log = logging.getLogger("hotweights")


@dataclass
class InstallSession:
    """What a worker has staged for one update."""

    manifest: WeightUpdateManifest
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    keepalive: list[Any] = field(default_factory=list)
    nbytes: int = 0


class HotWeightsWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; every method is prefixed ``hotweights_``."""

    _hotweights_session: InstallSession | None = None

    def hotweights_begin(self, manifest_json: str) -> str:
        """Open a session for an update; a session left open by a crashed trainer is dropped first."""
        manifest = WeightUpdateManifest.from_json(manifest_json)
        old = self._hotweights_session
        if old is not None:
            log.warning("hotweights: dropping unfinished update %s for %s", old.manifest.update_id, manifest.update_id)
        self._hotweights_session = InstallSession(manifest)
        return manifest.update_id

    def _hotweights_current(self, update_id: str) -> InstallSession:
        session = self._hotweights_session
        if session is None or session.manifest.update_id != update_id:
            active = session.manifest.update_id if session else None
            raise RuntimeError(f"no open install session {update_id!r} on this worker (open: {active!r})")
        return session

    def hotweights_stage(self, update_id: str, bucket_json: str, descriptor: dict[str, Any]) -> int:
        """Receive one bucket through its transport and keep its tensors aside; returns the bytes staged."""
        session = self._hotweights_current(update_id)
        bucket = Bucket.model_validate_json(bucket_json)
        repeated = [e.name for e in bucket.entries if e.name in session.staged]
        if repeated:
            raise ValueError(f"bucket {bucket.index} repeats tensors already staged: {repeated[:5]}")
        buffer, keepalive = engine_side(descriptor)(descriptor, self)
        if buffer.numel() < bucket.nbytes:
            raise ValueError(f"bucket {bucket.index}: received {buffer.numel()} bytes, expected {bucket.nbytes}")
        session.staged.update(unpack(buffer, bucket, session.manifest))
        session.keepalive.append(keepalive)
        session.nbytes += bucket.nbytes
        return bucket.nbytes

    def hotweights_finish(self, update_id: str) -> dict[str, int]:
        """Install every staged tensor in one layerwise reload, if and only if all of them arrived."""
        session = self._hotweights_current(update_id)
        missing = [n for n in session.manifest.tensors if n not in session.staged]
        if missing:
            raise ValueError(f"update {update_id} is incomplete: {len(missing)} tensors never arrived: {missing[:5]}")
        try:
            items = [(n, session.staged[n]) for n in session.manifest.tensors]
            refreshed = reload_checkpoint_tensors(self, items)
        finally:
            self._hotweights_session = None
        return {"tensors": len(items), "bytes": session.nbytes, "tied_layers_refreshed": refreshed}

    def hotweights_abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given); the model was never touched."""
        session = self._hotweights_session
        if session is None or (update_id is not None and session.manifest.update_id != update_id):
            return False
        self._hotweights_session = None
        return True

    def hotweights_init_communicator(
        self, host: str, port: int, world_size: int, backend: str = "gloo", timeout: float = 60.0
    ) -> int:
        """Join the trainer's collective group (closing a stale one first); returns this worker's group rank."""
        from hotweights.transports.collective import init_worker_group

        init_worker_group(self, host, port, world_size, backend, timeout)
        return 1 + int(getattr(self, "rank", 0))

    def hotweights_close_communicator(self) -> bool:
        """Drop the collective group, if any."""
        from hotweights.transports.collective import close_group

        return close_group(self)

    def hotweights_ping(self) -> str:
        """Cheap round trip; tells the trainer the extension is loaded."""
        return "hotweights"
