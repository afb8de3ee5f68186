"""InstallerOptions: the rules for buckets in flight and the aside method, checked once when an installer is built."""

from __future__ import annotations

import pytest

from hotweights.adapters import sending
from hotweights.adapters.options import InstallerOptions, PathAbilities
from hotweights.adapters.sending import ASIDE_BUCKET_BYTES, GATHERED_BUCKET_BYTES, bucket_default
from hotweights.core.errors import EngineNotSupportedError

PATH = PathAbilities("multiprocess-shm", reads_back=True, deltas=True, releases_segments=True)


@pytest.mark.parametrize("depth", [0, -1, 9])
def test_buckets_in_flight_is_bounded(depth: int) -> None:
    with pytest.raises(ValueError, match="buckets_in_flight must be between 1 and 8"):
        InstallerOptions(buckets_in_flight=depth).validate(PATH)


@pytest.mark.parametrize("depth", [None, 1, 2, 8])
def test_buckets_in_flight_in_bounds(depth: int | None) -> None:
    InstallerOptions(buckets_in_flight=depth).validate(PATH)


def test_aside_is_an_atomic_commit() -> None:
    with pytest.raises(ValueError, match="atomic commit"):
        InstallerOptions(install_method="aside", commit="streaming").validate(PATH)
    InstallerOptions(install_method="aside").validate(PATH)


def test_aside_refuses_verify_and_delta() -> None:
    aside = InstallerOptions(install_method="aside")
    with pytest.raises(ValueError, match="verify=True reads back"):
        aside.check_call(True, False, PATH)
    with pytest.raises(EngineNotSupportedError, match="aside"):
        aside.check_call(None, True, PATH)
    assert aside.check_call(None, False, PATH) is False


def test_unknown_method_names_the_four() -> None:
    with pytest.raises(ValueError, match="'auto', 'reload', 'direct' or 'aside'"):
        InstallerOptions(install_method="fast").validate(PATH)  # type: ignore[arg-type]


def test_default_buckets_stay_small_where_they_hold_something(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default bucket is the transport's preferred size, except an aside bucket (built inside one ``stage``
    call, holding the engine's step loop) and a bucket the leader of a sharded state dict gathers (held on its
    device): at most 32 MiB each."""
    monkeypatch.setattr(sending, "default_bucket_bytes", lambda preferred: preferred)  # no free-memory cap here
    assert bucket_default(128 << 20, "auto") == bucket_default(128 << 20, "direct") == 128 << 20
    assert bucket_default(128 << 20, "aside") == ASIDE_BUCKET_BYTES == 32 << 20
    assert bucket_default(128 << 20, "auto", gathered=True) == GATHERED_BUCKET_BYTES == 32 << 20
    assert bucket_default(16 << 20, "aside", gathered=True) == 16 << 20
