"""Shared test configuration: hypothesis profiles (``HYPOTHESIS_PROFILE=slow`` for the long runs), and
:func:`our_shm` for the suites that check what a test left in shared memory."""

from __future__ import annotations

import gc
import os

from hypothesis import HealthCheck, settings

from hotweights.transports import shm

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def our_shm() -> list[str]:
    """What this test process left in /dev/shm: hotweights segments and private checkpoint directories (other
    processes may be installing too), less the bucket files that live shm transports keep for their next install
    (they go with the transport: tests/unit/test_transports.py)."""
    gc.collect()  # an adapter dropped by a test takes its transport's files with it
    held = {p.name for p in shm._HELD}
    return sorted(p.name for p in shm.SHM_DIR.glob(f"hotweights-{os.getpid()}-*") if p.name not in held)
