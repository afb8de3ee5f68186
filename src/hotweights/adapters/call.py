"""One install in progress (:class:`InstallCall`): its phases, and what belongs to it alone, never to the installer
that several installs share."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch

from hotweights.core.report import PhaseTimer
from hotweights.core.two_phase import Member

__all__ = ["InstallCall", "Items"]

Items = Sequence[tuple[str, torch.Tensor]]


class InstallCall(PhaseTimer):
    """One install in progress: its phases, and what belongs to it alone, never to the adapter that several installs
    share: the verify option, whether the engine may have been written, the gate it holds (``writing``), when it
    took it (the start of its stall) and which install path ran."""

    def __init__(
        self, verify: bool = False, *, strict: bool = False, member: Member | None = None, allow_nonfinite: bool = False
    ) -> None:
        super().__init__()
        self.verify = verify
        self.strict = strict
        self.allow_nonfinite = allow_nonfinite
        """Install tensors holding NaN or Inf (by default refused before anything is written)."""
        self.member = member
        """The fleet member this install runs as (None: a plain install): it stops at the fleet's commit point."""
        self.writing = ExitStack()
        self.may_have_written = False
        self.held_since: float | None = None
        self.path: tuple[str, str] | None = None

    def ran(self, method: str, reason: str) -> None:
        """Which install path ran (e.g. ``"direct"``) and why, for the report (``install_method``,
        ``install_reason``)."""
        self.path = (method, reason)

    def untouched(self) -> None:
        """The engine confirmed that nothing was written after the install began writing (it refused the update
        first): a failure now needs no recovery."""
        self.may_have_written = False
