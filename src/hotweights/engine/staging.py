"""Staging of an install on the engine side: buckets are received and checked aside, the model is untouched.

Shared by the worker extension and the vLLM weight-transfer backend: ``begin`` (manifest) -> ``stage`` per
bucket -> ``take`` (every tensor, in manifest order, only if all arrived) or ``abort``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pydantic
import torch

from hotweights.core.buckets import Bucket, bucket_problems, unpack
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.transports import engine_side

__all__ = ["InstallSession", "StagingArea"]

log = logging.getLogger("hotweights")


@dataclass
class InstallSession:
    """What has been staged for one update."""

    manifest: WeightUpdateManifest
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    keepalive: list[Any] = field(default_factory=list)
    nbytes: int = 0
    digests_verified: int = 0


class StagingArea:
    """At most one open session; ``owner`` is handed to transports that keep state on it (e.g. a group)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.session: InstallSession | None = None

    def begin(self, manifest_json: str) -> str:
        """Open a session; one left open (e.g. by a crashed trainer) is dropped first."""
        manifest = WeightUpdateManifest.from_json(manifest_json)
        if self.session is not None:
            log.warning("hotweights: dropping unfinished update %s", self.session.manifest.update_id)
        self.session = InstallSession(manifest)
        return manifest.update_id

    def current(self, update_id: str) -> InstallSession:
        session = self.session
        if session is None or session.manifest.update_id != update_id:
            active = session.manifest.update_id if session else None
            raise RuntimeError(f"no open install session {update_id!r} on this worker (open: {active!r})")
        return session

    def stage(self, update_id: str, bucket_json: str, descriptor: dict[str, Any]) -> int:
        """Receive one bucket through its transport and keep its tensors aside; returns the bytes staged."""
        session = self.current(update_id)
        try:
            bucket = Bucket.model_validate_json(bucket_json)
        except pydantic.ValidationError as exc:
            raise ValueError(
                f"malformed bucket description: {exc.error_count()} error(s): {exc.errors()[:3]}"
            ) from None
        nbytes = descriptor.get("nbytes") if isinstance(descriptor, dict) else None
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            got = f"{descriptor!r:.120}"
            raise ValueError(f"malformed descriptor: expected a dict with an integer 'nbytes', got {got}")
        # Bound everything by the manifest before the transport allocates or reads a byte.
        problems = bucket_problems(bucket, session.manifest, nbytes)
        problems += [f"{e.name!r} was already staged" for e in bucket.entries if e.name in session.staged]
        if problems:
            raise ValueError(f"bucket {bucket.index} refused before receiving: " + "; ".join(problems))
        try:
            buffer, keepalive = engine_side(descriptor)(descriptor, self.owner)
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:
            name = descriptor.get("transport")
            raise ValueError(f"malformed {name!r} descriptor: {type(exc).__name__}: {exc}") from None
        tensors = dict(unpack(buffer, bucket, session.manifest))
        bad = session.manifest.digest_mismatches(tensors)
        if bad:
            raise ValueError(
                f"bucket {bucket.index}: digest mismatch (bytes changed in transit) for {[m.name for m in bad][:5]}"
            )
        session.digests_verified += sum(session.manifest.tensors[n].digest is not None for n in tensors)
        session.staged.update(tensors)
        session.keepalive.append(keepalive)
        session.nbytes += bucket.nbytes
        return bucket.nbytes

    def take(self, update_id: str) -> tuple[list[tuple[str, torch.Tensor]], InstallSession]:
        """Every staged tensor in manifest order, closing the session; raises if any never arrived."""
        session = self.current(update_id)
        self.session = None  # taken or refused, the session ends here
        missing = [n for n in session.manifest.tensors if n not in session.staged]
        if missing:
            raise ValueError(f"update {update_id} is incomplete: {len(missing)} tensors never arrived: {missing[:5]}")
        return [(n, session.staged[n]) for n in session.manifest.tensors], session

    def abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given)."""
        if self.session is None or (update_id is not None and self.session.manifest.update_id != update_id):
            return False
        self.session = None
        return True
