"""hotweights' state and patches on objects it does not own: one attribute each, every patch undone by detach."""

from __future__ import annotations

import threading
from typing import Any

from hotweights.core import attach


class Engine:
    def generate(self, x: int) -> int:
        return x


class Client:
    def send(self, x: int) -> int:
        return x * 2


def test_patches_are_recorded_on_their_owner_and_undone_latest_first() -> None:
    engine, client = Engine(), Client()
    client.send = lambda x: x * 3  # type: ignore[method-assign]  # an instance attribute that was there before
    assert attach.patch(engine, engine, "generate", lambda g: lambda x: g(x) + 1)
    assert attach.patch(engine, client, "send", lambda s: lambda x: s(x) + 1)
    assert not attach.patch(engine, client, "missing", lambda s: s)  # nothing to wrap: nothing recorded
    assert attach.patch(engine, engine, "generate", lambda g: lambda x: 0)  # once per target and name
    assert (engine.generate(1), client.send(1)) == (2, 4)
    assert [k for k in vars(engine) if k.startswith("_hotweights")] == [attach.ATTR]  # one attribute, nothing else
    assert not hasattr(client, attach.ATTR)  # the client's patch is the engine's
    assert attach.detach(engine) == 2
    assert engine.generate(1) == 1 and "generate" not in vars(engine)  # the class's own shows through
    assert client.send(1) == 3  # the instance attribute that was there is back
    assert not hasattr(engine, attach.ATTR) and attach.detach(engine) == 0


def test_a_value_is_made_once_also_by_two_threads_at_once() -> None:
    engine, made = Engine(), []
    gate = threading.Barrier(2)

    def make() -> object:
        made.append(1)
        return object()

    got: list[Any] = []

    def ask() -> None:
        gate.wait()
        got.append(attach.value(engine, "gate", make))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got[0] is got[1]
    attach.put(engine, "none", None)
    assert attach.value(engine, "none", object) is None  # a kept None is a value
    assert attach.get(engine, "absent", "default") == "default" and attach.get(3, "x") is None
