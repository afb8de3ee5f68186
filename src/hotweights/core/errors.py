"""Every error hotweights raises, rooted at :class:`HotWeightsError`.

Hierarchy::

    HotWeightsError
    ├── WeightManifestValidationError   tensors or manifest do not match (names every mismatch)
    │   └── NonFiniteWeightsError       a tensor holds NaN or Inf (names each one and how many)
    ├── UnsupportedLayoutError          a layout this version or adapter cannot install
    ├── StaleWeightVersionError         weight_version not newer than the active one
    ├── DeltaBaseMismatchError          a delta computed against another version than the engine serves
    ├── EngineNotSupportedError         no adapter fits this engine (or its mode)
    │   └── EngineSleepingError         the engine is asleep: wake it first
    ├── InstallError                    the engine failed while installing
    ├── FleetAbortedError               a fleet replica stopped unwritten: another one failed while staging
    ├── PartialUpdateError              generation refused after an install failed while writing
    │   └── FleetPartialCommitError     a fleet committed on some replicas; the others are fenced
    └── HotWeightsTimeoutError          a wait ran past its timeout (names what it waited for)

Errors from torch or vLLM are mapped with ``raise ... from exc`` so the original stays in the traceback.
Every message says what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DeltaBaseMismatchError",
    "EngineDiedError",
    "EngineNotSupportedError",
    "EngineSleepingError",
    "FamilyProbeError",
    "FleetAbortedError",
    "FleetPartialCommitError",
    "HotWeightsError",
    "HotWeightsTimeoutError",
    "InstallError",
    "Mismatch",
    "NonFiniteWeightsError",
    "PartialUpdateError",
    "StaleWeightVersionError",
    "UnprovenFamilyError",
    "UnsupportedLayoutError",
    "WeightManifestValidationError",
    "WeightVersionUnknownError",
]

MismatchKind = Literal[
    "missing", "unexpected", "shape", "dtype", "nbytes", "not_tensor", "manifest", "digest", "delta", "nonfinite"
]


class HotWeightsError(Exception):
    """Root of every error hotweights raises."""


@dataclass(frozen=True)
class Mismatch:
    """One difference between what was expected and what was given."""

    kind: MismatchKind
    name: str
    expected: str = ""
    actual: str = ""

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"missing tensor {self.name!r} (expected {self.expected})"
        if self.kind == "unexpected":
            return f"unexpected tensor {self.name!r} ({self.actual})"
        if self.kind == "manifest":
            return f"{self.name}: {self.actual}"
        return f"{self.kind} mismatch for {self.name!r}: expected {self.expected}, got {self.actual}"


_HINTS: dict[str, str] = {
    "missing": "send every tensor the engine expects (or build the manifest from the same tensors you send)",
    "unexpected": "drop tensors the engine does not have, or check their names are in checkpoint (HF) format",
    "shape": "send full, unsharded checkpoint-format tensors with the shapes the model was built with",
    "dtype": 'pass cast="engine" to install (floating tensors are cast bucket by bucket as they are sent), or cast '
    "them yourself first, e.g. tensor.to(torch.bfloat16)",
    "nbytes": "make the tensor contiguous and check its dtype and shape",
    "not_tensor": "pass torch.Tensor values",
    "manifest": "fix the manifest fields named above",
    "digest": "the bytes differ from the ones the manifest was built from: rebuild the manifest from these tensors",
    "nonfinite": "the update holds NaN or Inf (a diverged step?): skip this update and install a later, finite one; "
    "install(..., allow_nonfinite=True) installs it anyway",
    "delta": "encode deltas with DeltaBase.encode (sorted unique in-range indices, one value per index), or send a "
    "full update (delta=False)",
}


class WeightManifestValidationError(HotWeightsError):
    """Tensors or a manifest failed validation; nothing was written.

    ``mismatches`` lists every difference found, not just the first.
    """

    def __init__(self, mismatches: Sequence[Mismatch], context: str = "weight update") -> None:
        self.mismatches: tuple[Mismatch, ...] = tuple(mismatches)
        kinds = sorted({m.kind for m in self.mismatches})
        lines = [f"{context} refused, nothing was written: {len(self.mismatches)} mismatch(es)"]
        lines += [f"  - {m}" for m in self.mismatches[:50]]
        if len(self.mismatches) > 50:
            lines.append(f"  ... and {len(self.mismatches) - 50} more (see .mismatches)")
        lines += [f"  fix ({k}): {_HINTS[k]}" for k in kinds]
        super().__init__("\n".join(lines))


class NonFiniteWeightsError(WeightManifestValidationError):
    """A tensor of the update holds NaN or Inf (``mismatches`` names each one and how many); nothing was written and
    the previous version keeps serving. Checked where the bytes already pass (each staged bucket, on the device
    that holds it); ``install(..., allow_nonfinite=True)`` turns the check off."""


class UnsupportedLayoutError(HotWeightsError):
    """The update's :class:`~hotweights.WeightLayout` cannot be installed by this version or adapter."""


class StaleWeightVersionError(HotWeightsError):
    """The update's ``weight_version`` is not newer than the one the engine is serving."""

    def __init__(self, requested: int, active: int) -> None:
        self.requested = requested
        self.active = active
        super().__init__(
            f"weight_version {requested} is not newer than the active version {active}; nothing was written. "
            "Pass a larger weight_version (e.g. the optimizer step), or force=True to install it anyway."
        )


class WeightVersionUnknownError(HotWeightsError):
    """The engine's weight version could not be read, so an older ``weight_version`` could not be told from a newer
    one; nothing was written. The next install asks again."""

    def __init__(self, requested: int, cause: BaseException) -> None:
        self.requested = requested
        super().__init__(
            f"could not read the engine's weight version to check v{requested} against it "
            f"({type(cause).__name__}: {cause}); nothing was written. Retry (the version is read again), or pass "
            "force=True to install without the stale-version check."
        )


class DeltaBaseMismatchError(HotWeightsError):
    """A delta update was computed against another version than the one the engine serves (or the engine keeps
    no copy of it); nothing was written. Send a full update (``delta=False``)."""

    def __init__(self, requested: int, base: int, serving: str) -> None:
        self.requested = requested
        self.base = base
        self.serving = serving
        super().__init__(
            f"delta update to v{requested} was computed against v{base}, but the engine serves {serving}; nothing "
            "was written. Send a full update (install(..., delta=False)); later delta=True installs diff against it."
        )


class EngineNotSupportedError(HotWeightsError):
    """No adapter can install into this engine as it is configured."""


class EngineSleepingError(EngineNotSupportedError):
    """The engine is asleep (``llm.sleep()``): its weights may be offloaded or discarded, and writing to them
    would crash it. Wake it (``llm.wake_up()``) and install again; nothing was written."""


class InstallError(HotWeightsError):
    """The engine raised while installing; the original error is chained as ``__cause__``."""

    origin: str | None = None
    """For an error raised in an engine's process that is not one of hotweights' own (e.g. a ``ValueError`` in a
    worker) and crossed to the trainer as text: the name of its type (:mod:`hotweights.core.envelope`); None
    otherwise."""


class EngineDiedError(InstallError):
    """The engine's process ended while hotweights waited for it: nothing more can be installed into it. Start a new
    engine; its log says why it died."""


class UnprovenFamilyError(EngineNotSupportedError):
    """The model's family is not proven exact on this vLLM and device, and the install could not check it (or was
    told to refuse it); nothing was written."""


class FamilyProbeError(InstallError):
    """After the first install of an unproven family, the engine's output on the probe differed from the reference
    computed from the sent tensors: either vLLM's install of this family is wrong here, or the reference is what
    differs (a freshly started engine on the same weights gives the same output; then ``unproven="trust"``).
    Generation fails closed (:class:`PartialUpdateError`) and the active version is unchanged."""


class PartialUpdateError(HotWeightsError):
    """Generation refused: an install failed after it had started writing, so the engine may hold a mix of old and
    new weights. A successful install (any full update) lifts it; so does ``adapter.reopen_serving()``."""


class FleetAbortedError(HotWeightsError):
    """A replica's install was stopped before it wrote anything because another replica of its fleet failed, or
    the fleet was aborted: every replica keeps serving its previous version."""


class FleetPartialCommitError(PartialUpdateError):
    """A fleet install passed its point of no return and some replicas failed to commit: they are fenced (their
    generation raises :class:`PartialUpdateError` until a later install heals them), the others serve the new
    version. ``report`` (a :class:`~hotweights.fleet.FleetReport`) names both."""

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


class HotWeightsTimeoutError(HotWeightsError, TimeoutError):
    """A wait (rendezvous, RPC, lock) ran past its timeout; the message names what it waited for."""
