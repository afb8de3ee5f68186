"""A cost model for fleet installs: how long one trainer takes to install new weights into N rollout replicas.

Pure Python (no torch): plan a fleet, size buckets, or sanity-check a measured install against what the hardware
should allow. Units follow the rest of hotweights: every ``*_gbps`` is gigabytes (1e9 bytes) per second, so a
400 Gb/s NIC is ``link_gbps=50``.

The fleet: ``hosts`` hosts, each running ``replicas_per_host`` replicas; the trainer sits on one of them. Each host
holds one copy of every bucket (its host-local group's shared memory or object-store copy), which all of its
replicas read. An install runs in two steps:

* **transfer**, bucket by bucket and pipelined: *write* (the trainer packs the bucket into host memory), *network*
  (the bucket reaches every other host, landing in that host's memory), *stage* (each replica's workers read and
  check it);
* **commit**, after every replica has staged every bucket: *install* (each replica writes the bytes into its model).

Model, per bucket of ``b = min(bucket_bytes, model_bytes)`` bytes (``n = model_bytes / b`` buckets; a short last
bucket counts pro rata, so phase sums are exact), with ``c = max(1, replicas_per_host / host_parallelism)`` the
host-memory contention factor and ``bw = link_gbps * links_per_host`` a host's network bandwidth::

    t_write   = b / write_gbps
    t_network = 0                                  one host
              = (hosts - 1) * b / bw               star: the trainer's links send one copy per other host
              = ceil(log2(hosts)) * b / bw         tree: copies double each round (see below)
    t_stage   = c * b / stage_gbps

    period    = max(t_write, t_network, t_stage, (t_write + t_network + t_stage) / buckets_in_flight)
    transfer  = (n - 1) * period + (t_write + t_network + t_stage)
    install   = c * model_bytes / install_gbps
    overhead  = ceil(n) * per_bucket_s + fixed_s + replicas_per_host * hosts * per_replica_s
    total     = transfer + install + overhead

*Pipelining.* In steady state a new bucket finishes every ``period`` seconds: no faster than the slowest stage, and,
since each bucket holds one of ``buckets_in_flight`` slots from its write until its stage ends, no faster than
``sum / buckets_in_flight`` (Little's law). The first bucket still pays every stage once (the fill term,
``t_write + t_network + t_stage``). With one bucket in flight, ``period`` is the sum and the transfer is serial,
``n * sum``; with two or more and balanced stages it approaches ``n * max(stage)``.

*Tree fan-out.* Ray's object store serves a bucket only once a node holds all of it, and every node that does can
serve it, so the holders double each round: ``ceil(log2(hosts))`` rounds. The busiest link (the trainer's, which
sends in every round) carries ``ceil(log2(hosts)) * b`` per bucket, and with buckets in flight the rounds of
different buckets overlap, so that link's load, not the rounds' latency, sets the network stage. A pipelined
collective broadcast (NCCL ring or chain, chunked below the bucket size) does better, about ``b / bw`` per bucket
whatever the host count; the model keeps the store-and-forward figure, an upper bound for both.

*Contention.* The replicas on one host share its memory bandwidth: up to ``host_parallelism`` of them stage and
install at full speed at once, more stretch both by ``replicas_per_host / host_parallelism``. Writes are not
contended (one copy per host), nor is the network stage slowed by host memory.

*Overheads.* ``per_bucket_s`` (coordination round trips per bucket, counted on the critical path, not overlapped),
``fixed_s`` (set-up, barriers, the commit round) and ``per_replica_s`` (what the trainer spends per replica: its
begin, prepare, commit, prefix-cache and version calls, and the threads that issue them, which share the trainer's
cores; counted once per replica of the fleet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["CALIBRATION", "DEFAULT_LINK_GBPS", "Calibration", "FleetEstimate", "estimate"]

#: A host's network bandwidth per link when none is given, GB/s: one 100 Gb/s NIC.
DEFAULT_LINK_GBPS = 12.5


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):  # also rejects NaN
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Calibration:
    """Host rates the model needs, measured on one machine.

    Args:
        write_gbps: Trainer packing a bucket into host memory, GB/s.
        stage_gbps: One replica's workers reading and checking a bucket, GB/s.
        install_gbps: One replica writing the staged bytes into its model, GB/s.
        per_bucket_s: Coordination cost per bucket, seconds.
        fixed_s: Cost per install independent of size, seconds.
        host_parallelism: Replicas on one host that stage or install at full speed at once.
        machine: Where the figures come from.
        per_replica_s: The trainer's cost per replica (its calls into that replica), seconds.
    """

    write_gbps: float
    stage_gbps: float
    install_gbps: float
    per_bucket_s: float
    fixed_s: float
    host_parallelism: int = 1
    machine: str = "unspecified"
    per_replica_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("write_gbps", "stage_gbps", "install_gbps"):
            _positive(name, getattr(self, name))
        _non_negative("per_bucket_s", self.per_bucket_s)
        _non_negative("fixed_s", self.fixed_s)
        _non_negative("per_replica_s", self.per_replica_s)
        _positive_int("host_parallelism", self.host_parallelism)


# measured by benchmarks/bench_fleet.py on this project's 2-core CPU machine (2026-12-02): one replica, the 150m
# fp32 model (612 MB) through /dev/shm; the trainer's calls into a replica are ``per_replica_s``.
CALIBRATION = Calibration(
    write_gbps=4.70,
    stage_gbps=27.5,
    install_gbps=1.70,
    per_bucket_s=0.0,
    fixed_s=0.0,
    host_parallelism=2,
    machine="2-core CPU machine, /dev/shm, 150m fp32 (bench_fleet.py, 2026-12-02)",
    per_replica_s=0.00075,
)


@dataclass(frozen=True)
class FleetEstimate:
    """Predicted cost of one fleet install, in seconds per phase.

    ``write_s``, ``network_s`` and ``stage_s`` are each phase's busy time summed over buckets (what it would cost
    alone); ``transfer_s`` is their pipelined wall time. ``total_s = transfer_s + install_s + overhead_s``.

    Args:
        model_bytes: Bytes per replica install.
        hosts: Hosts running replicas (the trainer's among them).
        replicas_per_host: Replicas per host.
        fanout: How buckets reach the other hosts.
        buckets: Buckets per install.
        buckets_in_flight: Buckets the pipeline holds at once.
        write_s: Trainer writing every bucket once.
        network_s: Moving every bucket to every other host, on the busiest link.
        stage_s: One host's replicas staging every bucket, contention included.
        transfer_s: Write, network and stage pipelined.
        install_s: One host's replicas installing, contention included.
        overhead_s: Per-bucket, per-replica and fixed overheads.
        total_s: The whole install.
        bytes_written: Bytes landed in host memory: one copy per host-local group.
        bytes_sent: Bytes crossing the network.
        bottleneck: The pipeline stage that sets the period (``"write"``, ``"network"``, ``"stage"``, or
            ``"in_flight"`` when too few buckets are in flight to overlap them).
    """

    model_bytes: int
    hosts: int
    replicas_per_host: int
    fanout: Literal["tree", "star"]
    buckets: int
    buckets_in_flight: int
    write_s: float
    network_s: float
    stage_s: float
    transfer_s: float
    install_s: float
    overhead_s: float
    total_s: float
    bytes_written: int
    bytes_sent: int
    bottleneck: str

    @property
    def replicas(self) -> int:
        """Replicas in the fleet."""
        return self.hosts * self.replicas_per_host

    def __str__(self) -> str:
        gb = self.model_bytes / 1e9
        head = (
            f"{gb:.3g} GB into {self.replicas} replica(s) on {self.hosts} host(s) ({self.fanout}): "
            f"{self.total_s:.3f} s ({self.bottleneck}-bound, {self.buckets} buckets, "
            f"{self.buckets_in_flight} in flight)"
        )
        rows = [
            ("write", self.write_s),
            ("network", self.network_s),
            ("stage", self.stage_s),
            ("transfer (pipelined)", self.transfer_s),
            ("install", self.install_s),
            ("overhead", self.overhead_s),
        ]
        lines = [head, *(f"  {name:<21}{seconds:12.3f} s" for name, seconds in rows)]
        lines.append(f"  {'bytes written':<21}{self.bytes_written / 1e9:12.3f} GB")
        lines.append(f"  {'bytes sent':<21}{self.bytes_sent / 1e9:12.3f} GB")
        return "\n".join(lines)


def estimate(
    model_bytes: int,
    *,
    replicas_per_host: int = 1,
    hosts: int = 1,
    link_gbps: float = DEFAULT_LINK_GBPS,
    links_per_host: int = 1,
    buckets_in_flight: int = 2,
    bucket_bytes: int = 32 << 20,
    write_gbps: float | None = None,
    stage_gbps: float | None = None,
    install_gbps: float | None = None,
    per_bucket_s: float | None = None,
    fixed_s: float | None = None,
    host_parallelism: int | None = None,
    per_replica_s: float | None = None,
    fanout: Literal["tree", "star"] = "tree",
    calibration: Calibration = CALIBRATION,
) -> FleetEstimate:
    """Predict one fleet install's cost (the formula is in the module docstring).

    Host rates left as None come from ``calibration``.

    Args:
        model_bytes: Bytes each replica installs.
        replicas_per_host: Replicas on each host.
        hosts: Hosts running replicas, the trainer's among them.
        link_gbps: Bandwidth of one network link, GB/s (a 400 Gb/s NIC is 50).
        links_per_host: Links a host stripes a transfer over.
        buckets_in_flight: Buckets the pipeline holds at once (1: no overlap).
        bucket_bytes: Bytes per bucket.
        write_gbps: Trainer write rate, GB/s.
        stage_gbps: One replica's staging rate, GB/s.
        install_gbps: One replica's install rate, GB/s.
        per_bucket_s: Coordination cost per bucket, seconds.
        fixed_s: Cost per install, seconds.
        host_parallelism: Replicas per host that stage or install at full speed at once.
        per_replica_s: The trainer's cost per replica, seconds.
        fanout: ``"tree"`` (Ray's object store or a broadcast: copies double each round) or ``"star"`` (the trainer
            sends every copy itself).
        calibration: Where the rates left as None come from.

    Returns:
        The estimate.

    Raises:
        ValueError: A size, count or rate is not positive (an overhead negative), or ``fanout`` is unknown; the
            message names the argument.
    """
    _positive_int("model_bytes", model_bytes)
    _positive_int("replicas_per_host", replicas_per_host)
    _positive_int("hosts", hosts)
    _positive_int("links_per_host", links_per_host)
    _positive_int("buckets_in_flight", buckets_in_flight)
    _positive_int("bucket_bytes", bucket_bytes)
    _positive("link_gbps", link_gbps)
    if fanout not in ("tree", "star"):
        raise ValueError(f"fanout must be 'tree' or 'star', got {fanout!r}")
    write = calibration.write_gbps if write_gbps is None else write_gbps
    stage = calibration.stage_gbps if stage_gbps is None else stage_gbps
    install = calibration.install_gbps if install_gbps is None else install_gbps
    per_bucket = calibration.per_bucket_s if per_bucket_s is None else per_bucket_s
    fixed = calibration.fixed_s if fixed_s is None else fixed_s
    parallelism = calibration.host_parallelism if host_parallelism is None else host_parallelism
    per_replica = calibration.per_replica_s if per_replica_s is None else per_replica_s
    _non_negative("per_replica_s", per_replica)
    _positive("write_gbps", write)
    _positive("stage_gbps", stage)
    _positive("install_gbps", install)
    _non_negative("per_bucket_s", per_bucket)
    _non_negative("fixed_s", fixed)
    _positive_int("host_parallelism", parallelism)

    gigabytes = model_bytes / 1e9
    bucket = min(bucket_bytes, model_bytes) / 1e9
    buckets = math.ceil(model_bytes / bucket_bytes)
    contention = max(1.0, replicas_per_host / parallelism)
    if hosts == 1:
        copies_on_busiest_link = 0
    elif fanout == "star":
        copies_on_busiest_link = hosts - 1
    else:
        copies_on_busiest_link = math.ceil(math.log2(hosts))

    seconds_per_gb = {
        "write": 1 / write,
        "network": copies_on_busiest_link / (link_gbps * links_per_host),
        "stage": contention / stage,
    }
    per_bucket_stage = {name: cost * bucket for name, cost in seconds_per_gb.items()}
    fill = sum(per_bucket_stage.values())
    bottleneck = max(per_bucket_stage, key=lambda name: per_bucket_stage[name])
    period = per_bucket_stage[bottleneck]
    if fill / buckets_in_flight > period:
        period, bottleneck = fill / buckets_in_flight, "in_flight"
    transfer_s = (gigabytes / bucket - 1) * period + fill
    install_s = contention * gigabytes / install
    overhead_s = buckets * per_bucket + fixed + per_replica * replicas_per_host * hosts

    return FleetEstimate(
        model_bytes=model_bytes,
        hosts=hosts,
        replicas_per_host=replicas_per_host,
        fanout=fanout,
        buckets=buckets,
        buckets_in_flight=buckets_in_flight,
        write_s=gigabytes * seconds_per_gb["write"],
        network_s=gigabytes * seconds_per_gb["network"],
        stage_s=gigabytes * seconds_per_gb["stage"],
        transfer_s=transfer_s,
        install_s=install_s,
        overhead_s=overhead_s,
        total_s=transfer_s + install_s + overhead_s,
        bytes_written=model_bytes * hosts,
        bytes_sent=model_bytes * (hosts - 1),
        bottleneck=bottleneck,
    )
