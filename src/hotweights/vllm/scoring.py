"""The family probe's score, asked of a running engine: the log-probability of each probe token after the ones
before it (``prompt_logprobs=0``, one greedy step), from an ``LLM`` or an ``AsyncLLM``.

Example:
    >>> class Logprob:
    ...     def __init__(self, value):
    ...         self.logprob = value
    >>> class Out:
    ...     prompt_logprobs = [None, {5: Logprob(-1.5)}, {7: Logprob(-0.25)}]
    >>> read_scores((3, 5, 7), Out())
    [-1.5, -0.25]
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

__all__ = ["MAX_PROBE_TOKENS", "PROBE_REQUEST_PREFIX", "read_scores", "score", "score_async", "score_during_install"]

#: The request ids of the probe's own requests (``hotweights-probe-<n>``).
PROBE_REQUEST_PREFIX = "hotweights-probe-"
_ids = itertools.count()
#: The longest probe an engine scores for a caller in another process (a server's guard, an actor).
MAX_PROBE_TOKENS = 64


def _params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)


def read_scores(token_ids: Sequence[int], output: Any) -> list[float | None]:
    """The score of each of ``token_ids[1:]`` in a ``RequestOutput``; None where the engine gave none."""
    rows = list(getattr(output, "prompt_logprobs", None) or [])[1:]
    got: list[float | None] = []
    for token, row in zip(token_ids[1:], rows, strict=False):
        entry = (row or {}).get(int(token))
        got.append(None if entry is None else float(entry.logprob))
    return got


def _prompt(token_ids: Sequence[int]) -> dict[str, Any]:
    """The probe's prompt, salted apart: no cached block (of the old weights, or of an earlier probe) is reused."""
    return {"prompt_token_ids": list(token_ids), "cache_salt": f"{PROBE_REQUEST_PREFIX}{uuid.uuid4().hex}"}


def score(llm: Any, token_ids: Sequence[int]) -> list[float | None]:
    """A ``vllm.LLM``'s scores of ``token_ids`` (called by the thread that holds its gate)."""
    (out,) = llm.generate([_prompt(token_ids)], _params(), use_tqdm=False)
    return read_scores(token_ids, out)


async def score_async(generate: Callable[..., AsyncIterator[Any]], token_ids: Sequence[int]) -> list[float | None]:
    """The scores from an ``AsyncLLM``'s ``generate`` (its own, not the one hotweights wraps: the probe's request is
    the one request let through while an install holds the others)."""
    final = None
    async for out in generate(_prompt(token_ids), _params(), request_id=f"{PROBE_REQUEST_PREFIX}{next(_ids)}"):
        final = out
    return read_scores(token_ids, final)


async def score_during_install(engine: Any, token_ids: Sequence[int], label: str | None = None) -> list[float | None]:
    """The scores from an ``AsyncLLM`` whose install paused it: resumed for the probe's one request (the caller keeps
    every other new request away), then paused again as it was (``keep``: requests in flight stay frozen), so a
    failed probe leaves the install's pause in place. Requests in flight (frozen by ``keep`` or ``recompute``) decode
    on the new weights while it runs: ``label`` (the version being installed) is the weight version their tokens
    carry from then on."""
    paused = bool(await engine.is_paused())
    if label is not None:
        await engine.update_weight_version(label)
    if paused:
        await engine.resume_generation()
    try:
        return await score_async(type(engine).generate.__get__(engine), token_ids)
    finally:
        if paused:
            await engine.pause_generation(mode="keep", clear_cache=False)
