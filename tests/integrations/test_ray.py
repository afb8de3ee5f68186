"""Engines hosted in Ray actors, installed into through ``hotweights.integrations.ray`` on a real local Ray cluster
(``ray.init(num_cpus=2)``): two engine actors, and a trainer actor that installs into them actor to actor (the
driver only starts them and looks at the outcome). A->B->A equal to HF on each policy (the fresh-engine reference of
this fp32 model: ``tests/engine/conftest.py`` asserts they agree), one object-store copy per bucket for both, and a
trainer SIGKILLed between stage and commit: both replicas keep their version and drop what they staged once it
expires."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from hotweights.testing import build_tiny_model, greedy_hf, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    a, b = build_tiny_model("qwen2", 0), build_tiny_model("qwen2", 1)
    paths = {
        "A": str(save_tiny_model(a, tmp_path_factory.mktemp("ray-A"))),
        "B": str(save_tiny_model(b, tmp_path_factory.mktemp("ray-B"))),
    }
    hf = {"A": greedy_hf(a), "B": greedy_hf(b)}
    assert hf["A"] != hf["B"]
    path = os.pathsep.join((str(ROOT / "src"), str(ROOT)))  # this checkout's hotweights and tests
    env = {"PYTHONPATH": path, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    from tests.integrations.ray_actors import EngineHost

    host = ray.remote(EngineHost).options(num_cpus=0, max_concurrency=2)
    engines = [host.remote(paths["A"]) for _ in range(2)]
    assert ray.get([e.greedy.remote() for e in engines], timeout=300) == [hf["A"]] * 2
    try:
        yield {"paths": paths, "hf": hf, "engines": engines}
    finally:
        ray.shutdown()


def trainer(cluster: dict[str, Any], **kwargs: Any) -> Any:
    from tests.integrations.ray_actors import Trainer

    return ray.remote(Trainer).options(num_cpus=0).remote(cluster["paths"], cluster["engines"], **kwargs)


def outputs(cluster: dict[str, Any]) -> list[Any]:
    return ray.get([e.greedy.remote() for e in cluster["engines"]], timeout=120)


def test_a_trainer_actor_installs_into_engine_actors_through_the_object_store(cluster: dict[str, Any]) -> None:
    hf, engines = cluster["hf"], cluster["engines"]
    t = trainer(cluster)
    report = ray.get(t.install.remote("B", 1), timeout=300)
    assert report["ok"] and report["adapters"] == ["multiprocess-ray", "multiprocess-ray"], report
    assert outputs(cluster) == [hf["B"]] * 2
    # both actors fetched the same object-store copy of each bucket: written once for the two
    assert report["bytes_written"] == report["update_bytes"] > 0
    assert ray.get([e.version.remote() for e in engines]) == ["1", "1"]
    ray.get(t.install.remote("A", 2), timeout=300)
    assert outputs(cluster) == [hf["A"]] * 2
    assert ray.get([e.version.remote() for e in engines]) == ["2", "2"]
    ray.kill(t)


def test_a_trainer_killed_between_stage_and_commit_leaves_every_replica_on_its_version(
    cluster: dict[str, Any],
) -> None:
    hf, engines = cluster["hf"], cluster["engines"]
    before = outputs(cluster)
    versions = ray.get([e.version.remote() for e in engines])
    target = "B" if before[0] == hf["A"] else "A"
    assert hf[target] != before[0]
    t = trainer(cluster, staging_expiry=3.0)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(t.stage_and_die.remote(target, int(versions[0]) + 1), timeout=300)
    statuses = ray.get([e.status.remote() for e in engines])
    staged = [s["session"] for s in statuses]
    assert all(staged), statuses  # the trainer died with the update staged on both, not committed
    assert outputs(cluster) == before  # still serving the previous version, generation unaffected
    time.sleep(4.5)  # past the staging expiry
    statuses = ray.get([e.status.remote() for e in engines])
    assert [s["session"] for s in statuses] == ["", ""]
    assert all(u in s["expired"] for u, s in zip(staged, statuses, strict=True))
    assert outputs(cluster) == before
    assert ray.get([e.version.remote() for e in engines]) == versions
    # the buckets the dead trainer put into the object store went with it (Ray frees what a dead owner owned), and
    # the actors dropped their views of them with the expired sessions
    # and a new trainer installs as usual
    t2 = trainer(cluster)
    report = ray.get(t2.install.remote(target, int(versions[0]) + 2), timeout=300)
    assert report["ok"] and outputs(cluster) == [hf[target]] * 2
    ray.kill(t2)


def test_an_unproven_family_is_probed_in_an_engine_actor_and_a_planted_fault_fails_closed(
    cluster: dict[str, Any],
) -> None:
    """No family proven (as on vLLM 0.33, 0.34 and GPUs): the first install into an actor's engine is probed
    by default, scored by the actor inside the install's hold; a write that scales a norm by 1.01 fails closed."""
    hf, engines = cluster["hf"], cluster["engines"]
    served = ray.get([e.version.remote() for e in engines])  # "default" before any install (this test run alone)
    version = max(int(v) if v and v.isdigit() else 0 for v in served) + 1
    before = outputs(cluster)
    target = "B" if before[0] == hf["A"] else "A"
    t = trainer(cluster)
    try:
        ray.get(engines[1].plant.remote("scale layers.0.post_attention_layernorm 1.01"))
        probed = ray.get(t.install_into.remote(0, target, version, True), timeout=300)
        assert "probed at v" in (probed.get("family_check") or ""), probed
        assert "family_probe" in probed["phases"]
        failed = ray.get(t.install_into.remote(1, target, version, True), timeout=300)
        assert failed.get("error") == "FamilyProbeError", failed
        assert ray.get(engines[0].greedy.remote(), timeout=120) == hf[target]
        with pytest.raises(ray.exceptions.RayTaskError, match="PartialUpdateError"):
            ray.get(engines[1].greedy.remote(), timeout=120)  # fails closed
        ray.get(engines[1].plant.remote(""))
        healed = ray.get(t.install_into.remote(1, target, version, True), timeout=300)
        assert "probed at v" in (healed.get("family_check") or ""), healed
        assert outputs(cluster) == [hf[target]] * 2
    finally:
        ray.get(engines[1].plant.remote(""))
        ray.kill(t)
