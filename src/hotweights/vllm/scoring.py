"""The family probe's score, asked of a running engine: the log-probability of each probe token after the ones
before it (``prompt_logprobs=0``, one greedy step), from an ``LLM`` or an ``AsyncLLM``. While it scores, the
engine's processes rank logprobs eagerly (:func:`hotweights.vllm.patches.rank_logprobs_eagerly`: in this process,
and in the workers through hotweights' worker extension where they carry it), so an engine that never served
logprobs does not compile vLLM's ranking inside the install.

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

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from hotweights.vllm import introspect
from hotweights.vllm.patches import rank_logprobs_eagerly

__all__ = ["MAX_PROBE_TOKENS", "PROBE_REQUEST_PREFIX", "read_scores", "score", "score_async", "score_during_install"]

#: The request ids of the probe's own requests (``hotweights-probe-<n>``).
PROBE_REQUEST_PREFIX = "hotweights-probe-"
_ids = itertools.count()
#: The longest probe an engine scores for a caller in another process (a server's guard, an actor).
MAX_PROBE_TOKENS = 64
#: Seconds the workers may take to take or give back their hold on eager ranking.
EAGER_RANKS_TIMEOUT = 30.0

_log = logging.getLogger("hotweights")


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
    with _ranking_eagerly(llm):
        (out,) = llm.generate([_prompt(token_ids)], _params(), use_tqdm=False)
    return read_scores(token_ids, out)


def _ops_in_workers(engine: Any) -> bool:
    """Whether the engine's workers carry hotweights' worker extension (its ``eager_ranks`` operation)."""
    try:
        return bool(introspect.extension_class_is_ours(introspect.worker_extension(engine)))
    except Exception:  # an engine whose config cannot be read: ranked as vLLM ranks
        return False


def _eager_args(on: bool) -> tuple[str, str]:
    return "eager_ranks", json.dumps({"on": on})


@contextlib.contextmanager
def _ranking_eagerly(llm: Any) -> Iterator[None]:
    """Eager logprob ranking in this process and in ``llm``'s workers while the probe scores (best effort: a worker
    that cannot take the hold ranks as vLLM does, through its compile)."""
    local = rank_logprobs_eagerly(True)
    workers = False
    try:
        workers = _ops_in_workers(llm) and _eager_in_workers(llm, True)
        yield
    finally:
        if workers:
            _eager_in_workers(llm, False)
        if local:
            rank_logprobs_eagerly(False)


def _eager_in_workers(llm: Any, on: bool) -> bool:
    """Take or give back a ``vllm.LLM``'s workers' hold on eager ranking; False where they did not answer."""
    try:
        llm.collective_rpc("hotweights_engine", timeout=EAGER_RANKS_TIMEOUT, args=_eager_args(on))
        return True
    except Exception:
        _log.debug("hotweights: the workers did not %s eager ranking", "take" if on else "give back", exc_info=True)
        return False


async def score_async(generate: Callable[..., AsyncIterator[Any]], token_ids: Sequence[int]) -> list[float | None]:
    """The scores from an ``AsyncLLM``'s ``generate`` (its own, not the one hotweights wraps: the probe's request is
    the one request let through while an install holds the others)."""
    final = None
    async for out in generate(_prompt(token_ids), _params(), request_id=f"{PROBE_REQUEST_PREFIX}{next(_ids)}"):
        final = out
    return read_scores(token_ids, final)


async def score_during_install(
    engine: Any, token_ids: Sequence[int], label: str | None = None, *, repause: bool = True
) -> list[float | None]:
    """The scores from an ``AsyncLLM`` whose install paused it: resumed for the probe's one request (the caller keeps
    every other new request away), then paused again as it was (``keep``: requests in flight stay frozen), so a
    failed probe leaves the install's pause in place; ``repause=False`` where the install resumes the engine right
    after the probe whatever it finds (a second pause would cost a scheduler round trip for nothing). Requests in
    flight (frozen by ``keep`` or ``recompute``) decode on the new weights while it runs: ``label`` (the version being
    installed) is the weight version their tokens carry from then on."""
    paused = bool(await engine.is_paused())
    if label is not None:
        await engine.update_weight_version(label)
    local = rank_logprobs_eagerly(True)
    workers = False
    try:
        workers = _ops_in_workers(engine) and await _eager_async(engine, True)
        if paused:
            await engine.resume_generation()
        try:
            return await score_async(type(engine).generate.__get__(engine), token_ids)
        finally:
            if paused and repause:
                await engine.pause_generation(mode="keep", clear_cache=False)
    finally:
        if workers:
            await _eager_async(engine, False)
        if local:
            rank_logprobs_eagerly(False)


async def _eager_async(engine: Any, on: bool) -> bool:
    """Take or give back the ``AsyncLLM``'s workers' hold on eager ranking; False where they did not answer."""
    try:
        await asyncio.wait_for(engine.collective_rpc("hotweights_engine", args=_eager_args(on)), EAGER_RANKS_TIMEOUT)
        return True
    except Exception:
        _log.debug("hotweights: the workers did not %s eager ranking", "take" if on else "give back", exc_info=True)
        return False
