"""Install paths into a vLLM engine: one contract (:class:`WeightInstallAdapter`), one installer over the engine's
handle (:class:`Installer`: the install session through a wire, a transport and :class:`InstallerOptions`, checked
once; or vLLM's own weights path), and its presets for each kind of engine, functions that build an installer:

- :func:`VLLMInProcessAdapter`: an in-process ``LLM``, the install session called directly, tensors handed over
  by reference; ``install_method="auto"`` by default (what ``hotweights.install`` uses), ``"reload"`` or
  ``"direct"``;
- :func:`VLLMDirectSetterAdapter`: the same with ``install_method="direct"``: tensors copied straight into the
  engine's parameters;
- :func:`VLLMMultiprocessAdapter`: an engine started with ``hotweights.WORKER_EXTENSION``, buckets through a
  transport (:mod:`hotweights.transports`);
- :func:`VLLMWeightTransferAdapter`: the same over vLLM's weight-transfer API (the ``"hotweights"`` backend);
- :func:`VLLMWeightsPathAdapter`: any other engine on this host, through a checkpoint directory it reloads.

Every one but the weights path runs the install session (:mod:`hotweights.vllm.worker.session`); every installer
on an engine shares that engine's handle (the install lock, the serving gate, the active version, the delta base).
``hotweights.install`` picks one (``hotweights.adapter_for``); build one yourself to choose its options.
"""

from hotweights.adapters.contract import PrefixCachePolicy, WeightInstallAdapter
from hotweights.adapters.installer import Installer
from hotweights.adapters.options import InstallerOptions
from hotweights.adapters.presets import (
    VLLMDirectSetterAdapter,
    VLLMInProcessAdapter,
    VLLMMultiprocessAdapter,
    VLLMWeightsPathAdapter,
    VLLMWeightTransferAdapter,
)

__all__ = [
    "Installer",
    "InstallerOptions",
    "PrefixCachePolicy",
    "VLLMDirectSetterAdapter",
    "VLLMInProcessAdapter",
    "VLLMMultiprocessAdapter",
    "VLLMWeightTransferAdapter",
    "VLLMWeightsPathAdapter",
    "WeightInstallAdapter",
]
