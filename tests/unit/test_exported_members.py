"""The public surface: ``hotweights.__all__`` and ``hotweights.adapters.__all__`` are pinned and documented, names
that live in a submodule are exported there only (no alias or import hook for old spellings), and importing
``hotweights`` stays light."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import itertools
import subprocess
import sys
import types

import pytest

import hotweights

EXPECTED_ALL = [
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
    "WORKER_EXTENSION",
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

#: The adapter names exported by ``hotweights.adapters`` only.
SUBMODULE_ADAPTERS = [
    "PrefixCachePolicy",
    "VLLMDirectSetterAdapter",
    "VLLMMultiprocessAdapter",
    "VLLMWeightTransferAdapter",
    "VLLMWeightsPathAdapter",
    "WeightInstallAdapter",
]
EXPECTED_ADAPTERS_ALL = sorted([*SUBMODULE_ADAPTERS, "Installer", "InstallerOptions", "VLLMInProcessAdapter"])

#: Names exported by a submodule, not by ``hotweights`` -> that submodule.
MOVED = {
    **dict.fromkeys(SUBMODULE_ADAPTERS, "hotweights.adapters"),
    **dict.fromkeys(["EngineHandle", "PauseMode", "as_engine"], "hotweights.handles"),
    **dict.fromkeys(
        ["WeightTransport", "available_transports", "make_transport", "register_transport"], "hotweights.transports"
    ),
    "WeightVersions": "hotweights.versions",
}

#: Exports that are type aliases (no runtime ``__doc__``): the module whose source documents them.
ALIAS_HOMES = {
    "PrefixCachePolicy": "hotweights.adapters.contract",
    "PauseMode": "hotweights.handles.handle",
    "WORKER_EXTENSION": "hotweights.vllm.introspect",
}


def test_all_is_pinned() -> None:
    assert sorted(hotweights.__all__) == EXPECTED_ALL
    assert len(set(hotweights.__all__)) == len(hotweights.__all__)


def test_adapters_all_is_pinned() -> None:
    import hotweights.adapters

    assert sorted(hotweights.adapters.__all__) == EXPECTED_ADAPTERS_ALL
    assert len(set(hotweights.adapters.__all__)) == len(hotweights.adapters.__all__)
    assert hotweights.adapters.__doc__ and hotweights.adapters.__doc__.strip()


def test_submodule_names_are_in_their_homes_all() -> None:
    assert not set(MOVED) & set(EXPECTED_ALL)
    assert len(MOVED) + len(EXPECTED_ALL) == 38 + 12  # + Fleet, its 2 errors, 5 errors, detach, 4 LoRA verbs
    for name, home in MOVED.items():
        assert name in importlib.import_module(home).__all__, (name, home)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_submodule_name_is_not_served_by_the_top_level(name: str) -> None:
    assert not hasattr(hotweights, name)
    with pytest.raises(ImportError):
        exec(f"from hotweights import {name}", {})


def test_no_import_hook_for_old_module_spellings() -> None:
    """hotweights was never released under other module names: nothing answers them (issue 44: no shims)."""
    code = (
        "import sys, hotweights\n"
        "assert not [f for f in sys.meta_path if type(f).__module__.startswith('hotweights')], sys.meta_path\n"
        "for old in ('hotweights.engine.worker_extension', 'hotweights.handles.base', 'hotweights.adapters.base'):\n"
        "    try:\n"
        "        __import__(old)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(old + ' still imports')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_dir_shows_only_the_surface() -> None:
    listed = set(dir(hotweights))
    assert set(EXPECTED_ALL) <= listed
    assert not set(MOVED) & listed
    extra = {
        n
        for n in listed - set(EXPECTED_ALL)
        if not n.startswith("_") and not isinstance(getattr(hotweights, n), types.ModuleType)
    }
    assert not extra, f"public non-module names outside __all__: {sorted(extra)}"


def test_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = hotweights.NoSuchName
    assert not hasattr(hotweights, "NoSuchName")


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


@pytest.mark.parametrize("name", EXPECTED_ALL + sorted(MOVED))
def test_name_has_a_docstring(name: str) -> None:
    obj = getattr(importlib.import_module(MOVED.get(name, "hotweights")), name)
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
