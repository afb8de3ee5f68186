"""The WeightInstallAdapter contract, exercised through an in-test adapter that records what it receives.

No engine here: the fake stands in for one so that the checks every adapter inherits (lock, layout, version,
validation before any write, error mapping, prefix-cache policy, report) can be tested on their own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

import hotweights
import hotweights.adapters
from hotweights import (
    ExpectedWeights,
    HotWeightsTimeoutError,
    InstallError,
    InstallReport,
    PartialUpdateError,
    StaleWeightVersionError,
    TensorSpec,
    UnsupportedLayoutError,
    WeightLayout,
    WeightManifestValidationError,
    WeightUpdateManifest,
)
from hotweights.adapters import WeightInstallAdapter
from hotweights.core.gate import ServingGate
from hotweights.core.report import PhaseTimer


class RecordingAdapter(WeightInstallAdapter):
    """Records every tensor ``_install`` is handed; optionally fails inside it."""

    name = "recording"

    def __init__(self, *, fail_with: BaseException | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.fail_with = fail_with
        self.received: dict[str, torch.Tensor] = {}
        self.sent_order: list[str] = []
        self.install_calls = 0
        self.reset_calls = 0
        self.recorded_versions: list[str] = []

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        self.install_calls += 1
        with timer("install"):
            if self.fail_with is not None:
                raise self.fail_with
            for name, tensor in items:
                self.received[name] = tensor
                self.sent_order.append(name)

    def _reset_prefix_cache(self) -> bool:
        self.reset_calls += 1
        return True

    def _record_engine_version(self, version: str) -> str | None:
        self.recorded_versions.append(version)
        return f"engine-{version}"


class MinimalAdapter(WeightInstallAdapter):
    """Only the abstract hook: the base class defaults for the other hooks apply."""

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        pass


def _tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}  # 24 + 8 bytes


def _manifest(version: int, tensors: dict[str, torch.Tensor] | None = None, **kwargs: object) -> WeightUpdateManifest:
    return WeightUpdateManifest.from_state_dict(
        tensors if tensors is not None else _tensors(),
        weight_version=version,
        **kwargs,  # type: ignore[arg-type]
    )


def _assert_nothing_written(adapter: RecordingAdapter) -> None:
    assert adapter.received == {}
    assert adapter.install_calls == 0
    assert adapter.reset_calls == 0
    assert adapter.recorded_versions == []


# ---------------------------------------------------------------------------------------------- report
def test_install_reports_what_it_did() -> None:
    adapter = RecordingAdapter()
    tensors = _tensors()
    report = adapter.install(_manifest(5, update_id="u-5"), tensors)
    assert isinstance(report, InstallReport)
    assert report.update_id == "u-5"
    assert report.weight_version == 5
    assert report.previous_version is None
    assert report.adapter == "recording"
    assert report.num_tensors == 2
    assert report.num_bytes == 32
    assert report.skipped == ()
    assert report.prefix_cache_reset is True
    assert report.engine_weight_version == "engine-5"
    assert list(report.phases) == ["validate", "install", "reset_prefix_cache", "record_version"]
    assert all(v >= 0 for v in report.phases.values())
    assert report.seconds == pytest.approx(sum(report.phases.values()))
    # the very tensor objects reach the engine, in order
    assert adapter.sent_order == ["a", "b"]
    assert all(adapter.received[n] is tensors[n] for n in tensors)
    assert (adapter.install_calls, adapter.reset_calls, adapter.recorded_versions) == (1, 1, ["5"])
    assert adapter.active_weight_version == 5
    assert adapter.active_update_id == "u-5"
    assert "installed v5 (2 tensors" in str(report)


def test_second_install_reports_previous_version() -> None:
    adapter = RecordingAdapter()
    adapter.install(_manifest(1), _tensors())
    report = adapter.install(_manifest(2), list(_tensors().items()))
    assert (report.previous_version, report.weight_version) == (1, 2)
    assert adapter.active_weight_version == 2
    assert adapter.install_calls == 2


def test_base_hook_defaults() -> None:
    with MinimalAdapter() as adapter:
        report = adapter.install(_manifest(0), _tensors())
    assert report.adapter == "adapter"
    assert report.prefix_cache_reset is False
    assert report.engine_weight_version is None
    assert adapter.active_weight_version == 0


def test_base_class_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        WeightInstallAdapter()  # type: ignore[abstract]


# ---------------------------------------------------------------------------------------------- versions
@pytest.mark.parametrize("next_version", [5, 4, 0])
def test_stale_version_is_refused(next_version: int) -> None:
    adapter = RecordingAdapter()
    adapter.install(_manifest(5, update_id="first"), _tensors())
    adapter.received.clear()
    with pytest.raises(StaleWeightVersionError) as info:
        adapter.install(_manifest(next_version), _tensors())
    assert (info.value.requested, info.value.active) == (next_version, 5)
    assert f"weight_version {next_version} is not newer than the active version 5" in str(info.value)
    assert "force=True" in str(info.value)
    assert adapter.received == {}
    assert adapter.install_calls == 1
    assert (adapter.active_weight_version, adapter.active_update_id) == (5, "first")


@pytest.mark.parametrize("next_version", [5, 4])
def test_force_installs_stale_version(next_version: int) -> None:
    adapter = RecordingAdapter()
    adapter.install(_manifest(5), _tensors())
    report = adapter.install(_manifest(next_version), _tensors(), force=True)
    assert (report.previous_version, report.weight_version) == (5, next_version)
    assert adapter.active_weight_version == next_version
    assert adapter.install_calls == 2


def test_first_install_accepts_any_version() -> None:
    adapter = RecordingAdapter()
    assert adapter.active_weight_version is None
    assert adapter.install(_manifest(0), _tensors()).weight_version == 0


# ---------------------------------------------------------------------------------------------- validation
def test_validation_failure_writes_nothing() -> None:
    adapter = RecordingAdapter()
    adapter.install(_manifest(1, update_id="good"), _tensors())
    adapter.received.clear()
    adapter.install_calls = adapter.reset_calls = 0
    adapter.recorded_versions.clear()
    bad = {"a": torch.zeros(3, 2), "c": torch.zeros(1)}
    with pytest.raises(WeightManifestValidationError) as info:
        adapter.install(_manifest(2), bad)
    assert {(m.kind, m.name) for m in info.value.mismatches} == {
        ("shape", "a"),
        ("missing", "b"),
        ("unexpected", "c"),
    }
    _assert_nothing_written(adapter)
    assert (adapter.active_weight_version, adapter.active_update_id) == (1, "good")


def test_validation_failure_on_first_install_leaves_version_unset() -> None:
    adapter = RecordingAdapter()
    with pytest.raises(WeightManifestValidationError):
        adapter.install(_manifest(1), {"a": torch.zeros(2, 3, dtype=torch.float64), "b": _tensors()["b"]})
    _assert_nothing_written(adapter)
    assert adapter.active_weight_version is None


def test_expected_weights_skip_ignored_names() -> None:
    tensors = {**_tensors(), "lm_head.weight": torch.zeros(10, 4)}
    expected = ExpectedWeights(
        tensors={n: TensorSpec.of(t) for n, t in _tensors().items()},
        ignored={"lm_head.weight": "tied to embed_tokens.weight"},
    )
    adapter = RecordingAdapter(expected=expected)
    report = adapter.install(_manifest(1, tensors), tensors)
    assert report.skipped == ("lm_head.weight: tied to embed_tokens.weight",)
    assert report.num_tensors == 2
    assert report.num_bytes == 32
    assert "lm_head.weight" not in adapter.received
    assert adapter.sent_order == ["a", "b"]


def test_manifest_checked_against_expected_before_any_write() -> None:
    expected = ExpectedWeights(
        tensors={
            "a": TensorSpec(shape=(2, 3), dtype="bfloat16"),
            "b": TensorSpec(shape=(4,), dtype="bfloat16"),
            "z": TensorSpec(shape=(1,), dtype="float32"),
        },
    )
    adapter = RecordingAdapter(expected=expected)
    with pytest.raises(WeightManifestValidationError) as info:
        adapter.install(_manifest(1), _tensors())  # tensors match the manifest, the manifest not the engine
    assert {(m.kind, m.name) for m in info.value.mismatches} == {("dtype", "a"), ("missing", "z")}
    _assert_nothing_written(adapter)
    assert adapter.active_weight_version is None


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (WeightLayout(format="kernel"), "weight format 'kernel'"),
        (WeightLayout(tp_rank=0, tp_size=2), "tensor-parallel shards"),
    ],
)
def test_unsupported_layout_writes_nothing(layout: WeightLayout, match: str) -> None:
    adapter = RecordingAdapter()
    with pytest.raises(UnsupportedLayoutError, match=match):
        adapter.install(_manifest(1, layout=layout), _tensors())
    _assert_nothing_written(adapter)
    assert adapter.active_weight_version is None


def test_adapter_class_attributes_widen_layouts() -> None:
    class ShardKernelAdapter(RecordingAdapter):
        formats = frozenset({"checkpoint", "kernel"})
        sharded = True

    adapter = ShardKernelAdapter()
    layout = WeightLayout(format="kernel", tp_rank=1, tp_size=2)
    assert adapter.install(_manifest(1, layout=layout), _tensors()).num_tensors == 2


# ---------------------------------------------------------------------------------------------- errors
def test_engine_exception_becomes_install_error() -> None:
    adapter = RecordingAdapter()
    adapter.install(_manifest(1), _tensors())
    boom = RuntimeError("CUDA exploded")
    adapter.fail_with = boom
    with pytest.raises(InstallError) as info:
        adapter.install(_manifest(2, update_id="u-2"), _tensors())
    err = info.value
    assert err.__cause__ is boom
    msg = str(err)
    assert "update u-2 (v2)" in msg
    assert "RuntimeError: CUDA exploded" in msg
    assert "Still serving: v1." in msg
    assert adapter.active_weight_version == 1
    assert adapter.reset_calls == 1  # only the first install's
    assert adapter.recorded_versions == ["1"]


def test_failure_after_writing_recovers_and_says_so() -> None:
    class WritingAdapter(RecordingAdapter):
        recovered = 0

        def _install(self, manifest, items, timer):  # type: ignore[no-untyped-def]
            self._begin_writing(timer)
            raise RuntimeError("reload died in layer 3")

        def _recover(self) -> str:
            self.recovered += 1
            return "KV cache zeroed"

    adapter = WritingAdapter()
    with pytest.raises(InstallError, match="Some layers may hold new weights; KV cache zeroed") as info:
        adapter.install(_manifest(1), _tensors())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert adapter.recovered == 1
    assert adapter.active_weight_version is None


class _FailsWhileWriting(RecordingAdapter):
    """Starts writing, then fails with ``fail_with`` on the first install; later installs succeed."""

    def _install(self, manifest, items, timer):  # type: ignore[no-untyped-def]
        if self.fail_with is not None:
            self._begin_writing(timer)
            exc, self.fail_with = self.fail_with, None
            raise exc
        return super()._install(manifest, items, timer)


@pytest.mark.parametrize("failure", [RuntimeError("reload died in layer 3"), KeyboardInterrupt()])
def test_failure_while_writing_closes_the_gate_until_a_full_install(failure: BaseException) -> None:
    gate = ServingGate()
    adapter = _FailsWhileWriting(fail_with=failure, gate=gate)
    with pytest.raises((InstallError, KeyboardInterrupt)) as info:
        adapter.install(_manifest(1), _tensors())
    if isinstance(info.value, InstallError):
        assert "Generation calls raise PartialUpdateError until then." in str(info.value)
    refused = r"\(v1\) failed while writing.*adapter.reopen_serving\(\)"
    with pytest.raises(PartialUpdateError, match=refused), gate.serving():
        pass
    adapter.install(_manifest(1), _tensors())  # the same version: the active one did not change
    with gate.serving():
        pass


def test_reopen_serving_lets_generation_in_after_a_partial_write() -> None:
    gate = ServingGate()
    adapter = _FailsWhileWriting(fail_with=RuntimeError("boom"), gate=gate)
    with pytest.raises(InstallError):
        adapter.install(_manifest(1), _tensors())
    adapter.reopen_serving()
    with gate.serving():
        pass
    assert adapter.active_weight_version is None


def test_failure_before_writing_leaves_the_gate_open() -> None:
    gate = ServingGate()
    adapter = RecordingAdapter(fail_with=RuntimeError("transport died"), gate=gate)
    with pytest.raises(InstallError, match="before the model was touched"):
        adapter.install(_manifest(1), _tensors())
    with gate.serving():
        pass


def test_hotweights_error_inside_install_is_not_wrapped() -> None:
    inner = HotWeightsTimeoutError("waited 3 s for the engine's reload RPC")
    adapter = RecordingAdapter(fail_with=inner)
    with pytest.raises(HotWeightsTimeoutError) as info:
        adapter.install(_manifest(1), _tensors())
    assert info.value is inner
    assert adapter.active_weight_version is None


# ---------------------------------------------------------------------------------------------- lock
def test_lock_timeout() -> None:
    adapter = RecordingAdapter(lock_timeout=0.05)
    assert adapter._lock.acquire(blocking=False)
    try:
        start = time.perf_counter()
        with pytest.raises(HotWeightsTimeoutError, match=r"waited 0.05 s for another install") as info:
            adapter.install(_manifest(1), _tensors())
        elapsed = time.perf_counter() - start
    finally:
        adapter._lock.release()
    assert 0.04 <= elapsed < 2.0
    assert isinstance(info.value, TimeoutError)
    assert "raise lock_timeout" in str(info.value)
    _assert_nothing_written(adapter)
    # the lock is free again and installs proceed
    assert adapter.install(_manifest(1), _tensors()).weight_version == 1


def test_lock_released_after_failed_install() -> None:
    adapter = RecordingAdapter(lock_timeout=0.05, fail_with=RuntimeError("x"))
    with pytest.raises(InstallError):
        adapter.install(_manifest(1), _tensors())
    with pytest.raises(WeightManifestValidationError):
        adapter.install(_manifest(1), {})
    adapter.fail_with = None
    assert adapter.install(_manifest(1), _tensors()).num_tensors == 2
    assert not adapter._lock.locked()


# ---------------------------------------------------------------------------------------------- prefix cache
def test_prefix_cache_keep_does_not_reset() -> None:
    adapter = RecordingAdapter(prefix_cache="keep")
    report = adapter.install(_manifest(1), _tensors())
    assert adapter.reset_calls == 0
    assert report.prefix_cache_reset is False
    assert "reset_prefix_cache" not in report.phases
    assert list(report.phases) == ["validate", "install", "record_version"]


@pytest.mark.parametrize("bad", ["Reset", "off", "", None, True])
def test_invalid_prefix_cache_policy_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="prefix_cache must be 'reset' or 'keep'"):
        RecordingAdapter(prefix_cache=bad)


def test_prefix_cache_policy_is_exported() -> None:
    import typing

    assert typing.get_args(hotweights.adapters.PrefixCachePolicy) == ("reset", "keep")


# ---------------------------------------------------------------------------------------------- regressions
def test_duplicate_names_in_tensors_are_refused() -> None:
    adapter = RecordingAdapter()
    pairs = [("a", torch.zeros(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16)), ("a", torch.ones(2, 3))]
    with pytest.raises(WeightManifestValidationError):
        adapter.install(_manifest(1), pairs)
    assert adapter.install_calls == 0


def test_prefix_cache_reset_failure_becomes_install_error() -> None:
    class FailingResetAdapter(RecordingAdapter):
        def _reset_prefix_cache(self) -> bool:
            raise RuntimeError("reset RPC failed")

    adapter = FailingResetAdapter()
    with pytest.raises(InstallError) as info:
        adapter.install(_manifest(1), _tensors())
    assert isinstance(info.value.__cause__, RuntimeError)
