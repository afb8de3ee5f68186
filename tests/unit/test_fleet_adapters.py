"""``Fleet(engines, adapters=...)``: each replica installs through the adapter given for it (its own transport), and
the fleet stays all-or-nothing; adapters that do not fit the engines are refused before anything is sent."""

from __future__ import annotations

import pytest
import torch

import hotweights
from hotweights import InstallError
from hotweights.fake import FakeEngine, FakeWire, _FakeInstaller


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.full((8, 4), value), "norm.weight": torch.full((4,), value)}


def test_each_replica_installs_through_its_own_adapter_together_or_not_at_all() -> None:
    fakes = [FakeEngine(_weights(0.0)) for _ in range(2)]  # each picks the "bytes" transport by itself
    shm = _FakeInstaller(fakes[1], FakeWire(fakes[1]), "shm")
    fleet = hotweights.Fleet(fakes, adapters=[None, shm])
    report = fleet.install(_weights(1.0), weight_version=1)
    assert [r.adapter for r in report.replicas if r is not None] == ["fake-bytes", "fake-shm"]
    assert [f.version for f in fakes] == [1, 1]
    fakes[1].fail_at = "stage"  # only the replica with the given adapter fails: neither commits
    with pytest.raises(InstallError, match="all 2 replicas were aborted before writing"):
        fleet.install(_weights(2.0), weight_version=2)
    assert [f.version for f in fakes] == [1, 1]
    assert all(torch.equal(f.weights["norm.weight"], torch.ones(4)) for f in fakes)
    shm.close()


def test_adapters_that_do_not_fit_the_engines_are_refused() -> None:
    fakes = [FakeEngine(_weights(0.0)) for _ in range(2)]
    with pytest.raises(ValueError, match="1 adapters for 2 engines"):
        hotweights.Fleet(fakes, adapters=[None])
    with pytest.raises(ValueError, match=r"adapters\[0\] was built on another engine"):
        hotweights.Fleet(fakes, adapters=[hotweights.adapter_for(fakes[1]), None])
    with pytest.raises(ValueError, match="Fleet\\(engines, adapters="):
        hotweights.Fleet(fakes).install(_weights(1.0), weight_version=1, adapter=hotweights.adapter_for(fakes[0]))
    assert [f.version for f in fakes] == [None, None]
