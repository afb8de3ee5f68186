"""The family guard on a server reached with ``hotweights.connect``: with no family proven (as on vLLM 0.33,
0.34 and every GPU), the first install into a ``python -m hotweights.serve`` server is probed by default (its guard
scores the probe while it holds generation routes), and a fault planted in the server's own write (a norm scaled by
1.01) fails the install closed: the version unchanged, the server left paused, and the next good install serves the
new weights exactly."""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hotweights
from hotweights import FamilyProbeError
from hotweights.core import families
from hotweights.handles.remote import RemoteHandle
from hotweights.testing import PROMPTS
from tests.engine.faulty import EXTENSION, FAULT_FILE, plant
from tests.remote.test_token import GuardedServer, start_guarded_server

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0
FAULT = "scale layers.0.post_attention_layernorm 1.01"
#: Every decoding step of the server's model 50 ms slower.
SLOW = "delay 0.05"


@pytest.fixture(scope="module")
def server(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedServer]:
    token = secrets.token_urlsafe(24)
    where = tmp_path_factory.mktemp("guard-remote")
    fault = where / "fault"
    plant(fault, "")
    path = os.pathsep.join((str(ROOT / "src"), str(ROOT)))  # this checkout's hotweights and tests
    env = {FAULT_FILE: str(fault), "PYTHONPATH": path}
    extra = ["--worker-extension-cls", EXTENSION]  # hotweights' extension, with faults to plant
    srv = start_guarded_server(models["path"], where / "server.log", token, extra, env)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def engine(server: GuardedServer) -> Iterator[RemoteHandle]:
    handle = hotweights.connect(server.url, token=server.token, timeout=TIMEOUT)
    handle.workers.call("hotweights_engine", "status", "{}", timeout=TIMEOUT)  # plants the faults' hooks (none yet)
    yield handle
    handle.close()


def test_an_unproven_family_on_a_server_is_probed_and_a_planted_fault_fails_closed(
    engine: RemoteHandle, server: GuardedServer, models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(families, "PROVEN", {})
    hf, a, b = models["hf"], models["A"].state_dict(), models["B"].state_dict()
    assert hf["A"] != hf["B"]
    assert server.completions(PROMPTS) == hf["A"]
    probed = hotweights.install(engine, b, weight_version=1)
    assert "probed at v1" in (probed.family_check or ""), probed.family_check
    assert "family_probe" in probed.phases
    # the server's guard had its workers rank the probe's logprobs eagerly, and put vLLM's ranking back
    (ranks,) = engine.workers.call("hotweights_engine", "faulty_ranks", "{}", timeout=TIMEOUT)
    assert ranks["eager_calls"] > 0 and ranks["restored"], ranks
    assert engine.get_weight_version() == "1"
    assert server.completions(PROMPTS) == hf["B"]
    engine.__dict__.pop("_hotweights_family_probed", None)  # as on the server's first install
    plant(_fault_file(server), FAULT)
    try:
        with pytest.raises(FamilyProbeError, match="differed from the reference"):
            hotweights.install(engine, a, weight_version=2)
        assert engine.get_weight_version() == "1"
        assert engine.pausing.scheduler_paused()  # failed closed: left paused until a full install
    finally:
        plant(_fault_file(server), "")
    healed = hotweights.install(engine, a, weight_version=2)
    assert "probed at v2" in (healed.family_check or ""), healed.family_check
    assert not engine.pausing.scheduler_paused()
    assert engine.get_weight_version() == "2"
    assert server.completions(PROMPTS) == hf["A"]


def _fault_file(server: GuardedServer) -> Path:
    return server.log.parent / "fault"


def test_a_failed_probe_under_keep_aborts_the_servers_requests_that_decoded_during_it(
    engine: RemoteHandle, server: GuardedServer, models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under keep, a request in flight decodes on the new weights while the server's guard runs the probe; when the
    probe then fails, the request is aborted, not completed, and the old version label is put back."""
    monkeypatch.setattr(families, "PROVEN", {})
    before = engine.get_weight_version()
    version = int(before) + 1 if before and before.isdigit() else 1
    engine.__dict__.pop("_hotweights_family_probed", None)
    answer: dict[str, Any] = {"reasons": []}
    decoding = threading.Event()

    def long_request() -> None:  # streamed: the install starts once its first tokens came
        body = {"model": server.model, "prompt": [3, 5, 7, 11], "max_tokens": 500, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with server.client(timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    decoding.set()
                    reason = json.loads(line[6:])["choices"][0].get("finish_reason")
                    if reason:
                        answer["reasons"].append(reason)
        decoding.set()

    plant(_fault_file(server), SLOW)  # 500 tokens take 25 s or more: in flight when the install pauses the server
    thread = threading.Thread(target=long_request)
    thread.start()
    assert decoding.wait(60)
    plant(_fault_file(server), f"{SLOW}; {FAULT}")
    try:
        with pytest.raises(FamilyProbeError):
            hotweights.install(engine, models["B"].state_dict(), weight_version=version, pause="keep")
    finally:
        plant(_fault_file(server), "")
    assert engine.get_weight_version() == before
    hotweights.install(engine, models["B"].state_dict(), weight_version=version)  # heals, resumes
    thread.join(120)
    assert answer["reasons"] in ([], ["abort"]), answer  # not completed on the weights the probe refused
    assert server.completions(PROMPTS) == models["hf"]["B"]
