"""What callers ask of an install path besides installing: its name in reports, what it can do (read back,
deltas), what a fleet asks of a replica's path, and releasing what it holds.

An adapter answers through its :attr:`~PathTraits.path`: :class:`BarePath` for an adapter that reaches its engine
itself (it cuts nothing into buckets, stages nothing apart and holds nothing), the install session over a transport
(:class:`~hotweights.adapters.session.SessionPath`) or vLLM's weights path
(:class:`~hotweights.adapters.weights_path.WeightsPath`) for an :class:`~hotweights.adapters.Installer`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hotweights.adapters.call import Items
from hotweights.adapters.options import InstallerOptions, PathAbilities
from hotweights.core.delta import DeltaBase

__all__ = ["BarePath", "PathTraits"]


class BarePath:
    """The answers of a path that cuts nothing into buckets, stages nothing apart and holds nothing."""

    @property
    def stages_apart(self) -> bool:
        """Whether an install stops, staged, before its first write (at
        :func:`hotweights.core.two_phase.commit_point`), so a fleet can commit every replica or none."""
        return False

    def label(self, name: str) -> str:
        """The name in reports of an adapter called ``name`` on this path."""
        return name

    def abilities(self, label: str) -> PathAbilities:
        """What this path can do (read back, deltas): by default, neither."""
        return PathAbilities(label)

    @property
    def bucket_size(self) -> int | None:
        """Bytes per bucket this path sends (None: it does not cut the update into buckets)."""
        return None

    @property
    def sends_bytes(self) -> bool:
        """Whether an install copies the update's bytes to the engine (False: handed over by reference)."""
        return True

    @property
    def shared_transport(self) -> Any:
        """The transport whose buckets several engines may stage from one copy (None: none)."""
        return None

    def capture_base(self, items: Items, version: int) -> DeltaBase:
        """The host copy of what was just installed, for later deltas."""
        return DeltaBase.capture(items, version)

    def forget_base(self) -> None:
        """Drop what the engine's side keeps for deltas (nothing here)."""

    def close(self) -> None:
        """Release what the path holds (nothing here)."""


class PathTraits:
    """An adapter's answers, from its :attr:`path`."""

    #: Short name used in reports.
    name: ClassVar[str] = "adapter"
    #: The options this path was built with (checked once, when it was built): an installer's own; the defaults
    #: (no read-back by default) for the other paths.
    options: InstallerOptions = InstallerOptions()
    #: How installs reach the engine (see the module's docstring).
    path: BarePath = BarePath()

    @property
    def label(self) -> str:
        """Name used in reports (adapters with a transport add its name)."""
        return self.path.label(self.name)

    @property
    def abilities(self) -> PathAbilities:
        """What this path can do (read back, deltas), against which the options of each install are checked
        (:meth:`InstallerOptions.check_call`)."""
        return self.path.abilities(self.label)

    @property
    def verify(self) -> bool:
        """Default of ``install(verify=...)``."""
        return self.options.verify

    # ------------------------------------------------------------------ what a fleet asks of a replica's adapter
    @property
    def stages_apart(self) -> bool:
        """Whether an install stops, staged, before its first write (at :func:`hotweights.core.two_phase.commit_point`),
        so a fleet can commit every replica or none."""
        return self.path.stages_apart

    @property
    def bucket_size(self) -> int | None:
        """Bytes per bucket this adapter sends (None: it does not cut the update into buckets)."""
        return self.path.bucket_size

    @property
    def sends_bytes(self) -> bool:
        """Whether an install copies the update's bytes to the engine (False: handed over by reference)."""
        return self.path.sends_bytes

    @property
    def shared_transport(self) -> Any:
        """The transport whose buckets several engines may stage from one copy (None: none)."""
        return self.path.shared_transport

    # ------------------------------------------------------------------ resources
    def close(self) -> None:
        """Release what the adapter holds (its transport's buffers and the workers' kept segments)."""
        self.path.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
