"""What an install did: :class:`InstallReport`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["InstallReport", "PhaseTimer"]


class InstallReport(BaseModel):
    """The outcome of one successful install.

    ``phases`` holds wall seconds per phase, in order (e.g. ``validate``, ``install``, ``reset_prefix_cache``).
    ``str(report)`` is the one-line summary that :mod:`hotweights.telemetry` logs; :meth:`to_dict` flattens it
    for metric loggers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    update_id: str
    weight_version: int
    previous_version: int | None
    """The version served before this install (None: the weights the engine started with)."""
    adapter: str
    """Name of the adapter that installed (e.g. ``"inprocess-reload"``)."""
    num_tensors: int
    """Tensors installed into the engine."""
    num_bytes: int
    """Bytes of those tensors."""
    skipped: tuple[str, ...] = ()
    """Tensors accepted but not sent, each with the reason (e.g. a tied ``lm_head.weight``)."""
    prefix_cache_reset: bool
    """Whether the engine's prefix cache was reset after the install."""
    engine_weight_version: str | None = None
    """The version recorded in the engine itself, where vLLM keeps one."""
    digests_verified: int = 0
    """Tensors whose digest the engine checked after transit (0 where nothing crossed a process boundary: in-process,
    tensors by reference; and on the zero-config path, whose reload checks none; the trainer checks the manifest's
    digests locally before writing on those paths)."""
    install_method: str | None = None
    """How the engine's workers wrote the weights, where the adapter chooses: ``"direct"`` (the direct setter) or
    ``"reload"`` (vLLM's layerwise reload); None where the adapter has one way only and does not say."""
    install_reason: str | None = None
    """Why ``install_method`` ran (e.g. ``install_method='auto'``'s verdict on the model)."""
    readback_verified: int | None = None
    """``install(..., verify=True)`` only: checkpoint tensors read back from the live parameters after the commit,
    equal to what was sent (each worker's slice; the fewest over workers). None: not verified."""
    readback_unreadable: int | None = None
    """``verify=True`` only: tensors whose parameter holds no data to read (on CPU vLLM packs linear weights into
    oneDNN handles, leaving 0-element parameters), so they were not compared."""
    readback_note: str | None = None
    """``verify=True`` only: why some tensors could not be read back (e.g. the layer class keeps no readable
    layout); starts with "nothing could be read back" when no tensor could be compared."""
    phases: dict[str, float] = Field(default_factory=dict)
    bytes_sent: int = -1
    """Bytes that crossed to the engine: ``num_bytes`` for a full install, the delta's indices and values for a
    delta install (filled from ``num_bytes`` when not given)."""
    delta: Literal["off", "full", "applied"] = "off"
    """``install(..., delta=True)`` only: ``"applied"`` (only what changed was sent) or ``"full"`` (everything was
    sent: the first install into this engine, or the first after a failed one, has no base to diff against).
    ``"off"``: a plain full install."""
    delta_changed: int = 0
    """Tensors that changed since the delta's base (``delta="applied"``); the others were not sent."""
    cast_tensors: int = 0
    """``install(..., cast=...)`` only: tensors cast to the engine's dtype on the way in (``num_bytes`` counts them
    after the cast)."""
    stall_s: float | None = None
    """Seconds this install held generation off: from the moment it held the engine's gate (running generation calls
    finished, or an ``AsyncLLM``'s scheduler paused) until generation was let back in (the write, the prefix-cache
    reset, the version record and, for an ``AsyncLLM``, the resume). Staging (``begin``, ``transfer``, ``prepare``)
    runs before it, while the engine serves the old weights; a streaming commit holds the gate from its first bucket,
    so its transfer counts. None where the install holds no gate (an adapter built with ``guard_generation=False``)."""
    family_check: str | None = None
    """How the model's family was guarded: ``"proven: ..."`` (the conformance matrix ran it on this vLLM and
    device), ``"unproven: ..., probed at vN: max |dlogprob| x <= tol"`` (the engine scored a probe against the sent
    tensors after the first install), or ``"unproven: ..., trusted"`` (``unproven="trust"``). None: not checked
    (an adapter driven directly)."""

    @model_validator(mode="before")
    @classmethod
    def _bytes_sent_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("bytes_sent", -1) == -1 and "num_bytes" in data:
            return {**data, "bytes_sent": data["num_bytes"]}
        return data

    @property
    def seconds(self) -> float:
        """Total wall time of the install."""
        return sum(self.phases.values())

    @property
    def gbps(self) -> float:
        """Installed gigabytes (1e9 bytes) per second of total time."""
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self, prefix: str = "hotweights/") -> dict[str, float | int | str | bool | None]:
        """The report as one flat dict of scalars, for metric loggers (wandb, trackio, TensorBoard).

        Keys are ``prefix`` + the field name; ``skipped`` becomes its count (``num_skipped``), the totals
        ``seconds`` and ``gbps`` are included (``gbps`` is None when no time was measured), and each phase becomes
        ``phase/<name>_s``.

        Args:
            prefix: put before every key; ``""`` for bare names.

        Examples:
            >>> r = InstallReport(update_id="u1", weight_version=12, previous_version=11, adapter="multiprocess-shm",
            ...                   num_tensors=27, num_bytes=2_000_000, prefix_cache_reset=True,
            ...                   phases={"validate": 0.001, "transfer": 0.003})
            >>> d = r.to_dict()
            >>> d["hotweights/weight_version"], d["hotweights/gbps"], d["hotweights/phase/transfer_s"]
            (12, 0.5, 0.003)
            >>> sorted(r.to_dict(prefix=""))[:4]
            ['adapter', 'digests_verified', 'engine_weight_version', 'gbps']
        """
        seconds = self.seconds
        flat: dict[str, float | int | str | bool | None] = {
            "update_id": self.update_id,
            "weight_version": self.weight_version,
            "previous_version": self.previous_version,
            "adapter": self.adapter,
            "num_tensors": self.num_tensors,
            "num_bytes": self.num_bytes,
            "num_skipped": len(self.skipped),
            "prefix_cache_reset": self.prefix_cache_reset,
            "engine_weight_version": self.engine_weight_version,
            "digests_verified": self.digests_verified,
            **({"install_method": self.install_method} if self.install_method is not None else {}),
            **({"install_reason": self.install_reason} if self.install_reason is not None else {}),
            **({"readback_verified": self.readback_verified} if self.readback_verified is not None else {}),
            **({"readback_unreadable": self.readback_unreadable} if self.readback_unreadable is not None else {}),
            **({"readback_note": self.readback_note} if self.readback_note else {}),
            "seconds": seconds,
            "gbps": self.gbps if seconds > 0 else None,
        }
        if self.cast_tensors:
            flat["cast_tensors"] = self.cast_tensors
        if self.stall_s is not None:
            flat["stall_s"] = self.stall_s
        if self.delta != "off":  # delta installs add what was sent (a full install sends num_bytes)
            flat.update({"bytes_sent": self.bytes_sent, "delta": self.delta, "delta_changed": self.delta_changed})
        flat.update({f"phase/{name}_s": s for name, s in self.phases.items()})
        return {prefix + key: value for key, value in flat.items()}

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.phases.items())
        if self.delta == "applied":
            phases += (
                f"; delta: {self.delta_changed} tensors changed, {self.bytes_sent / 1e6:.2f} MB sent "
                f"({self.bytes_sent / max(self.num_bytes, 1):.1%} of a full install)"
            )
        elif self.delta == "full":
            phases += "; delta: sent in full (no base to diff against yet)"
        if self.cast_tensors:
            phases += f"; {self.cast_tensors} tensors cast on the way in"
        if self.family_check and not self.family_check.startswith("proven"):
            phases += f"; family {self.family_check}"
        return (
            f"installed v{self.weight_version} ({self.num_tensors} tensors, {self.num_bytes / 1e6:.1f} MB) via "
            f"{self.adapter}{self._path_text()} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s): {phases}"
        )

    def _path_text(self) -> str:
        text = ""
        if self.install_method is not None:
            text = f" [{self.install_method}" + (f": {self.install_reason}]" if self.install_reason else "]")
        if self.readback_verified is not None:
            text += f" (read back: {self.readback_verified} tensors equal, {self.readback_unreadable or 0} unreadable"
            text += f"; {self.readback_note})" if self.readback_note else ")"
        return text


class PhaseTimer:
    """Collects wall seconds per named phase.

    Examples:
        >>> t = PhaseTimer()
        >>> with t("validate"):
        ...     pass
        >>> list(t.phases)
        ['validate']
    """

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` to phase ``name`` (for a phase that ends inside a callback)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds
