"""The public surface: ``hotweights.__all__`` is pinned, documented, and importing it stays light."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import itertools
import subprocess
import sys

import pytest

import hotweights

EXPECTED_ALL = [
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
    "WORKER_EXTENSION",
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

#: Exports that are type aliases (no runtime ``__doc__``): the module whose source documents them.
ALIAS_HOMES = {
    "PrefixCachePolicy": "hotweights.adapters.base",
    "PauseMode": "hotweights.handles.base",
    "WORKER_EXTENSION": "hotweights.engine.compat",
}


def test_all_is_pinned() -> None:
    assert sorted(hotweights.__all__) == EXPECTED_ALL
    assert len(set(hotweights.__all__)) == len(hotweights.__all__)


@pytest.mark.parametrize("name", EXPECTED_ALL)
def test_name_is_importable(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from hotweights import {name}", namespace)
    assert namespace[name] is getattr(hotweights, name)
    assert namespace[name] is not None


def _attribute_docstring(module_name: str, name: str) -> str | None:
    """The string literal right after ``name = ...`` at module level (the Sphinx attribute-docstring form)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    body = tree.body
    for stmt, nxt in itertools.pairwise(body):
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                return nxt.value.value
            return None
    return None


@pytest.mark.parametrize("name", EXPECTED_ALL)
def test_name_has_a_docstring(name: str) -> None:
    obj = getattr(hotweights, name)
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")  # its own, not inherited
    elif inspect.isfunction(obj):
        doc = obj.__doc__
    else:
        assert name in ALIAS_HOMES, f"{name} is neither class nor function; say where it is documented"
        doc = _attribute_docstring(ALIAS_HOMES[name], name)
    assert doc is not None
    assert doc.strip()
    assert not doc.startswith(f"{name}("), "dataclass auto-generated signature, not a docstring"


def test_package_has_docstring_and_version() -> None:
    assert hotweights.__doc__ and "hotweights" in hotweights.__doc__
    assert hotweights.__version__ == importlib.metadata.version("hotweights")


def test_import_does_not_import_vllm() -> None:
    code = (
        "import hotweights, sys\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "assert 'trl' not in sys.modules, 'trl imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
