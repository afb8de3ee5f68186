"""The worker side of the same-host proof reads one kind of file only: a trainer's proof in shared memory."""

from __future__ import annotations

import secrets

import pytest

from hotweights.transports.shm_files import SHM_DIR
from hotweights.vllm.worker.extension import ENGINE_OPS


def test_a_worker_reads_back_the_trainers_proof_file_and_nothing_else() -> None:
    sees = ENGINE_OPS["sees_shm"]
    name = f"hotweights-proof-{secrets.token_hex(16)}"
    assert sees(None, name) == ""  # not there (yet): another host would answer this
    (SHM_DIR / name).write_text("ab" * 40)
    try:
        assert sees(None, name) == ("ab" * 40)[:64]  # at most 64 characters
    finally:
        (SHM_DIR / name).unlink()
    for bad in ("../../etc/passwd", "hotweights-proof-XYZ", f"hotweights-proof-{'0' * 32}/../x", "", 7):
        with pytest.raises(ValueError, match="proof file"):
            sees(None, bad)
