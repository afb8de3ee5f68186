"""The public fake engine (``hotweights.fake``): hotweights' real trainer side against an engine that serves a state
dict, as users' own tests drive it."""

from __future__ import annotations

import asyncio

import pytest
import torch

import hotweights
from hotweights import (
    InstallError,
    PartialUpdateError,
    StaleWeightVersionError,
    WeightManifestValidationError,
)
from hotweights.fake import FakeEngine


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.full((8, 4), value), "norm.weight": torch.full((4,), value)}


@pytest.mark.parametrize("transport", ["bytes", "shm"])
def test_an_install_swaps_every_tensor_in_at_commit(transport: str) -> None:
    fake = FakeEngine(_weights(0.0), transport=transport, bucket_bytes=64)
    assert fake.version is None
    report = hotweights.install(fake, _weights(1.0), weight_version=1)
    assert torch.equal(fake.weights["embed.weight"], torch.ones(8, 4)) and fake.version == 1
    assert fake.calls == ["begin", "stage", "stage", "prepare", "commit"]  # 128 + 16 bytes in 64-byte buckets
    assert (report.adapter, report.install_method) == (f"fake-{transport}", "fake")
    assert report.prefix_cache_reset and fake.prefix_cache_resets == 1


def test_bad_input_is_refused_before_anything_is_written() -> None:
    fake = FakeEngine(_weights(0.0))
    hotweights.install(fake, _weights(1.0), weight_version=1)
    fake.calls.clear()
    with pytest.raises(WeightManifestValidationError, match=r"shape mismatch for 'norm\.weight'"):
        hotweights.install(fake, {**_weights(2.0), "norm.weight": torch.zeros(5)}, weight_version=2)
    with pytest.raises(StaleWeightVersionError):
        hotweights.install(fake, _weights(2.0), weight_version=1)
    assert fake.calls == [] and fake.version == 1 and torch.equal(fake.weights["norm.weight"], torch.ones(4))


@pytest.mark.parametrize("verb", ["begin", "stage", "prepare"])
def test_a_failure_before_the_commit_leaves_the_old_weights_serving(verb: str) -> None:
    fake = FakeEngine(_weights(0.0))
    hotweights.install(fake, _weights(1.0), weight_version=1)
    fake.fail_at = verb
    with pytest.raises(InstallError, match=f"failed before the model was touched.*injected failure at {verb}"):
        hotweights.install(fake, _weights(2.0), weight_version=2)
    assert fake.calls[-1] == "abort" and fake.version == 1
    with fake.generating():  # still serving
        assert torch.equal(fake.weights["embed.weight"], torch.ones(8, 4))


def test_a_failure_while_writing_fails_closed_until_a_full_install() -> None:
    fake = FakeEngine(_weights(0.0))
    fake.fail_at = "commit"
    with pytest.raises(InstallError, match="failed while writing"):
        hotweights.install(fake, _weights(1.0), weight_version=1)
    with pytest.raises(PartialUpdateError), fake.generating():
        pass
    assert fake.version is None
    hotweights.install(fake, _weights(1.0), weight_version=1)  # the same version heals it
    with fake.generating():
        assert fake.version == 1


def test_verify_and_delta_are_refused_by_name() -> None:
    fake = FakeEngine(_weights(0.0))
    with pytest.raises(ValueError, match="cannot read the engine's parameters back"):
        hotweights.install(fake, _weights(1.0), weight_version=1, verify=True)
    with pytest.raises(hotweights.EngineNotSupportedError, match="does not install deltas"):
        hotweights.install(fake, _weights(1.0), weight_version=1, delta=True)
    assert fake.calls == [] and fake.version is None


def test_install_async_and_a_fleet_of_fakes() -> None:
    fakes = [FakeEngine(_weights(0.0)) for _ in range(2)]
    report = asyncio.run(hotweights.install_async(fakes[0], _weights(1.0), weight_version=1))
    assert report.weight_version == 1

    fleet = hotweights.Fleet(fakes)
    fleet.install(_weights(2.0), weight_version=2, force=True)
    assert [f.version for f in fakes] == [2, 2]
    fakes[1].fail_at = "prepare"  # one replica fails before the commit point: none commits
    with pytest.raises(InstallError, match="all 2 replicas were aborted before writing"):
        fleet.install(_weights(3.0), weight_version=3)
    assert [f.version for f in fakes] == [2, 2]
    assert all(torch.equal(f.weights["norm.weight"], torch.full((4,), 2.0)) for f in fakes)


def test_the_module_example_runs() -> None:
    import doctest

    import hotweights.fake

    assert doctest.testmod(hotweights.fake).failed == 0
