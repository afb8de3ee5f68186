"""Fleet installs: one trainer installing new weights into many rollout replicas, together or not at all
(:class:`Fleet`), and what such an install costs (:func:`estimate`)."""

from hotweights.fleet.estimate import Calibration, FleetEstimate, estimate
from hotweights.fleet.fleet import Fleet, StagedUpdate
from hotweights.fleet.outcome import Fenced, FleetReport

__all__ = ["Calibration", "Fenced", "Fleet", "FleetEstimate", "FleetReport", "StagedUpdate", "estimate"]
