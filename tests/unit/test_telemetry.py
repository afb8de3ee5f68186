"""Telemetry: the ``hotweights`` logger's lines, the progress bar's switches, ``InstallReport.to_dict``.

Installs run through in-test adapters (no engine): one that writes into a dict, and a transport adapter whose bucket
loop is the real ``VLLMTransportAdapter._send_buckets`` over an in-test transport.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence

import pytest
import torch
from tqdm import tqdm

import hotweights.telemetry as telemetry
from hotweights import InstallError, InstallReport, WeightUpdateManifest
from hotweights.adapters import WeightInstallAdapter
from hotweights.adapters.options import InstallerOptions
from hotweights.adapters.sending import in_flight, send_buckets
from hotweights.core.buckets import Bucket, plan_buckets
from hotweights.core.report import PhaseTimer
from hotweights.transports import Descriptor, Stage, WeightTransport


class DictAdapter(WeightInstallAdapter):
    name = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[str, torch.Tensor] = {}

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        with timer("install"):
            self._begin_writing(timer)
            self.weights.update(items)


class CountingTransport(WeightTransport):
    """Hands every bucket over with a descriptor naming its size; fails at bucket ``fail_at``."""

    name = "counting"

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def send(self, bucket: Bucket, tensors: Mapping[str, torch.Tensor], stage: Stage) -> None:
        if bucket.index == self.fail_at:
            raise ConnectionError(f"transport died at bucket {bucket.index}")
        stage({"transport": self.name, "nbytes": bucket.nbytes})


class BucketAdapter(WeightInstallAdapter):
    """The session adapters' bucket loop (``Installer._send``) without an engine: staged descriptors are
    kept in a list."""

    name = "buckets"
    _send = send_buckets
    _in_flight = in_flight
    options = InstallerOptions()

    def __init__(self, transport: WeightTransport, bucket_bytes: int) -> None:
        super().__init__()
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.staged: list[tuple[int, Descriptor]] = []
        self.wire = self  # the bucket loop stages through its wire: here, into the list

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self.staged.append((Bucket.model_validate_json(bucket_json).index, descriptor))

    @property
    def label(self) -> str:
        return f"{self.name}-{self.transport.name}"

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        self._begin_writing(timer)
        self._send(manifest, dict(items), plan_buckets(manifest, self.bucket_bytes), timer, False)

    def _recover(self) -> str:
        return "nothing to recover"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _tensors(n: int = 4) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((16, 16), float(i)) for i in range(n)}  # 1024 bytes each


def _manifest(version: int, tensors: Mapping[str, torch.Tensor]) -> WeightUpdateManifest:
    return WeightUpdateManifest.from_state_dict(tensors, weight_version=version, update_id=f"u{version}")


def _report(**overrides: object) -> InstallReport:
    fields: dict[str, object] = {
        "update_id": "u3",
        "weight_version": 3,
        "previous_version": 2,
        "adapter": "multiprocess-shm",
        "num_tensors": 27,
        "num_bytes": 2_000_000,
        "skipped": ("lm_head.weight: tied to the input embedding",),
        "prefix_cache_reset": True,
        "engine_weight_version": "3",
        "digests_verified": 27,
        "phases": {"validate": 0.001, "wait_generation": 0.0, "transfer": 0.002, "install": 0.001},
    }
    fields.update(overrides)
    return InstallReport.model_validate(fields)


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hotweights" and r.levelno == level]


@pytest.fixture(autouse=True)
def _default_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HOTWEIGHTS_PROGRESS", raising=False)
    telemetry.set_progress(None)
    yield
    telemetry.set_progress(None)


# ---------------------------------------------------------------------------------------------- logger
def test_library_logger_has_only_a_null_handler() -> None:
    log = logging.getLogger("hotweights")
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    assert all(isinstance(h, logging.NullHandler) for h in log.handlers)  # output is the application's choice
    assert log.propagate
    assert log.level == logging.NOTSET  # and so is the level
    assert telemetry.logger is log


def test_install_logs_one_info_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hotweights")
    report = DictAdapter().install(_manifest(7, _tensors()), _tensors())
    assert _lines(caplog, logging.INFO) == [str(report)]
    line = _lines(caplog, logging.INFO)[0]
    for part in ("v7", "4 tensors", "0.0 MB", "via dict", " s (", "GB/s"):
        assert part in line
    assert _lines(caplog, logging.DEBUG) == []  # DEBUG lines only when asked for


def test_install_logs_each_phase_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hotweights")
    report = DictAdapter().install(_manifest(1, _tensors()), _tensors())
    debug = _lines(caplog, logging.DEBUG)
    assert [line.split(":")[0] for line in debug] == [f"update u1 phase {p}" for p in report.phases]
    assert len(_lines(caplog, logging.INFO)) == 1


def test_refused_install_logs_no_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hotweights")
    adapter = DictAdapter()
    adapter.install(_manifest(2, _tensors()), _tensors())
    caplog.clear()
    with pytest.raises(Exception, match="not newer"):
        adapter.install(_manifest(1, _tensors()), _tensors())
    assert [r for r in caplog.records if r.name == "hotweights"] == []


def test_bucket_loop_logs_every_bucket(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hotweights")
    tensors = _tensors(5)
    adapter = BucketAdapter(CountingTransport(), bucket_bytes=2048)
    manifest = _manifest(3, tensors)
    report = adapter.install(manifest, tensors)
    plan = plan_buckets(manifest, 2048)
    assert [i for i, _ in adapter.staged] == [b.index for b in plan] == [0, 1, 2]
    bucket_lines = [line for line in _lines(caplog, logging.DEBUG) if " bucket " in line]
    assert len(bucket_lines) == len(plan)
    for bucket, line in zip(plan, bucket_lines, strict=True):
        assert line.startswith(f"buckets-counting v3 bucket {bucket.index}: {bucket.nbytes} bytes, ")
        assert line.endswith(" s")
    assert "transfer" in report.phases
    assert _lines(caplog, logging.INFO) == [str(report)]


def test_failed_bucket_loop_raises_and_logs_the_buckets_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hotweights")
    tensors = _tensors(5)
    adapter = BucketAdapter(CountingTransport(fail_at=1), bucket_bytes=2048)
    with pytest.raises(InstallError, match="transport died at bucket 1"):
        adapter.install(_manifest(1, tensors), tensors)
    assert [line.split(":")[0] for line in _lines(caplog, logging.DEBUG)] == ["buckets-counting v1 bucket 0"]
    assert _lines(caplog, logging.INFO) == []


# ---------------------------------------------------------------------------------------------- to_dict
def test_to_dict_is_flat_and_prefixed() -> None:
    report = _report()
    d = report.to_dict()
    assert d == {
        "hotweights/update_id": "u3",
        "hotweights/weight_version": 3,
        "hotweights/previous_version": 2,
        "hotweights/adapter": "multiprocess-shm",
        "hotweights/num_tensors": 27,
        "hotweights/num_bytes": 2_000_000,
        "hotweights/num_skipped": 1,
        "hotweights/prefix_cache_reset": True,
        "hotweights/engine_weight_version": "3",
        "hotweights/digests_verified": 27,
        "hotweights/seconds": report.seconds,
        "hotweights/gbps": report.gbps,
        "hotweights/phase/validate_s": 0.001,
        "hotweights/phase/wait_generation_s": 0.0,
        "hotweights/phase/transfer_s": 0.002,
        "hotweights/phase/install_s": 0.001,
    }
    assert all(v is None or type(v) in (int, float, str, bool) for v in d.values())
    assert json.loads(json.dumps(d, allow_nan=False)) == d  # plain JSON: what any metric logger accepts


def test_to_dict_other_prefix_and_empty_values() -> None:
    d = _report(previous_version=None, engine_weight_version=None, skipped=(), phases={}).to_dict(prefix="")
    assert d["previous_version"] is None and d["engine_weight_version"] is None
    assert d["num_skipped"] == 0 and d["seconds"] == 0.0
    assert d["gbps"] is None  # no time measured: no infinite rate
    assert not any(k.startswith("phase/") for k in d)
    assert set(_report().to_dict(prefix="rl/")) == {"rl/" + k for k in _report().to_dict(prefix="")}


def test_to_dict_of_a_real_install() -> None:
    report = DictAdapter().install(_manifest(4, _tensors()), _tensors())
    d = report.to_dict()
    assert d["hotweights/weight_version"] == 4 and d["hotweights/num_bytes"] == 4 * 1024
    assert {k for k in d if k.startswith("hotweights/phase/")} == {f"hotweights/phase/{p}_s" for p in report.phases}
    assert isinstance(d["hotweights/gbps"], float) and math.isfinite(d["hotweights/gbps"])


# ---------------------------------------------------------------------------------------------- progress bar
def test_progress_off_when_stderr_is_not_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not telemetry.progress_enabled()
    telemetry.set_progress(True)  # allowed, but still only on a terminal
    assert not telemetry.progress_enabled()
    monkeypatch.setattr("sys.stderr", None)
    assert not telemetry.progress_enabled()


def test_progress_on_for_a_tty_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", FakeTTY())
    assert telemetry.progress_enabled()
    telemetry.set_progress(False)
    assert not telemetry.progress_enabled()
    telemetry.set_progress(None)
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("HOTWEIGHTS_PROGRESS", off)
        assert not telemetry.progress_enabled()
    monkeypatch.setenv("HOTWEIGHTS_PROGRESS", "1")
    assert telemetry.progress_enabled()
    monkeypatch.setenv("HOTWEIGHTS_PROGRESS", "0")
    telemetry.set_progress(True)  # the function overrides the environment
    assert telemetry.progress_enabled()


def _plan(n: int = 5) -> list[Bucket]:
    return plan_buckets(_manifest(1, _tensors(n)), 2048)


def test_no_bar_is_made_when_progress_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", FakeTTY())
    telemetry.set_progress(False)
    with telemetry.bucket_progress(_plan()) as buckets:
        assert getattr(buckets, "bar") is None  # noqa: B009
        assert len(list(buckets)) == 3


def test_bar_counts_bytes_and_waits_before_showing(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = FakeTTY()
    monkeypatch.setattr("sys.stderr", stderr)
    plan = _plan()
    with telemetry.bucket_progress(plan, "multiprocess-shm v1") as buckets:
        bar = getattr(buckets, "bar")  # noqa: B009
        assert isinstance(bar, tqdm)
        assert bar.total == sum(b.nbytes for b in plan) and bar.unit == "B"
        assert bar.delay == telemetry.PROGRESS_DELAY_S == 2.0
        for _ in buckets:
            pass
        assert bar.n == bar.total
    assert stderr.getvalue() == ""  # a transfer shorter than the delay never shows a bar
    assert bar not in tqdm._instances  # type: ignore[attr-defined]


def test_failed_transfer_clears_its_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = FakeTTY()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr(telemetry, "PROGRESS_DELAY_S", 0.0)  # show it at once
    with pytest.raises(ConnectionError), telemetry.bucket_progress(_plan(), "multiprocess-shm v1") as buckets:
        bar = getattr(buckets, "bar")  # noqa: B009
        for bucket in buckets:
            if bucket.index == 1:
                raise ConnectionError("transport died")
    assert "multiprocess-shm v1" in stderr.getvalue()  # it was shown ...
    assert bar not in tqdm._instances  # type: ignore[attr-defined]  # ... and closed
    assert getattr(buckets, "bar") is None  # noqa: B009
    assert stderr.getvalue().endswith("\r")  # leave=False: the line was cleared, nothing half-drawn is left


def test_install_through_a_bucket_loop_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = FakeTTY()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr(telemetry, "PROGRESS_DELAY_S", 0.0)
    tensors = _tensors(5)
    BucketAdapter(CountingTransport(), bucket_bytes=2048).install(_manifest(9, tensors), tensors)
    assert "hotweights buckets-counting v9" in stderr.getvalue()
    assert not [b for b in tqdm._instances if "buckets-counting" in b.desc]  # type: ignore[attr-defined]
