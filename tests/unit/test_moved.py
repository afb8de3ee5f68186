"""Old module spellings resolve to the module where the code lives now (``hotweights._moved``): users' launch
scripts name ``hotweights.engine.worker_extension.HotWeightsWorkerExtension``, and their imports the old paths."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hotweights._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_spelling_is_the_same_module(old: str) -> None:
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(MOVED[old])
    assert moved.__spec__ is not None and moved.__spec__.name == MOVED[old]  # its own spec, not the alias's


def test_old_spellings_resolve_in_a_fresh_interpreter_as_vllm_resolves_a_worker_extension() -> None:
    """A vLLM worker imports the extension class by its dotted name before anything else of hotweights."""
    code = (
        "import importlib; "
        "m = importlib.import_module('hotweights.engine.worker_extension'); "
        "from hotweights.engine import compat; "
        "from hotweights.vllm.worker.extension import HotWeightsWorkerExtension as new; "
        "assert m.HotWeightsWorkerExtension is new and compat.WORKER_EXTENSION.endswith('HotWeightsWorkerExtension'); "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_misspelt_module_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hotweights.engine.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hotweights.no_such_package.compat")
