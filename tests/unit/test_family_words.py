"""What the family guard says: its report line, its log lines and its errors (a fake engine, no vLLM)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hotweights import FamilyProbeError, PartialUpdateError, UnprovenFamilyError, WeightUpdateManifest, _family
from hotweights._family import check_family
from hotweights.adapters import WeightInstallAdapter
from hotweights.core.families import FamilyCheck
from hotweights.core.gate import ServingGate
from hotweights.core.probe import ProbeReference
from hotweights.handles.parts import Pausing, ServedModel
from hotweights.testing import build_tiny_model


class _Model(ServedModel):
    """An unproven Qwen2 that can be probed."""

    probes = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self._config = config

    def config(self) -> Any:
        return self._config

    def vllm_fixes(self) -> tuple[str, ...] | None:
        return None

    def family(self) -> tuple[str, str, str]:
        return "Qwen2ForCausalLM", "0.33.0", "cpu"

    def dtype(self) -> torch.dtype:
        return torch.float32


class _Handle:
    """What check_family asks of an engine: an unproven Qwen2 that can be probed, its scheduler running."""

    kind = "llm"
    guards_family = True

    def __init__(self, config: Any) -> None:
        self.model = _Model(config)
        self.pausing = Pausing()

    def describe(self) -> str:
        return "vllm.LLM (in-process)"


class _Scored(WeightInstallAdapter):
    """An engine that stores what it is sent and scores the probe with ``answer(reference)``."""

    name = "scored"

    def __init__(self, answer: Any) -> None:
        super().__init__(gate=ServingGate())
        self.answer = answer
        self.ref: ProbeReference | None = None

    def _install(self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: Any) -> None:
        self._begin_writing(timer)  # the gate is held from here: a failed probe closes it

    def _probe_logprobs(self, token_ids: tuple[int, ...], label: str) -> list[float | None] | None:
        return list(self.answer(token_ids))


def _install(adapter: _Scored, family: FamilyCheck, sd: dict[str, torch.Tensor], version: int) -> Any:
    return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=version), sd, family=family)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_tiny_model("qwen2", 1)


def test_a_probed_engine_reports_unproven_once_and_the_probe_logs_what_it_costs(
    model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sd = dict(model.state_dict())
    handle = _Handle(model.config)
    first = check_family(handle, list(sd.items()), "probe")  # type: ignore[arg-type]
    build = first.probe
    assert build is not None
    refs: list[ProbeReference] = []

    def probe() -> ProbeReference:  # the reference, kept for the fake engine to answer with
        refs.append(build())
        return refs[-1]

    adapter = _Scored(lambda ids: refs[-1].logprobs)  # the engine serves exactly what it was sent
    with caplog.at_level(logging.INFO, logger="hotweights"):
        report = _install(adapter, FamilyCheck(first.architecture, first.verdict, probe, first.passed), sd, 1)
    logs = [r.getMessage() for r in caplog.records if r.name == "hotweights" and r.levelno == logging.INFO]
    assert any("probing this first install" in m and "Qwen2ForCausalLM" in m for m in logs), logs
    assert any("probe reference for Qwen2ForCausalLM built in" in m and m.endswith(" s") for m in logs), logs
    assert any("engine scored it in" in m and "passed" in m for m in logs), logs
    assert report.family_check.startswith("unproven: Qwen2ForCausalLM on vLLM 0.33.0 on cpu, probed at v1")
    later = check_family(handle, list(sd.items()), "probe")  # type: ignore[arg-type]
    assert later.probe is None and later.verdict == report.family_check
    assert later.verdict.count("unproven:") == 1


def test_a_probe_that_differs_fails_closed_and_says_the_reference_may_be_what_differs(model: Any) -> None:
    sd = dict(model.state_dict())
    ref = ProbeReference((3, 5, 7), (-1.0, -2.0), tolerance=0.02, median_tolerance=0.01)
    family = FamilyCheck(
        "NemotronHForCausalLM", "unproven: NemotronHForCausalLM on vLLM 0.33.0 on cpu, probed", lambda: ref
    )
    adapter = _Scored(lambda ids: (-1.0, -2.037))  # a fresh engine misses this reference by as much
    with pytest.raises(FamilyProbeError) as err:
        _install(adapter, family, sd, 1)
    message = str(err.value)
    assert "NemotronHForCausalLM" in message and "0.037" in message and "tolerance 0.02" in message
    assert "freshly started engine on the same weights" in message and "the reference is what differs" in message
    assert "unproven='trust'" in message and "HOTWEIGHTS_UNPROVEN=trust" in message
    assert "defect of vLLM's weight reload" not in message
    assert adapter.active_weight_version is None  # fail closed: the version unchanged, generation refused
    gate = adapter.gate
    assert isinstance(gate, ServingGate)
    with pytest.raises(PartialUpdateError, match="unproven='trust'"), gate.serving(timeout=1.0):
        pass


def test_a_reference_that_vllms_transformers_backend_keeps_from_being_built_names_the_cause(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def compiled_in_place(*args: Any) -> ProbeReference:
        raise AssertionError("Current vLLM config is not set. This typically means get_current_vllm_config() ...")

    monkeypatch.setattr(_family, "reference", compiled_in_place)
    check = check_family(_Handle(model.config), list(model.state_dict().items()), "probe")  # type: ignore[arg-type]
    assert check.probe is not None
    with pytest.raises(UnprovenFamilyError) as err:
        check.probe()
    message = str(err.value)
    assert "could not be built in this process" in message and "Transformers backend" in message
    assert "unproven='trust'" in message and "multiprocess" in message and "nothing was written" in message

    def other(*args: Any) -> ProbeReference:
        raise ValueError("transformers has no causal-LM class for FooConfig")

    monkeypatch.setattr(_family, "reference", other)
    with pytest.raises(UnprovenFamilyError, match=r"no probe reference could be computed.*FooConfig"):
        check.probe()
