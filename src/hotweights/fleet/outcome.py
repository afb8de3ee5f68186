"""What a fleet install did: :class:`FleetReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotweights.core.report import InstallReport

__all__ = ["Fenced", "FleetReport"]


@dataclass(frozen=True)
class Fenced:
    """A replica that failed after the fleet's point of no return: its generation is refused until an install
    heals it."""

    index: int
    engine: str
    error: str


@dataclass(frozen=True)
class FleetReport:
    """The outcome of one fleet install: a report per replica that serves ``weight_version``, the replicas fenced,
    and what the trainer moved."""

    weight_version: int
    replicas: tuple[InstallReport | None, ...]
    """One per replica, in the fleet's order (None for a fenced one)."""
    engines: tuple[str, ...]
    fenced: tuple[Fenced, ...] = ()
    update_bytes: int = 0
    """Bytes of the update (one replica's worth)."""
    bytes_written: int = 0
    """Bytes the trainer wrote or sent for every replica together: each bucket once per group of replicas that
    share a transport (one host's shared memory, one object-store copy), plus what each other replica was sent
    (in-process replicas take tensors by reference: 0)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds: ``stage`` (every replica validated, received and prepared the update), ``commit`` (every
    replica wrote it, reset its prefix cache and recorded the version)."""

    @property
    def ok(self) -> bool:
        """Every replica serves ``weight_version``."""
        return not self.fenced

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        """Flat figures for metric loggers."""
        return {
            "weight_version": self.weight_version,
            "replicas": len(self.replicas),
            "fenced": len(self.fenced),
            "update_bytes": self.update_bytes,
            "bytes_written": self.bytes_written,
            **{f"{k}_s": v for k, v in self.phases.items()},
        }

    def __str__(self) -> str:
        n = len(self.replicas)
        head = f"fleet v{self.weight_version}: {n - len(self.fenced)}/{n} replicas serve it"
        moved = (
            f"trainer wrote {self.bytes_written / 1e6:.1f} MB for {n} x {self.update_bytes / 1e6:.1f} MB"
            if self.update_bytes
            else ""
        )
        timing = ", ".join(f"{k} {v:.3f} s" for k, v in self.phases.items())
        fenced = "; fenced: " + ", ".join(f"#{f.index} {f.engine} ({f.error})" for f in self.fenced)
        return " | ".join(p for p in (head, moved, timing) if p) + (fenced if self.fenced else "")
