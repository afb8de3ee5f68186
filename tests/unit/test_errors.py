"""The error hierarchy and the messages it carries."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import hotweights
from hotweights import (
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
from hotweights.core import errors as errors_module
from hotweights.core.errors import MismatchKind

PUBLIC_ERRORS = [
    DeltaBaseMismatchError,
    EngineDiedError,
    EngineNotSupportedError,
    EngineSleepingError,
    FleetAbortedError,
    FleetPartialCommitError,
    HotWeightsTimeoutError,
    InstallError,
    PartialUpdateError,
    StaleWeightVersionError,
    UnsupportedLayoutError,
    WeightManifestValidationError,
    WeightVersionUnknownError,
    FamilyProbeError,
    UnprovenFamilyError,
    NonFiniteWeightsError,
]

ALL_KINDS: tuple[str, ...] = typing.get_args(MismatchKind)


@pytest.mark.parametrize("cls", PUBLIC_ERRORS, ids=lambda c: c.__name__)
def test_public_error_subclasses_root(cls: type[Exception]) -> None:
    assert issubclass(cls, HotWeightsError)
    assert cls is not HotWeightsError


def test_every_exported_exception_is_listed_and_rooted() -> None:
    exported = {
        name
        for module in (hotweights, errors_module)
        for name in module.__all__
        if isinstance(getattr(module, name), type) and issubclass(getattr(module, name), BaseException)
    }
    assert exported == {c.__name__ for c in PUBLIC_ERRORS} | {"HotWeightsError"}
    for name in exported:
        assert issubclass(getattr(hotweights, name), HotWeightsError)


def test_root_is_a_plain_exception_and_timeout_is_a_timeout() -> None:
    assert issubclass(HotWeightsError, Exception)
    assert issubclass(HotWeightsTimeoutError, TimeoutError)
    with pytest.raises(TimeoutError):
        raise HotWeightsTimeoutError("rendezvous")


def test_stale_version_error() -> None:
    err = StaleWeightVersionError(3, 7)
    assert (err.requested, err.active) == (3, 7)
    msg = str(err)
    assert msg.startswith("weight_version 3 is not newer than the active version 7; nothing was written.")
    assert "Pass a larger weight_version" in msg
    assert "force=True" in msg


@pytest.mark.parametrize(
    ("mismatch", "text"),
    [
        (
            Mismatch("missing", "w", expected="[2] torch.float32"),
            "missing tensor 'w' (expected [2] torch.float32)",
        ),
        (Mismatch("unexpected", "x", actual="[3] torch.int8"), "unexpected tensor 'x' ([3] torch.int8)"),
        (Mismatch("manifest", "tensors.w.dtype", actual="bad dtype"), "tensors.w.dtype: bad dtype"),
        (
            Mismatch("shape", "w", expected="[2, 3]", actual="[3, 2]"),
            "shape mismatch for 'w': expected [2, 3], got [3, 2]",
        ),
        (
            Mismatch("dtype", "w", expected="torch.bfloat16", actual="torch.float32"),
            "dtype mismatch for 'w': expected torch.bfloat16, got torch.float32",
        ),
    ],
)
def test_mismatch_str(mismatch: Mismatch, text: str) -> None:
    assert str(mismatch) == text


def test_mismatch_is_frozen_value() -> None:
    m = Mismatch("missing", "w")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.name = "v"  # type: ignore[misc]
    assert m == Mismatch("missing", "w", "", "")
    assert hash(m) == hash(Mismatch("missing", "w"))


def test_validation_error_header_and_context() -> None:
    err = WeightManifestValidationError([Mismatch("missing", "a"), Mismatch("missing", "b")])
    lines = str(err).splitlines()
    assert lines[0] == "weight update refused, nothing was written: 2 mismatch(es)"
    assert lines[1] == "  - missing tensor 'a' (expected )"
    assert lines[2] == "  - missing tensor 'b' (expected )"
    assert len(lines) == 4  # one fix line for the one kind
    custom = WeightManifestValidationError([Mismatch("manifest", "x", actual="y")], context="manifest")
    assert str(custom).startswith("manifest refused, nothing was written: 1 mismatch(es)")
    assert isinstance(err.mismatches, tuple)


def test_validation_error_truncates_beyond_fifty() -> None:
    mismatches = [Mismatch("missing", f"w{i}") for i in range(60)]
    err = WeightManifestValidationError(mismatches)
    msg = str(err)
    assert len(err.mismatches) == 60
    assert "60 mismatch(es)" in msg
    assert "'w49'" in msg
    assert "'w50'" not in msg
    assert "'w59'" not in msg
    assert "  ... and 10 more (see .mismatches)" in msg
    assert msg.count("  - ") == 50
    assert "fix (missing):" in msg  # hints still come after the truncation


def test_exactly_fifty_is_not_truncated() -> None:
    msg = str(WeightManifestValidationError([Mismatch("missing", f"w{i}") for i in range(50)]))
    assert "'w49'" in msg
    assert "more" not in msg


def test_kinds_cover_the_documented_set() -> None:
    assert set(ALL_KINDS) == {
        "missing", "unexpected", "shape", "dtype", "nbytes", "not_tensor", "manifest", "digest", "delta",
        "nonfinite",
    }  # fmt: skip


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_each_kind_has_a_fix_hint_line(kind: str) -> None:
    msg = str(WeightManifestValidationError([Mismatch(kind, "t", expected="e", actual="a")]))  # type: ignore[arg-type]
    fix_lines = [line for line in msg.splitlines() if line.startswith("  fix (")]
    assert len(fix_lines) == 1
    prefix = f"  fix ({kind}): "
    assert fix_lines[0].startswith(prefix)
    assert len(fix_lines[0]) > len(prefix) + 10


def test_one_fix_line_per_kind_sorted() -> None:
    err = WeightManifestValidationError(
        [
            Mismatch("shape", "a", "[1]", "[2]"),
            Mismatch("missing", "b"),
            Mismatch("shape", "c", "[1]", "[3]"),
            Mismatch("dtype", "d", "torch.float32", "torch.float16"),
        ]
    )
    fix_kinds = [line.split("(")[1].split(")")[0] for line in str(err).splitlines() if line.startswith("  fix (")]
    assert fix_kinds == ["dtype", "missing", "shape"]


def test_errors_are_raisable_and_catchable_at_root() -> None:
    for cls in (EngineNotSupportedError, HotWeightsTimeoutError, InstallError, UnsupportedLayoutError):
        with pytest.raises(HotWeightsError, match="what to do"):
            raise cls("what to do")
    with pytest.raises(HotWeightsError):
        raise StaleWeightVersionError(1, 1)
    with pytest.raises(HotWeightsError):
        raise WeightManifestValidationError([Mismatch("missing", "w")])


def test_an_untested_vllm_is_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as metadata

    from hotweights.vllm import compat

    monkeypatch.setattr(compat, "_WARNED", set())
    monkeypatch.setattr(metadata, "version", lambda dist: "0.40.1")
    with pytest.warns(RuntimeWarning, match=r"supports vLLM 0\.31, 0\.32, 0\.33, 0\.34 and this is vLLM 0\.40\.1"):
        compat.warn_untested_vllm()
    compat.warn_untested_vllm()  # once per process: no second warning (pytest would fail on an unexpected one)
