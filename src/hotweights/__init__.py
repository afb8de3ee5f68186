"""hotweights: install fresh weights into a running vLLM engine — validated, versioned, fast.

Example:
    >>> import hotweights                                                            # doctest: +SKIP
    >>> report = hotweights.install(llm, model.state_dict(), weight_version=step)    # doctest: +SKIP
"""

from hotweights._install import adapter_for, install, install_async
from hotweights.adapters.base import PrefixCachePolicy, WeightInstallAdapter
from hotweights.adapters.direct import VLLMDirectSetterAdapter
from hotweights.adapters.inprocess import VLLMInProcessWeightReloadAdapter
from hotweights.adapters.multiprocess import VLLMMultiprocessAdapter
from hotweights.adapters.native import VLLMWeightTransferAdapter
from hotweights.adapters.weights_path import VLLMWeightsPathAdapter
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    EngineNotSupportedError,
    EngineSleepingError,
    HotWeightsError,
    HotWeightsTimeoutError,
    InstallError,
    Mismatch,
    PartialUpdateError,
    StaleWeightVersionError,
    UnsupportedLayoutError,
    WeightManifestValidationError,
)
from hotweights.core.layout import WeightLayout
from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest
from hotweights.core.report import InstallReport
from hotweights.engine.compat import WORKER_EXTENSION
from hotweights.handles import EngineHandle, PauseMode, as_engine
from hotweights.handles.remote import connect
from hotweights.transports import WeightTransport, available_transports, make_transport, register_transport
from hotweights.versions import WeightVersions, weight_version_of, weight_versions_of

__version__ = "0.1.0"

__all__ = [
    "WORKER_EXTENSION",
    "DeltaBaseMismatchError",
    "EngineHandle",
    "EngineNotSupportedError",
    "EngineSleepingError",
    "ExpectedWeights",
    "HotWeightsError",
    "HotWeightsTimeoutError",
    "InstallError",
    "InstallReport",
    "Mismatch",
    "PartialUpdateError",
    "PauseMode",
    "PrefixCachePolicy",
    "StaleWeightVersionError",
    "TensorSpec",
    "UnsupportedLayoutError",
    "VLLMDirectSetterAdapter",
    "VLLMInProcessWeightReloadAdapter",
    "VLLMMultiprocessAdapter",
    "VLLMWeightTransferAdapter",
    "VLLMWeightsPathAdapter",
    "WeightInstallAdapter",
    "WeightLayout",
    "WeightManifestValidationError",
    "WeightTransport",
    "WeightUpdateManifest",
    "WeightVersions",
    "adapter_for",
    "as_engine",
    "available_transports",
    "connect",
    "install",
    "install_async",
    "make_transport",
    "register_transport",
    "weight_version_of",
    "weight_versions_of",
]
