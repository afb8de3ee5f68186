"""hotweights: install fresh weights into a running vLLM engine — validated, versioned, fast.

The top level holds the verbs (``install``, ``install_async``, ``install_lora``, ``connect``, ``adapter_for``,
``detach``, ``weight_version_of``, ``weight_versions_of``, ``lora_version_of``), ``Fleet`` (one install into many
replicas: :mod:`hotweights.fleet`), the types a caller handles (manifests, specs, layouts, reports,
``WORKER_EXTENSION``) and every error. The rest lives in its submodule: adapter classes in :mod:`hotweights.adapters`,
engine handles in :mod:`hotweights.handles`, transports in :mod:`hotweights.transports`, ``WeightVersions`` in
:mod:`hotweights.versions`.

Example:
    >>> import hotweights                                                            # doctest: +SKIP
    >>> report = hotweights.install(llm, model.state_dict(), weight_version=step)    # doctest: +SKIP
"""

from hotweights._install import adapter_for, detach, install, install_async
from hotweights._lora import install_lora, install_lora_async, lora_request
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    EngineDiedError,
    EngineNotSupportedError,
    EngineSleepingError,
    FamilyProbeError,
    FleetAbortedError,
    FleetPartialCommitError,
    HotWeightsError,
    HotWeightsTimeoutError,
    InstallError,
    Mismatch,
    NonFiniteWeightsError,
    PartialUpdateError,
    StaleWeightVersionError,
    UnprovenFamilyError,
    UnsupportedLayoutError,
    WeightManifestValidationError,
    WeightVersionUnknownError,
)
from hotweights.core.layout import WeightLayout
from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest
from hotweights.core.report import InstallReport
from hotweights.fleet import Fleet
from hotweights.handles.remote import connect
from hotweights.versions import lora_version_of, weight_version_of, weight_versions_of
from hotweights.vllm.introspect import WORKER_EXTENSION

__version__ = "0.1.0"

__all__ = [
    "WORKER_EXTENSION",
    "DeltaBaseMismatchError",
    "EngineDiedError",
    "EngineNotSupportedError",
    "EngineSleepingError",
    "ExpectedWeights",
    "FamilyProbeError",
    "Fleet",
    "FleetAbortedError",
    "FleetPartialCommitError",
    "HotWeightsError",
    "HotWeightsTimeoutError",
    "InstallError",
    "InstallReport",
    "Mismatch",
    "NonFiniteWeightsError",
    "PartialUpdateError",
    "StaleWeightVersionError",
    "TensorSpec",
    "UnprovenFamilyError",
    "UnsupportedLayoutError",
    "WeightLayout",
    "WeightManifestValidationError",
    "WeightUpdateManifest",
    "WeightVersionUnknownError",
    "adapter_for",
    "connect",
    "detach",
    "install",
    "install_async",
    "install_lora",
    "install_lora_async",
    "lora_request",
    "lora_version_of",
    "weight_version_of",
    "weight_versions_of",
]
