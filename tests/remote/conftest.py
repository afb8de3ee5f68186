"""Remote-engine tests: no test leaves shared-memory segments of this process behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def own_segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"hotweights-{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def shm_clean() -> Iterator[None]:
    """No test leaves shared-memory segments of this process behind."""
    yield
    assert own_segments() == []
