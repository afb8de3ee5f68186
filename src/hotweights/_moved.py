"""Old module spellings: ``import hotweights.engine.worker_extension`` (and every module that moved) still works, and
gives the module where the code lives now (the same object, so classes and patches are shared).

An import hook, installed when this module is first imported (by :mod:`hotweights`, which any ``hotweights.*``
import runs first): it answers only for the names in :data:`MOVED`, so a misspelt module still raises
``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__all__ = ["MOVED", "install_hook"]

#: Old dotted name -> where that module lives now.
MOVED: dict[str, str] = {
    "hotweights.engine.compat": "hotweights.vllm.compat",
    "hotweights.engine.liveness": "hotweights.vllm.liveness",
    "hotweights.engine.expected": "hotweights.vllm.expected",
    "hotweights.engine.tied": "hotweights.vllm.tied",
    "hotweights.engine.vllm_plugin": "hotweights.vllm.plugin",
    "hotweights.engine.worker_extension": "hotweights.vllm.worker.extension",
    "hotweights.engine.session": "hotweights.vllm.worker.session",
    "hotweights.engine.staging": "hotweights.vllm.worker.staging",
    "hotweights.engine.streaming": "hotweights.vllm.worker.streaming",
    "hotweights.engine.readback": "hotweights.vllm.worker.readback",
    "hotweights.engine.direct": "hotweights.vllm.worker.setter",
    "hotweights.engine.delta": "hotweights.vllm.worker.kept_base",
    "hotweights.engine.worker_ops": "hotweights.vllm.worker.ops",
    "hotweights.engine.transfer_engine": "hotweights.vllm.worker.transfer_backend",
    "hotweights.handles.base": "hotweights.handles.handle",
    "hotweights.handles.ray": "hotweights.handles.actor",
    "hotweights.transports.base": "hotweights.transports.transport",
    "hotweights.transports.ray": "hotweights.transports.object_store",
    "hotweights.adapters.base": "hotweights.adapters.contract",
    "hotweights.fleet.report": "hotweights.fleet.outcome",
    "hotweights.adapters._wires": "hotweights.adapters.wires",
}
#: Old packages that no longer exist as folders: an empty package each, so their old submodules resolve.
_PACKAGES = {"hotweights.engine"}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname in _PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in _PACKAGES:
            module = types.ModuleType(spec.name, f"Moved: see {__name__}.MOVED.")
            module.__path__ = []
            return module
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        alias = module.__spec__.name if module.__spec__ is not None else ""
        if alias in self._specs:  # the import gave the module the alias's spec: put its own back
            module.__spec__ = self._specs.pop(alias)


def install_hook() -> None:
    """Answer the old spellings (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


install_hook()
