"""The mends of vLLM's reload (fixes.VLLM_FIXES) apply, and are asked for, only on the vLLM versions that need them;
the contract check holds what each one patches over the same range. The running version is faked (compat reads it
through ``vllm_version``) and the mends are fakes that record being applied: no vLLM class is touched here."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet

from hotweights import EngineNotSupportedError
from hotweights._family import check_mends
from hotweights.handles.parts import ServedModel
from hotweights.testing import tiny_config
from hotweights.vllm import compat, fixes
from tools.vllm_contract import CONTRACT


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fresh state for :func:`fixes.apply_vllm_fixes`: no fix in place, each fix a fake that records its name."""
    calls: list[str] = []

    def fake(name: str) -> object:
        return lambda: calls.append(name) is None

    monkeypatch.setattr(fixes, "_FIXED", set())
    monkeypatch.setattr(fixes, "_MENDS", {name: fake(name) for name in fixes.VLLM_FIXES})
    return calls


def _running(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: version)


def _moe_tied() -> object:
    return tiny_config("qwen3_moe", tie=True)  # needs moe-cpu-prepack and tied-lm-head where vLLM has the defects


class _Model(ServedModel):
    def __init__(self, applied: tuple[str, ...]) -> None:
        super().__init__()
        self.applied = applied

    def config(self) -> object:
        return _moe_tied()

    def vllm_fixes(self) -> tuple[str, ...]:
        return self.applied


class _Handle:
    def __init__(self, applied: tuple[str, ...]) -> None:
        self.model = _Model(applied)


def test_every_mend_says_which_vllm_versions_need_it() -> None:
    assert set(fixes.VLLM_FIXES) == set(fixes._MENDS)
    for name, fix in fixes.VLLM_FIXES.items():
        assert isinstance(fix.vllm, SpecifierSet) and str(fix.vllm), name
        assert SpecifierSet(str(fix.vllm)) == fix.vllm  # the contract gets it as a string
        assert fix.why, name
        # every supported vLLM the defect was read in needs the mend (none of them fixed it yet)
        assert all(fixes.vllm_needs_fix(name, f"{line}.0") for line in compat.SUPPORTED_VLLM), name


def test_outside_its_range_a_mend_is_not_applied_and_not_needed(
    monkeypatch: pytest.MonkeyPatch, applied: list[str]
) -> None:
    _running(monkeypatch, "0.30.2")  # older than any range
    assert fixes.apply_vllm_fixes() == ()
    assert applied == []  # vLLM left as it is
    assert fixes.vllm_fixes_for(_moe_tied()) == ()
    assert fixes.vllm_fixes_missing(("moe-cpu-prepack", "tied-lm-head"), ()) == ()
    check_mends(_Handle(()))  # type: ignore[arg-type]  # nothing needed here: not refused for lacking the mends


def test_a_bounded_mend_is_left_out_above_its_range(monkeypatch: pytest.MonkeyPatch, applied: list[str]) -> None:
    """A mend whose defect a vLLM release fixed (here: faked as fixed in 0.34) is neither applied nor asked for
    there, while the others still are; the local tag of a CPU build does not count."""
    fixed = fixes.VllmFix(fixes.VLLM_FIXES["tied-lm-head"].why, SpecifierSet(">=0.31,<0.34"))
    monkeypatch.setitem(fixes.VLLM_FIXES, "tied-lm-head", fixed)
    _running(monkeypatch, "0.34.0+cpu")
    assert "tied-lm-head" not in fixes.apply_vllm_fixes()
    assert "tied-lm-head" not in applied and "moe-cpu-prepack" in applied
    assert fixes.vllm_fixes_for(_moe_tied()) == ("moe-cpu-prepack",)
    assert fixes.vllm_fixes_for(_moe_tied(), vllm="0.33.1") == ("moe-cpu-prepack", "tied-lm-head")
    check_mends(_Handle(("moe-cpu-prepack",)))  # type: ignore[arg-type]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.34.1", "0.35.0.dev7+g1234abc", "", "dev"])
def test_inside_its_range_or_unreadable_a_mend_is_applied_and_needed(
    monkeypatch: pytest.MonkeyPatch, applied: list[str], version: str
) -> None:
    """In range (a dev build of a later release included), or a version that cannot be read: the conservative
    choice, apply and ask for every mend."""
    _running(monkeypatch, version)
    assert fixes.apply_vllm_fixes() == tuple(sorted(fixes.VLLM_FIXES))
    assert fixes.apply_vllm_fixes() == tuple(sorted(fixes.VLLM_FIXES))  # idempotent
    assert sorted(applied) == sorted(fixes.VLLM_FIXES)  # each applied once
    assert fixes.vllm_fixes_for(_moe_tied()) == ("moe-cpu-prepack", "tied-lm-head")
    gpt_oss = tiny_config("gpt_oss")
    assert "gpt-oss-experts-sinks" in fixes.vllm_fixes_for(gpt_oss)


def test_a_needed_mend_not_in_place_refuses_naming_the_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    _running(monkeypatch, "0.33.0")
    with pytest.raises(EngineNotSupportedError, match=r"vLLM 0\.33\.0's weight reload.*tied-lm-head"):
        check_mends(_Handle(("moe-cpu-prepack",)))  # type: ignore[arg-type]


def test_the_contract_holds_each_mend_over_its_range() -> None:
    """What a mend alone uses is checked exactly on the versions that need the mend (from VLLM_FIXES, not a copy);
    every mend has entries; the tied-head mend reaches a runner in every checked version of its range."""
    by_function = {f"fixes.{mend.__name__}": name for name, mend in fixes._MENDS.items()}
    for function, name in by_function.items():
        assert any(function in e.used_by for e in CONTRACT), f"no contract entry for {name}"
        for entry in (e for e in CONTRACT if e.used_by == function):
            assert entry.vllm == str(fixes.VLLM_FIXES[name].vllm), (entry.symbol, name)
    versions = [f"{line}.0" for line in compat.SUPPORTED_VLLM]  # what `make contract` checks
    runners = {(e.module, e.name.split(".")[0]): e for e in CONTRACT if e.name.endswith(".reload_weights")}
    assert set(fixes.RELOAD_RUNNERS) <= set(runners)
    for version in (v for v in versions if fixes.vllm_needs_fix("tied-lm-head", v)):
        assert any(runners[r].applies_to(version) for r in fixes.RELOAD_RUNNERS), version
