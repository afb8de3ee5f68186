"""verl 0.9.1's checkpoint-engine path with the ``hotweights`` backend, into a real ``vllm serve`` process.

A rollout that does not share the trainer's machine: verl's ``CheckpointEngineManager`` (base.py) drives a trainer
worker and a rollout worker through the checkpoint engine. Here its steps run as it runs them, on verl's own code
where that runs without Ray and a GPU: the engine loaded through ``custom_backend_module`` by verl's
``import_external_libs``, built as verl's trainer worker builds it (engine_workers.py:679-687) and by verl's real
``CheckpointEngineWorker`` on the rollout side (its ``ServerAdapter`` reaching the server through a stand-in for
the server's Ray actor); ``prepare``, ``build_topology``, ``init_process_group`` through verl's
``execute_checkpoint_engine``; then verl's ``ActorRolloutRefWorker.update_weights`` beside the rollout worker's
``update_weights``; then ``finalize``. The server runs hotweights' verl extension (bf16; verl's actor sends fp32).
Two replicas switch together or not at all. Runs in .venv-verl (``make test-verl``); skipped where verl is not
installed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
try:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
    from verl.workers.engine_workers import ActorRolloutRefWorker
except Exception as exc:  # not installed, or without the "vllm" alias (make test-verl builds both)
    pytest.skip(
        f"verl's checkpoint engine cannot be imported here ({exc}): run `make test-verl`", allow_module_level=True
    )

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
os.environ.setdefault("VERL_RAY_JOB_ID", f"hotweights-test-{os.getpid()}")  # the server inherits it

import hotweights
from hotweights.integrations.verl_checkpoint import VERL_EXTENSION, VerlServer
from hotweights.testing import PROMPTS, build_tiny_model, greedy_vllm, save_tiny_model, start_engine, stop_engine

from ..conftest import our_shm
from ..remote.server import Server, start_server
from .verl_helpers import for_url, use_cpu, verl_worker_env

DTYPE = "bfloat16"
MODULE = "hotweights.integrations.verl_checkpoint"
pytestmark = pytest.mark.engine

use_cpu()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in build_tiny_model("qwen2", seed=seed).state_dict().items()}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list[list[int]]]]:
    """Seed -> (checkpoint directory, greedy outputs of a fresh engine started on it)."""
    out: dict[int, tuple[Path, list[list[int]]]] = {}
    for seed in range(4):
        path = save_tiny_model(build_tiny_model("qwen2", seed=seed), tmp_path_factory.mktemp(f"qwen2-s{seed}"))
        llm = start_engine(path, DTYPE)
        try:
            out[seed] = (path, greedy_vllm(llm))
        finally:
            stop_engine(llm)
    return out


def _start(fresh: Any, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A replica's server as verl starts it with hotweights: the dev routes, hotweights' verl extension."""
    log = tmp_path_factory.mktemp("verl-server") / "server.log"
    extra = ["--dtype", DTYPE, "--worker-extension-cls", VERL_EXTENSION]
    return start_server(fresh[0][0], log, extra=extra)


@pytest.fixture(scope="module")
def server(fresh: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    proc = _start(fresh, tmp_path_factory)
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def second(fresh: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second replica's server (the last test kills it)."""
    proc = _start(fresh, tmp_path_factory)
    yield proc
    proc.kill()


def _served(server: Server) -> list[list[int]]:
    return server.completions(PROMPTS)


def _config(**engine_kwargs: Any) -> Any:
    from verl.workers.config import CheckpointEngineConfig

    return CheckpointEngineConfig(
        backend="hotweights",
        custom_backend_module=MODULE,
        update_weights_bucket_megabytes=1,
        engine_kwargs={"hotweights": {"bucket_mb": 1, **engine_kwargs}},
    )


def _trainer(config: Any) -> Any:
    """verl's trainer worker as far as ``update_weights`` reads it: its checkpoint engine built as its
    ``init_model`` builds it (engine_workers.py:679-687), its actor's ``get_per_tensor_param``."""
    from verl.utils.import_utils import import_external_libs

    import_external_libs(config.custom_backend_module or None)
    engine = CheckpointEngineRegistry.new(
        config.backend,
        is_master=True,
        bucket_size=config.update_weights_bucket_megabytes << 20,
        **config.engine_kwargs.get(config.backend, {}),
    )
    weights: dict[str, torch.Tensor] = {}
    actor = SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=lambda: (iter(weights.items()), None)))
    return SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=config)),
        checkpoint_engine=engine,
        actor=actor,
        weights=weights,
    )


@pytest.fixture(scope="module")
def rollout(server: Server) -> Iterator[Any]:
    """verl's own rollout-side worker (``CheckpointEngineWorker``), its ``ServerAdapter`` on the server."""
    from verl.workers.config import RolloutConfig

    verl_worker_env()
    worker = CheckpointEngineWorker(
        RolloutConfig(name="vllm", free_cache_engine=False, checkpoint_engine=_config()), None
    )
    worker.server_adapter.server_handle = for_url(server.url)
    yield worker
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the gloo group verl's worker starts (base.py:351)


def _sync(trainer: Any, rollout: Any, weights: dict[str, torch.Tensor], step: int) -> tuple[Any, list[BaseException]]:
    """One sync as ``CheckpointEngineManager.update_weights`` makes it (base.py:422-449, 510-560; without Ray):
    prepare every worker, build the topology, init the process groups, update both sides together, finalize.
    Returns the trainer's sync metrics and the errors the manager's ``ray.get`` would raise."""
    trainer.weights.clear()
    trainer.weights.update(weights)
    cls = CheckpointEngineRegistry.get("hotweights")
    metadata = [
        ActorRolloutRefWorker.execute_checkpoint_engine(trainer, "prepare"),
        rollout.execute_checkpoint_engine("prepare"),
    ]
    actor_kwargs, rollout_kwargs = cls.build_topology(1, 1, metadata)
    ActorRolloutRefWorker.execute_checkpoint_engine(
        trainer, "init_process_group", **{k: v[0] for k, v in actor_kwargs.items()}
    )
    rollout.execute_checkpoint_engine("init_process_group", **{k: v[0] for k, v in rollout_kwargs.items()})

    async def both() -> list[Any]:
        return await asyncio.gather(
            ActorRolloutRefWorker.update_weights(trainer, global_steps=step, mode="auto"),
            rollout.update_weights(global_steps=step),
            return_exceptions=True,
        )

    results = asyncio.run(both())
    ActorRolloutRefWorker.execute_checkpoint_engine(trainer, "finalize")
    rollout.execute_checkpoint_engine("finalize")
    return results[0], [r for r in results if isinstance(r, BaseException)]


def test_the_contract_without_an_engine() -> None:
    """Loaded by verl's own loader; no process group; the rollout side yields nothing; a trainer rank other than 0
    walks verl's generator (producing each tensor is collective over the ranks) and sends nothing; rank 0 with no
    replica refuses."""
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    cls = CheckpointEngineRegistry.get("hotweights")
    assert cls.build_topology(2, 1, [{}, {}, {}]) == ({}, {})
    rollout, other, master = (
        cls(bucket_size=1 << 20),
        cls(bucket_size=1 << 20),
        cls(bucket_size=1 << 20, is_master=True),
    )

    async def received() -> list[Any]:
        return [item async for item in rollout.receive_weights(global_steps=1)]

    walked: list[str] = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("a", "b"):
            walked.append(name)
            yield name, torch.zeros(2)

    assert asyncio.run(received()) == []
    assert asyncio.run(other.send_weights(weights(), global_steps=1)) == {} and walked == ["a", "b"]
    with pytest.raises(hotweights.EngineNotSupportedError, match="urls"):
        asyncio.run(master.send_weights(weights(), global_steps=1))
    with pytest.raises(ValueError, match="transport"):
        cls(bucket_size=0, transport="nccl")
    for bad in (0, "soon", float("inf")):
        with pytest.raises(ValueError, match="stage_timeout"):
            cls(bucket_size=0, stage_timeout=bad)


def test_servers_found_as_verl_names_them() -> None:
    """Without ``urls``, trainer rank 0 finds each replica's server actor by the name verl gives it
    (vllm_async_server.py:1371) and asks its address (``get_server_address``, :229): here two stand-in actors in a
    local Ray cluster, the second on IPv6."""
    import ray

    from hotweights.integrations.verl_checkpoint import verl_server_urls

    class Server:
        def __init__(self, address: str, port: int) -> None:
            self.address = (address, port)

        def get_server_address(self) -> tuple[str, int]:
            return self.address

    from ray.runtime_context import get_runtime_context

    stand_in, ray.get_runtime_context = ray.get_runtime_context, get_runtime_context  # verl_worker_env's, if set
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(Server)
        servers = [
            actor.options(name=f"vllm_server_{r}_0").remote(*a) for r, a in enumerate([("10.0.0.5", 8000), ("::1", 9)])
        ]
        assert verl_server_urls() == ["http://10.0.0.5:8000", "http://[::1]:9"]
        del servers
    finally:
        ray.shutdown()
        ray.get_runtime_context = stand_in


def test_three_steps_through_verls_checkpoint_engine(server: Server, rollout: Any, fresh: Any) -> None:
    trainer = _trainer(_config(urls=[server.url]))
    version = hotweights.connect(server.url)
    assert _served(server) == fresh[0][1]
    for step in (1, 2, 3):
        assert fresh[step][1] != fresh[step - 1][1], f"step {step}: the weights change nothing the test sees"
        metrics, errors = _sync(trainer, rollout, _weights(step), step)
        assert not errors, errors
        assert metrics["hotweights/weight_version"] == step and metrics["hotweights/replicas"] == 1, metrics
        assert _served(server) == fresh[step][1], f"step {step}: the server serves something else"
        assert version.get_weight_version() == str(step)
        assert rollout.server_adapter.server_handle.global_steps == step  # verl's own bookkeeping, unchanged
        print(f"\nstep {step}: {metrics['hotweights/seconds'] * 1e3:.0f} ms, {metrics['hotweights/bytes_sent']:.0f} B")
    # the rollout side's ServerAdapter sent verl's (empty) update to the worker extension at each step
    assert rollout.server_adapter.server_handle.calls.count("update_weights_from_ipc") == 3
    trainer.checkpoint_engine.close()
    assert not our_shm()


def test_collective_transport_refusal_then_step(server: Server, rollout: Any, fresh: Any) -> None:
    """Across machines the buckets go by the collective transport (gloo here): a wrong-shaped tensor is refused in
    the trainer with the typed error, nothing written; the next step goes through, exact."""
    trainer = _trainer(_config(urls=[server.url], transport="collective", host="127.0.0.1"))
    version = hotweights.connect(server.url)
    served, before = _served(server), version.get_weight_version()
    weights = _weights(1)
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    _, errors = _sync(trainer, rollout, weights, 10)
    assert len(errors) == 1 and isinstance(errors[0], hotweights.WeightManifestValidationError), errors
    assert [(m.kind, m.name) for m in errors[0].mismatches] == [("shape", name)]
    assert _served(server) == served and version.get_weight_version() == before
    target = next(s for s in fresh if fresh[s][1] != served)
    metrics, errors = _sync(trainer, rollout, _weights(target), 11)
    assert not errors and metrics["hotweights/weight_version"] == 11, errors
    assert _served(server) == fresh[target][1] and version.get_weight_version() == "11"
    assert trainer.checkpoint_engine.adapters()[server.url].transport.name == "collective"
    trainer.checkpoint_engine.close()


def test_two_replicas_over_the_collective_transport(server: Server, second: Server, rollout: Any, fresh: Any) -> None:
    """Two replicas on other machines: the fleet reaches each through its own collective group (gloo here). A
    wrong-shaped tensor is refused with both replicas as they were; the next step moves both, exactly."""
    trainer = _trainer(_config(urls=[server.url, second.url], transport="collective", host="127.0.0.1"))
    handles = [hotweights.connect(s.url) for s in (server, second)]
    before = [_served(s) for s in (server, second)], [h.get_weight_version() for h in handles]
    weights = _weights(2)
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    _, errors = _sync(trainer, rollout, weights, 12)
    assert len(errors) == 1 and isinstance(errors[0], hotweights.WeightManifestValidationError), errors
    assert ([_served(s) for s in (server, second)], [h.get_weight_version() for h in handles]) == before
    target = next(seed for seed in fresh if fresh[seed][1] not in before[0])
    metrics, errors = _sync(trainer, rollout, _weights(target), 13)
    assert not errors and metrics["hotweights/replicas"] == 2 and metrics["hotweights/weight_version"] == 13, errors
    assert [_served(s) for s in (server, second)] == [fresh[target][1]] * 2
    assert [h.get_weight_version() for h in handles] == ["13", "13"]
    assert {a.transport.name for a in trainer.checkpoint_engine.adapters().values()} == {"collective"}
    trainer.checkpoint_engine.close()


def test_two_replicas_switch_together_or_not_at_all(
    server: Server, second: Server, rollout: Any, fresh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync that one replica of two refuses (it serves a newer version than the trainer's step: another trainer
    installed it) raises the typed error in verl's trainer, and both replicas keep their version, token for token;
    the next sync moves both. Then one replica's server dies: a sync raises, and the other keeps its version."""
    old, new = 1, 2
    assert fresh[old][1] != fresh[new][1], "the two policies give the same outputs"
    a, b = VerlServer(server.url), VerlServer(second.url)
    for handle, version in ((a, 20), (b, 30)):  # both on the old policy; the second replica ahead of the trainer
        hotweights.install(handle, _weights(old), weight_version=version, cast="engine", force=True)
    timeouts: list[float | None] = []  # engine_kwargs' stage_timeout is the fleet's
    fleet = hotweights.Fleet
    monkeypatch.setattr(hotweights, "Fleet", lambda *a, **k: timeouts.append(k.get("timeout")) or fleet(*a, **k))
    trainer = _trainer(_config(urls=[server.url, second.url], stage_timeout=120))
    _, errors = _sync(trainer, rollout, _weights(new), 25)
    assert timeouts == [120.0], timeouts
    assert len(errors) == 1 and isinstance(errors[0], hotweights.StaleWeightVersionError), errors
    assert "replica 1" in " ".join(getattr(errors[0], "__notes__", [])), "the error names the replica"
    assert [_served(s) for s in (server, second)] == [fresh[old][1]] * 2, "a replica moved without the other"
    assert [h.get_weight_version() for h in (a, b)] == ["20", "30"]

    metrics, errors = _sync(trainer, rollout, _weights(new), 31)
    assert not errors and metrics["hotweights/replicas"] == 2 and metrics["hotweights/weight_version"] == 31, errors
    assert [_served(s) for s in (server, second)] == [fresh[new][1]] * 2
    assert [h.get_weight_version() for h in (a, b)] == ["31", "31"]
    print(f"\ntwo replicas: {metrics['hotweights/seconds'] * 1e3:.0f} ms, {metrics['hotweights/bytes_sent']:.0f} B")

    second.kill()
    _, errors = _sync(trainer, rollout, _weights(old), 32)
    assert len(errors) == 1 and isinstance(errors[0], hotweights.HotWeightsTimeoutError), errors
    assert "cannot reach the server" in str(errors[0]), errors
    assert _served(server) == fresh[new][1] and a.get_weight_version() == "31"
    trainer.checkpoint_engine.close()
    assert not our_shm()
