"""The stale-version guard never turns itself off (issue 26): a failed read of the engine's version is retried."""

from __future__ import annotations

import pytest

from hotweights import WeightVersionUnknownError
from hotweights.core.active import ActiveVersion


class _Flaky:
    def __init__(self, answers: list[object]) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self) -> str | None:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]


def test_a_failed_read_is_retried_not_taken_for_no_version() -> None:
    read = _Flaky([ConnectionError("503"), "7"])
    line = ActiveVersion(read)
    with pytest.raises(ConnectionError):
        line.checked()
    assert line.value == 7  # read again, and now known
    assert read.calls == 2
    assert line.checked() == 7 and read.calls == 2  # read once it succeeded


def test_a_version_the_engine_never_set_reads_as_none() -> None:
    assert ActiveVersion(lambda: "default").checked() is None


def test_an_install_is_refused_while_the_version_cannot_be_read_unless_forced() -> None:
    import torch
    from test_adapter_contract import RecordingAdapter

    from hotweights import StaleWeightVersionError, WeightUpdateManifest

    down = [ConnectionError("server said 503")]

    def read() -> str:
        if down:
            raise down[0]
        return "7"

    adapter = RecordingAdapter(version=ActiveVersion(read))
    tensors = {"w": torch.ones(2)}
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=3)
    for _ in range(2):  # refused every time, not just the first
        with pytest.raises(WeightVersionUnknownError, match="force=True"):
            adapter.install(manifest, tensors)
    assert adapter.install_calls == 0  # nothing written
    down.clear()
    with pytest.raises(StaleWeightVersionError):  # read again, and now known: 3 is older than 7
        adapter.install(manifest, tensors)
    assert adapter.install_calls == 0
    adapter.install(WeightUpdateManifest.from_state_dict(tensors, weight_version=8), tensors)
    assert adapter.install_calls == 1


def test_force_installs_while_the_version_cannot_be_read() -> None:
    import torch
    from test_adapter_contract import RecordingAdapter

    from hotweights import WeightUpdateManifest

    adapter = RecordingAdapter(version=ActiveVersion(_Flaky([ConnectionError("down")])))
    tensors = {"w": torch.ones(2)}
    adapter.install(WeightUpdateManifest.from_state_dict(tensors, weight_version=1), tensors, force=True)
    assert adapter.install_calls == 1
