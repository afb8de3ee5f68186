"""Who holds an engine's pause (pure logic), and the core client's sends serialised across threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from hotweights.handles.pause import PauseOwner
from hotweights.vllm import introspect, patches


def test_this_process_holds_its_pause_and_a_dead_one_does_not() -> None:
    mine = PauseOwner.mine(lease=60)
    assert not mine.gone() and not mine.lifted_by_next_install()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert replace(mine, pid=int(dead.stdout)).gone()
    assert replace(mine, started="1").gone()  # the pid was reused by a later process
    assert replace(mine, failed=True).lifted_by_next_install()  # a failed install's pause: the next one lifts it


def test_another_hosts_pause_lasts_its_lease() -> None:
    far = replace(PauseOwner.mine(lease=60), host="elsewhere", pid=1)
    assert not far.gone()
    assert replace(far, until=time.time() - 1).gone()


def test_the_record_survives_the_wire_and_garbage_is_no_record() -> None:
    mine = PauseOwner.mine()
    assert PauseOwner.from_json(mine.to_json()) == mine
    for text in ("", "not json", "[]", '{"host": "h"}', '{"host":"h","boot":"","pid":"x","started":"","until":0}'):
        assert PauseOwner.from_json(text) is None


class _Client:
    """A core client whose send notices two threads inside it at once (a zmq socket aborts the process then)."""

    def __init__(self) -> None:
        self.inside = 0
        self.overlaps = 0
        self.sent = 0

    def _send_input(self, kind: str, request: Any) -> None:
        self.inside += 1
        if self.inside > 1:
            self.overlaps += 1
        time.sleep(0.001)
        self.sent += 1
        self.inside -= 1


def _llm(client: _Client) -> Any:
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))  # what compat reads of a vllm.LLM


def _hammer(client: _Client) -> None:
    threads = [threading.Thread(target=lambda: [client._send_input("ADD", i) for i in range(50)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_multiprocess_llms_sends_are_serialised() -> None:
    unguarded = _Client()
    _hammer(unguarded)
    assert unguarded.overlaps > 0  # the hazard is real without the lock
    client = _Client()
    llm = _llm(client)
    assert introspect.engine_kind(llm) == "llm"
    patches.attach_llm(llm, client)
    patches.attach_llm(llm, client)  # once, idempotent
    _hammer(client)
    assert client.overlaps == 0 and client.sent == 200
    assert os.getpid()  # nothing else to clean up
