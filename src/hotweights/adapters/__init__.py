"""Install paths into a vLLM engine: one contract (:class:`WeightInstallAdapter`), one installer
(:class:`Installer`: a wire, a transport and :class:`InstallerOptions`, checked once), and its named configurations:

- :class:`VLLMInProcessAdapter`: an in-process ``LLM``, the install session called directly, tensors handed over
  by reference; ``install_method="auto"`` by default (what ``hotweights.install`` uses), ``"reload"`` or
  ``"direct"``;
- :class:`VLLMDirectSetterAdapter`: the same with ``install_method="direct"``: tensors copied straight into the
  engine's parameters;
- :class:`VLLMMultiprocessAdapter`: an engine started with ``hotweights.WORKER_EXTENSION``, buckets through a
  transport (:mod:`hotweights.transports`);
- :class:`VLLMWeightTransferAdapter`: the same over vLLM's weight-transfer API (the ``"hotweights"`` backend);
- :class:`VLLMWeightsPathAdapter`: any other engine on this host, through a checkpoint directory it reloads.

Every one but the weights-path adapter runs the install session (:mod:`hotweights.vllm.worker.session`); every adapter
on an engine shares that engine's handle (the serving gate, the active version, the delta base).
``hotweights.install`` picks one (``hotweights.adapter_for``); build one yourself to choose its options.
"""

from hotweights.adapters.contract import PrefixCachePolicy, WeightInstallAdapter
from hotweights.adapters.direct import VLLMDirectSetterAdapter
from hotweights.adapters.inprocess import VLLMInProcessAdapter
from hotweights.adapters.installer import Installer
from hotweights.adapters.multiprocess import VLLMMultiprocessAdapter
from hotweights.adapters.native import VLLMWeightTransferAdapter
from hotweights.adapters.options import InstallerOptions
from hotweights.adapters.weights_path import VLLMWeightsPathAdapter

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
