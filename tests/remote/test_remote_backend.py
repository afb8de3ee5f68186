"""A real ``vllm serve`` process started with hotweights' weight-transfer backend (no worker extension), listening
on a Unix socket: ``hotweights.install`` drives vLLM's native start/update/finish flow over ``/collective_rpc``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import hotweights
import hotweights.adapters
from hotweights.handles.remote import RemoteHandle
from hotweights.testing import PROMPTS
from hotweights.vllm.plugin import BACKEND
from tests.remote.server import Server, start_server

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("remote-log")
    srv = start_server(models["path"], logs / "server.log", setup="backend", uds=logs / "vllm.sock")
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def engine(server: Server) -> Iterator[RemoteHandle]:
    handle = hotweights.connect(server.url, timeout=20.0)
    yield handle
    handle.close()


def test_backend_install_a_b_a_matches_hf(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    assert (engine.facts.worker_extension, engine.facts.weight_transfer_backend) == ("", BACKEND)
    assert engine.url.startswith("unix://") and engine.workers.same_host and engine.workers.default_transport == "shm"
    assert server.completions(PROMPTS) == models["hf"]["A"]
    for version, name in ((1, "B"), (2, "A")):
        report = hotweights.install(engine, models[name].state_dict(), weight_version=version)
        assert report.adapter == "vllm-weight-transfer-shm"
        assert report.engine_weight_version == str(version)
        assert server.completions(PROMPTS) == models["hf"][name]


def test_backend_collective_on_loopback(engine: RemoteHandle, server: Server, models: dict[str, Any]) -> None:
    with hotweights.adapters.VLLMWeightTransferAdapter(engine, transport="collective") as adapter:
        manifest = hotweights.WeightUpdateManifest.from_state_dict(models["B"].state_dict(), weight_version=3)
        assert adapter.install(manifest, models["B"].state_dict()).adapter == "vllm-weight-transfer-collective"
        assert server.completions(PROMPTS) == models["hf"]["B"]
