"""hotweights.integrations.verl without verl: what its wire admits, and what it says where verl is missing.

The real sync (verl's sender into a real engine) is tests/integrations/test_verl.py, run by ``make test-verl``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from hotweights.core.errors import InstallError
from hotweights.integrations import verl


def test_verls_messages_are_read() -> None:
    message = {
        "bucket_meta": {"w": {"name": "w", "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "offset": 64}},
        "is_last": True,
    }
    assert verl._loads(pickle.dumps(message)) == message
    assert verl._entries(message) == ([("w", torch.Size([2, 3]), torch.bfloat16, 64)], [])


def test_a_message_naming_anything_else_is_refused() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(InstallError, match=r"posix\.system|os\.system"):
        verl._loads(pickle.dumps({"bucket_meta": {}, "is_last": Evil()}))


def test_a_bucket_without_torch_types_is_refused() -> None:
    with pytest.raises(InstallError, match=r"torch\.Size shape"):
        verl._entries({"bucket_meta": {"w": {"shape": [2, 3], "dtype": torch.float32, "offset": 0}}})


def test_the_verl_transport_opens_only_this_workers_buckets() -> None:
    buffer = torch.zeros(8, dtype=torch.uint8)
    assert verl.Receiver.open(verl.Receiver.parse({"transport": "verl", "nbytes": 8, "buffer": buffer}))[0] is buffer
    with pytest.raises(ValueError, match="cannot come from elsewhere"):
        verl.Receiver.parse({"transport": "verl", "nbytes": 8, "buffer": [0] * 8})


def test_shm_names_other_than_verls_are_refused() -> None:
    with pytest.raises(InstallError, match="verl_weights_"):
        verl._Buffer({"name": "../etc/passwd", "size": 8}, use_shm=True, device=None)


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(verl.TIMEOUT_ENV, "2.5")
    assert verl._timeout() == 2.5
    monkeypatch.setenv(verl.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=verl.TIMEOUT_ENV):
        verl._timeout()


def test_importing_it_imports_neither_verl_nor_zmq() -> None:
    code = "import sys, hotweights.integrations.verl; assert not {'verl', 'zmq'} & set(sys.modules), 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_verl_the_extension_says_what_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(ImportError, match=r"install verl"):
        verl.VerlWorkerExtension  # noqa: B018
