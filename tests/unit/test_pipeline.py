"""core.pipeline: sends overlap, stages go one at a time in order, memory is bounded, the first failure stops it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from hotweights.core.pipeline import PipelineStopped, send_pipelined


class Recorder:
    """A fake transport: ``send`` "packs" (sleeps, counting packed items alive), then stages, then frees."""

    def __init__(self, pack_s: Callable[[int], float] = lambda i: 0.0, fail_pack: int | None = None) -> None:
        self.lock = threading.Lock()
        self.alive = 0
        self.most_alive = 0
        self.events: list[tuple[str, int]] = []
        self.cleaned: list[int] = []
        self.pack_s = pack_s
        self.fail_pack = fail_pack

    def send(self, item: int, stage: Callable[[str], None]) -> None:
        with self.lock:
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
            self.events.append(("pack", item))
        try:
            time.sleep(self.pack_s(item))
            if item == self.fail_pack:
                raise OSError(f"pack {item} failed")
            stage(f"d{item}")
        except BaseException:
            self.cleaned.append(item)
            raise
        finally:
            with self.lock:
                self.alive -= 1


def test_stages_run_in_order_even_when_later_items_pack_first() -> None:
    rec = Recorder(pack_s=lambda i: 0.05 if i == 0 else 0.0)
    staged: list[tuple[int, str]] = []
    send_pipelined(list(range(6)), rec.send, lambda i, d: staged.append((i, d)), depth=3)
    assert staged == [(i, f"d{i}") for i in range(6)]


def test_the_next_item_is_packed_while_one_is_staged_and_at_most_depth_are_alive() -> None:
    rec = Recorder()
    overlapped: list[int] = []

    def stage(item: int, descriptor: str) -> None:
        time.sleep(0.02)  # the workers stage: the next send packs meanwhile
        with rec.lock:
            if ("pack", item + 1) in rec.events:
                overlapped.append(item)

    send_pipelined(list(range(8)), rec.send, stage, depth=2)
    assert overlapped, "no item was packed while the previous one was staged"
    assert rec.most_alive == 2


def test_depth_one_sends_one_after_the_other_on_this_thread() -> None:
    rec = Recorder()
    threads: set[str] = set()
    send_pipelined(list(range(4)), rec.send, lambda i, d: threads.add(threading.current_thread().name), depth=1)
    assert rec.most_alive == 1
    assert threads == {threading.current_thread().name}


def test_a_failed_stage_stops_every_later_stage_and_raises_its_error() -> None:
    rec = Recorder(pack_s=lambda i: 0.01)
    staged: list[int] = []

    def stage(item: int, descriptor: str) -> None:
        if item == 2:
            raise ValueError("worker refused bucket 2")
        staged.append(item)

    with pytest.raises(ValueError, match="worker refused bucket 2"):
        send_pipelined(list(range(10)), rec.send, stage, depth=3)
    assert staged == [0, 1]
    assert 2 in rec.cleaned  # the failed send cleaned up what it made
    assert rec.alive == 0  # every send returned before the error was raised
    assert len(rec.events) < 10  # sends not started when it failed were skipped


def test_a_failed_pack_stops_the_pipeline_and_later_sends_clean_up() -> None:
    rec = Recorder(fail_pack=1)
    staged: list[int] = []
    later_packing = threading.Event()

    def send(item: int, stage: Callable[[str], None]) -> None:
        if item > 1:
            later_packing.set()
        elif item == 1:
            assert later_packing.wait(10)  # pack 1 fails while a later send is under way (however loaded the machine)
        rec.send(item, stage)

    with pytest.raises(OSError, match="pack 1 failed"):
        send_pipelined(list(range(6)), send, lambda i, d: staged.append(i), depth=3)
    assert staged == [0]
    # the sends packed meanwhile were stopped at their turn, and their transport cleaned up
    assert set(rec.cleaned) - {1} and all(i > 1 for i in set(rec.cleaned) - {1})
    assert rec.alive == 0


def test_a_send_that_never_stages_fails_instead_of_hanging() -> None:
    staged: list[int] = []

    def send(item: int, stage: Callable[[str], None]) -> None:
        if item != 1:
            stage("d")

    with pytest.raises(RuntimeError, match="returned without staging item 1"):
        send_pipelined(list(range(4)), send, lambda i, d: staged.append(i), depth=2)
    assert staged == [0]


def test_a_waiting_send_gets_pipeline_stopped_from_its_stage() -> None:
    seen: list[BaseException] = []
    first_staging = threading.Event()

    def send(item: int, stage: Callable[[str], None]) -> None:
        try:
            stage("d")
        except BaseException as exc:
            seen.append(exc)
            raise

    def stage(item: int, descriptor: str) -> None:
        if item == 0:
            first_staging.set()
            time.sleep(0.05)  # item 1 waits for its turn meanwhile
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        send_pipelined([0, 1], send, stage, depth=2)
    assert first_staging.is_set()
    assert any(isinstance(e, PipelineStopped) for e in seen)


def test_progress_is_advanced_once_per_item() -> None:
    asked: list[int] = []

    def progress() -> object:
        for i in range(5):
            asked.append(i)
            yield i
        asked.append(-1)

    send_pipelined(list(range(5)), lambda i, stage: stage("d"), lambda i, d: None, depth=2, done=progress())
    assert asked == [0, 1, 2, 3, 4, -1]
