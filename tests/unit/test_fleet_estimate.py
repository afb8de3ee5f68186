"""The fleet cost model (``hotweights.fleet.estimate``): its worked example, its monotonicity, its byte counts and its
argument checks."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest

from hotweights.fleet import Calibration, FleetEstimate, estimate
from hotweights.fleet.estimate import CALIBRATION

GB = 1_000_000_000

#: Round numbers so the worked example can be checked by hand.
CAL = Calibration(write_gbps=2.0, stage_gbps=4.0, install_gbps=1.0, per_bucket_s=0.01, fixed_s=0.5, host_parallelism=2)


def test_worked_example() -> None:
    # 1 GB in 10 buckets of 0.1 GB, 3 hosts x 4 replicas, star over one 1 GB/s link, 2 buckets in flight.
    # contention c = 4 replicas / 2 parallel = 2
    # per bucket: write 0.1/2 = 0.05 s, network (3-1) * 0.1/1 = 0.2 s, stage 2 * 0.1/4 = 0.05 s; sum = 0.3 s
    # period = max(0.05, 0.2, 0.05, 0.3/2 = 0.15) = 0.2 s (network-bound)
    # transfer = (10 - 1) * 0.2 + 0.3 = 2.1 s
    # install = 2 * 1/1 = 2.0 s; overhead = 10 * 0.01 + 0.5 = 0.6 s; total = 2.1 + 2.0 + 0.6 = 4.7 s
    e = estimate(GB, hosts=3, replicas_per_host=4, link_gbps=1.0, bucket_bytes=GB // 10, fanout="star", calibration=CAL)
    assert e.buckets == 10
    assert e.write_s == pytest.approx(0.5)
    assert e.network_s == pytest.approx(2.0)
    assert e.stage_s == pytest.approx(0.5)
    assert e.transfer_s == pytest.approx(2.1)
    assert e.install_s == pytest.approx(2.0)
    assert e.overhead_s == pytest.approx(0.6)
    assert e.total_s == pytest.approx(4.7)
    assert e.bottleneck == "network"
    assert e.bytes_written == 3 * GB
    assert e.bytes_sent == 2 * GB
    assert e.replicas == 12


def test_total_is_sum_of_transfer_install_overhead() -> None:
    e = estimate(7 * GB + 123, hosts=5, replicas_per_host=3)
    assert e.total_s == pytest.approx(e.transfer_s + e.install_s + e.overhead_s)


def test_pipelining_bounds() -> None:
    # Never faster than the slowest phase alone, never slower than the phases run back to back.
    for in_flight in (1, 2, 4):
        e = estimate(10 * GB, hosts=4, buckets_in_flight=in_flight, calibration=CAL)
        phases = (e.write_s, e.network_s, e.stage_s)
        assert max(phases) <= e.transfer_s + 1e-12
        assert e.transfer_s <= sum(phases) + 1e-12


def test_one_bucket_in_flight_is_serial() -> None:
    e = estimate(GB, bucket_bytes=GB // 10, buckets_in_flight=1, calibration=CAL)
    assert e.transfer_s == pytest.approx(e.write_s + e.network_s + e.stage_s)
    assert e.bottleneck == "in_flight"


def test_more_buckets_in_flight_never_slower() -> None:
    times = [estimate(10 * GB, hosts=8, buckets_in_flight=k).transfer_s for k in (1, 2, 3, 8)]
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]


@pytest.mark.parametrize("fanout", ["tree", "star"])
@pytest.mark.parametrize("hosts", [1, 2, 9])
def test_more_bytes_more_time(fanout: Any, hosts: int) -> None:
    sizes = [1, 1 << 20, (32 << 20) + 1, GB, 10 * GB, 100 * GB]
    totals = [estimate(n, hosts=hosts, replicas_per_host=3, fanout=fanout).total_s for n in sizes]
    assert all(a < b for a, b in itertools.pairwise(totals)), totals


def test_star_network_grows_with_hosts() -> None:
    times = [estimate(10 * GB, hosts=h, fanout="star").network_s for h in (1, 2, 3, 8, 64)]
    assert times[0] == 0
    assert all(a < b for a, b in itertools.pairwise(times)), times
    assert times[-1] == pytest.approx(63 * times[2] / 2)  # linear in hosts - 1


def test_tree_cheaper_than_star_for_many_hosts() -> None:
    for hosts in (4, 16, 100):
        tree = estimate(100 * GB, hosts=hosts, fanout="tree")
        star = estimate(100 * GB, hosts=hosts, fanout="star")
        assert tree.network_s < star.network_s
        assert tree.total_s < star.total_s
        assert tree.network_s == pytest.approx(star.network_s * math.ceil(math.log2(hosts)) / (hosts - 1))
    for hosts in (1, 2):  # no difference until there are two hosts to forward to
        assert estimate(GB, hosts=hosts, fanout="tree") == dataclasses.replace(
            estimate(GB, hosts=hosts, fanout="star"), fanout="tree"
        )


def test_more_links_less_network_time() -> None:
    one = estimate(10 * GB, hosts=16, links_per_host=1, link_gbps=50.0)
    eight = estimate(10 * GB, hosts=16, links_per_host=8, link_gbps=50.0)
    assert eight.network_s == pytest.approx(one.network_s / 8)


@pytest.mark.parametrize("hosts", [1, 2, 7, 100])
def test_bytes_written_one_group_per_host(hosts: int) -> None:
    for replicas in (1, 4):
        e = estimate(3 * GB + 5, hosts=hosts, replicas_per_host=replicas)
        assert e.bytes_written == (3 * GB + 5) * hosts
        assert e.bytes_sent == (3 * GB + 5) * (hosts - 1)


def test_single_replica_one_host_sends_nothing() -> None:
    e = estimate(5 * GB)
    assert e.bytes_sent == 0
    assert e.network_s == 0
    assert e.bytes_written == 5 * GB
    assert e.bottleneck != "network"


def test_host_contention_above_parallelism() -> None:
    base = estimate(GB, replicas_per_host=1, calibration=CAL)
    at_limit = estimate(GB, replicas_per_host=2, calibration=CAL)  # host_parallelism=2: no slowdown yet
    over = estimate(GB, replicas_per_host=8, calibration=CAL)
    assert at_limit.stage_s == pytest.approx(base.stage_s)
    assert at_limit.install_s == pytest.approx(base.install_s)
    assert over.stage_s == pytest.approx(4 * base.stage_s)
    assert over.install_s == pytest.approx(4 * base.install_s)
    assert over.write_s == pytest.approx(base.write_s)  # one copy per host whatever the replica count


def test_explicit_rates_override_calibration() -> None:
    e = estimate(GB, calibration=CAL, write_gbps=1.0, install_gbps=0.5, fixed_s=0.0, host_parallelism=1)
    assert e.write_s == pytest.approx(1.0)
    assert e.install_s == pytest.approx(2.0)
    assert e.overhead_s == pytest.approx(e.buckets * CAL.per_bucket_s)


def test_default_calibration_is_used() -> None:
    e = estimate(GB)
    assert e.write_s == pytest.approx(1 / CALIBRATION.write_gbps)
    assert e.install_s == pytest.approx(1 / CALIBRATION.install_gbps)


def test_small_model_is_one_bucket() -> None:
    e = estimate(1000, bucket_bytes=32 << 20, calibration=CAL)
    assert e.buckets == 1
    assert e.transfer_s == pytest.approx(e.write_s + e.network_s + e.stage_s)


def test_estimate_is_frozen_and_prints_summary() -> None:
    e = estimate(470 * GB, hosts=100, replicas_per_host=1, link_gbps=50.0, links_per_host=8)
    assert isinstance(e, FleetEstimate)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.total_s = 0.0  # type: ignore[misc]
    text = str(e)
    first, *rest = text.splitlines()
    assert "100 replica(s) on 100 host(s)" in first and f"{e.total_s:.3f} s" in first
    for phase in ("write", "network", "stage", "transfer", "install", "overhead", "bytes sent"):
        assert any(line.strip().startswith(phase) for line in rest), phase


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"model_bytes": 0}, "model_bytes"),
        ({"model_bytes": -1}, "model_bytes"),
        ({"replicas_per_host": 0}, "replicas_per_host"),
        ({"hosts": 0}, "hosts"),
        ({"hosts": -3}, "hosts"),
        ({"links_per_host": 0}, "links_per_host"),
        ({"buckets_in_flight": 0}, "buckets_in_flight"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"link_gbps": 0.0}, "link_gbps"),
        ({"link_gbps": -1.0}, "link_gbps"),
        ({"link_gbps": math.nan}, "link_gbps"),
        ({"write_gbps": 0.0}, "write_gbps"),
        ({"stage_gbps": -2.0}, "stage_gbps"),
        ({"install_gbps": 0.0}, "install_gbps"),
        ({"per_bucket_s": -0.001}, "per_bucket_s"),
        ({"fixed_s": -1.0}, "fixed_s"),
        ({"host_parallelism": 0}, "host_parallelism"),
        ({"fanout": "ring"}, "fanout"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], name: str) -> None:
    args: dict[str, Any] = {"model_bytes": GB, **kwargs}
    with pytest.raises(ValueError, match=name):
        estimate(**args)


@pytest.mark.parametrize("field", ["write_gbps", "stage_gbps", "install_gbps", "per_bucket_s", "fixed_s"])
def test_bad_calibration_names_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        bad: dict[str, Any] = {field: -1.0}
        dataclasses.replace(CAL, **bad)
    with pytest.raises(ValueError, match="host_parallelism"):
        dataclasses.replace(CAL, host_parallelism=0)


def test_zero_overheads_allowed() -> None:
    e = estimate(GB, per_bucket_s=0.0, fixed_s=0.0, per_replica_s=0.0)
    assert e.overhead_s == 0


def test_the_trainer_pays_per_replica() -> None:
    from hotweights.fleet import Calibration, estimate

    cal = Calibration(
        write_gbps=1.0, stage_gbps=1.0, install_gbps=1.0, per_bucket_s=0.0, fixed_s=0.0, per_replica_s=0.1
    )
    one, four = estimate(10**9, calibration=cal), estimate(10**9, replicas_per_host=4, calibration=cal)
    # 4 replicas on one host with host_parallelism 1: stage and install stretch 4x, plus 3 more replicas' calls
    assert four.overhead_s - one.overhead_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="per_replica_s"):
        estimate(10**9, per_replica_s=-1.0)
