"""vLLM 0.34's extensible KV cache: the trainer says when a reload may borrow it, the worker tells vLLM for the
commit (:func:`hotweights.vllm.worker.runner.kv_cache_lent`). vLLM's own loan (``kv_cache_lent_for_weight_update``) and
the worker method are held to 0.34's source by the contract check; here, hotweights' side of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hotweights
from hotweights.core.facts import EngineFacts
from hotweights.fake import FakeEngine, FakeWire
from hotweights.vllm.worker.runner import kv_cache_lent


class Worker:
    """A worker as 0.34's ``Worker`` is to this: its runner's ``extensible_kv_cache`` and the reclaimable flag."""

    def __init__(self, cache: bool = True, reclaimable: bool = False) -> None:
        self.model_runner = type("Runner", (), {"extensible_kv_cache": object() if cache else None})()
        self._kv_cache_reclaimable = reclaimable
        self.marks: list[bool] = []

    def set_kv_cache_reclaimable(self, reclaimable: bool) -> None:
        self.marks.append(reclaimable)
        self._kv_cache_reclaimable = reclaimable


def test_a_quiet_engine_lends_its_cache_for_the_commit_and_takes_it_back() -> None:
    worker = Worker()
    with kv_cache_lent(worker, reclaimable=True, lend=False):
        assert worker._kv_cache_reclaimable is True
    assert worker.marks == [True, False]
    with pytest.raises(RuntimeError), kv_cache_lent(worker, reclaimable=True, lend=False):
        raise RuntimeError("the reload failed")
    assert worker.marks == [True, False, True, False] and worker._kv_cache_reclaimable is False


@pytest.mark.parametrize(
    ("worker", "reclaimable"),
    [(Worker(), False), (Worker(cache=False), True), (Worker(reclaimable=True), True)],
    ids=["requests-kept", "no-extensible-cache", "vllm-paused-with-clear-cache"],
)
def test_nothing_is_marked_otherwise(worker: Worker, reclaimable: bool) -> None:
    before = worker._kv_cache_reclaimable
    with kv_cache_lent(worker, reclaimable=reclaimable, lend=False):
        pass
    assert worker.marks == [] and worker._kv_cache_reclaimable is before


class ExtensibleFake(FakeEngine):
    facts = EngineFacts(extensible_kv_cache=True)


@pytest.mark.parametrize(
    ("engine", "pause", "sent"),
    [
        (ExtensibleFake, "wait", True),
        (ExtensibleFake, "abort", True),
        (ExtensibleFake, "keep", False),
        (FakeEngine, "wait", False),
    ],
)
def test_the_trainer_says_so_only_for_such_an_engine_with_nothing_running(
    engine: type[FakeEngine], pause: Any, sent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    begin = FakeWire.begin

    def recording(self: FakeWire, options: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(options.kv_reclaimable)
        begin(self, options, *args, **kwargs)

    monkeypatch.setattr(FakeWire, "begin", recording)
    fake = engine({"w": torch.zeros(3)})
    hotweights.install(fake, {"w": torch.ones(3)}, weight_version=1, pause=pause)
    assert seen == [sent]
