"""The AsyncLLM gate's hold on new requests during an install, and the resubmission of one a paused vLLM (0.33 and
later) rejected as the pause began: pure logic, on a stand-in for ``AsyncLLM.generate``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hotweights import PartialUpdateError
from hotweights.handles.async_llm import RESUBMITS, PauseGate, _refusing


class RetryableRequestError(Exception):
    """Named as vLLM's (vllm.exceptions, 0.33 and later): the wrapper matches the class name."""


class Gate(PauseGate):
    def __init__(self) -> None:
        self.refusal = None
        self._hold = None
        self.installs = self.held = 0


def generate(rejections: list[Exception], on_reject: Any = None) -> Any:
    calls: list[int] = []

    async def method(n: int) -> AsyncIterator[int]:
        calls.append(n)
        if rejections:
            if on_reject is not None:
                on_reject()
            raise rejections.pop(0)
        for i in range(n):
            yield i

    method.calls = calls  # type: ignore[attr-defined]
    return method


async def collect(gen: AsyncIterator[int]) -> list[int]:
    return [x async for x in gen]


def test_a_request_rejected_as_an_install_paused_the_engine_is_resubmitted_after_it() -> None:
    gate = Gate()

    def install_begins() -> None:  # after the hold's check, before vLLM's admission
        hold = gate._hold = asyncio.Event()

        def resume() -> None:
            gate._hold = None
            gate.installs += 1
            hold.set()

        asyncio.get_running_loop().call_later(0.01, resume)

    method = generate([RetryableRequestError("Generation is paused. Please retry after it resumes.")], install_begins)
    assert asyncio.run(collect(_refusing(method, gate)(3))) == [0, 1, 2]
    assert method.calls == [3, 3]  # type: ignore[attr-defined]
    assert gate.held == 2  # resubmitted, and held until the resume


def test_no_install_means_no_resubmission() -> None:
    gate = Gate()
    method = generate([RetryableRequestError("someone else paused the engine")])
    with pytest.raises(RetryableRequestError):
        asyncio.run(collect(_refusing(method, gate)(3)))
    assert method.calls == [3]  # type: ignore[attr-defined]


def test_resubmissions_are_bounded() -> None:
    gate = Gate()

    def another_install() -> None:
        gate.installs += 1

    method = generate([RetryableRequestError("paused")] * (RESUBMITS + 5), another_install)
    with pytest.raises(RetryableRequestError):
        asyncio.run(collect(_refusing(method, gate)(3)))
    assert len(method.calls) == RESUBMITS + 1  # type: ignore[attr-defined]


def test_a_held_request_is_refused_when_the_install_it_waited_for_failed_closed() -> None:
    gate = Gate()
    method = generate([])

    async def scenario() -> list[int]:
        gate._hold = asyncio.Event()
        task = asyncio.ensure_future(collect(_refusing(method, gate)(3)))
        await asyncio.sleep(0)
        gate.refusal = "the install failed while writing"
        gate._hold, hold = None, gate._hold
        hold.set()
        return await task

    with pytest.raises(PartialUpdateError, match="failed while writing"):
        asyncio.run(scenario())
    assert method.calls == []  # type: ignore[attr-defined]
