"""A paused engine is not a sleeping one: who paused it, and whether an install may go on under that pause.

vLLM's ``is_sleeping()`` is True while the scheduler is merely paused (``/pause``, ``pause_generation``,
``sleep(level=0)``). Writing weights is only unsafe while they are *asleep* (offloaded or discarded). So an install:

- refuses an engine whose weights are asleep (the workers say so, or the handle saw ``sleep(level>=1)``);
- into an engine that someone else paused, goes on under that pause and leaves it paused;
- into an engine that a hotweights install paused and whose trainer is gone (killed while it held the pause), goes
  on and resumes it afterwards; a live install's pause is waited for.

Each install that pauses an engine records a :class:`PauseOwner` on its workers (through the worker extension's
``hotweights_engine("pause")``; ``hotweights_engine("status")`` reads it back) and
clears it when it resumes; a trainer that dies in between leaves the record, which the next one reads.

**What a pause does to the KV cache of requests in flight** (``pause="keep"`` and ``"recompute"``).

``keep``: the requests in flight keep their KV blocks, computed by the old weights, and their tokens after the install
are decoded by the new weights attending to them. The prefix cache must then never hand such a block to a request
admitted after the install. vLLM hashes a request's ``cache_salt`` into its first block, and each block's hash chains
on the one before (``vllm/v1/core/kv_cache_utils.py``), so requests with different salts never share a block. Each
engine has a *KV epoch* (:class:`KvEpoch`): a ``keep`` install bumps it once the engine is paused (frozen: nothing
admitted from then on runs before the switch), and every request admitted from then on carries
``hotweights-kv-epoch-N`` in its salt (after the user's own salt, when it has one).
Blocks of older epochs, and the ones that kept requests go on filling, are matched only by requests of their own
epoch and age out of the cache by LRU. Nothing is preempted. A request of epoch 0 (no ``keep`` install yet) is sent
as it is. Not covered: a request admitted before the pause that vLLM had not scheduled yet (it queued behind
``max_num_seqs``) keeps the old epoch, so it may reuse prompt blocks the old weights computed, as the requests in
flight do.

``recompute``: the install preempts the requests in flight after the write (vLLM's
``reset_prefix_cache(reset_running_requests=True)``), so vLLM prefills prompt and generated tokens again on the new
weights. Generation is let back in, and the install returns, only once every preempted request produced its next
token on the new weights (:func:`recomputed`), so the re-prefill counts in ``report.stall_s``.

Used by :class:`~hotweights.handles.async_llm.AsyncLLMHandle` (an ``AsyncLLM`` in this process) and by the server's
guard (:mod:`hotweights.serve_guard`, which wraps its ``AsyncLLM`` the same way). Imports no vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["SALT_PREFIX", "KvEpoch", "PauseOwner", "combined_salt", "decoding", "recomputed", "salted"]

#: How long a recorded pause is presumed alive when its owner runs on another host (its liveness cannot be seen).
DEFAULT_LEASE_S = 900.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, as /proc gives it), or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] == b"Z" else fields[19].decode()


@dataclass(frozen=True)
class PauseOwner:
    """The trainer process whose install paused an engine, and until when its pause is presumed alive."""

    host: str
    boot: str
    pid: int
    started: str
    until: float
    failed: bool = False
    """Left paused on purpose by an install that failed while writing (fail closed): the next install lifts it."""

    @classmethod
    def mine(cls, lease: float | None = None) -> PauseOwner:
        """This process, holding a pause for at most ``lease`` seconds (None: :data:`DEFAULT_LEASE_S`)."""
        pid = os.getpid()
        until = time.time() + (DEFAULT_LEASE_S if lease is None else lease)
        return cls(socket.gethostname(), _boot_id(), pid, _started(pid) or "", until)

    def lifted_by_next_install(self) -> bool:
        """Whether the next install may take this pause over and resume the engine after it: the install that
        paused it failed (fail closed), or its trainer is gone."""
        return self.failed or self.gone()

    def gone(self) -> bool:
        """True when the owner can no longer hold the pause: on this host (same boot), its process is gone or its
        pid was reused; elsewhere, its lease ran out."""
        if self.host == socket.gethostname() and self.boot and self.boot == _boot_id():
            return _started(self.pid) != self.started
        return time.time() > self.until

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PauseOwner | None:
        """The owner ``text`` records; None for an empty or unreadable record."""
        try:
            data = json.loads(text) if text else None
            if not isinstance(data, dict):
                return None
            host, boot, pid, started = str(data["host"]), str(data["boot"]), int(data["pid"]), str(data["started"])
            return cls(host, boot, pid, started, float(data["until"]), failed=bool(data.get("failed", False)))
        except (ValueError, KeyError, TypeError):
            return None


_log = logging.getLogger("hotweights")

#: The part of a request's ``cache_salt`` that names its KV epoch.
SALT_PREFIX = "hotweights-kv-epoch-"
#: Seconds between two looks at the requests a recompute waits for.
POLL_S = 0.005


def combined_salt(own: str | None, epoch: int) -> str | None:
    """``own`` (the request's salt) with ``epoch`` folded in; ``own`` as it is in epoch 0.

    Example:
        >>> combined_salt(None, 2), combined_salt("user-7", 2), combined_salt("user-7", 0)
        ('hotweights-kv-epoch-2', 'user-7|hotweights-kv-epoch-2', 'user-7')
    """
    if epoch <= 0:
        return own
    mine = f"{SALT_PREFIX}{epoch}"
    return f"{own}|{mine}" if own else mine


def salted(prompt: Any, epoch: int) -> Any:
    """``prompt`` (what ``AsyncLLM.generate`` takes) carrying ``epoch`` in its ``cache_salt``: a prompt dict (token
    ids, text, or an already rendered input) as a new dict, a text string as a text prompt, an ``EngineCoreRequest``
    changed in place. A stream of inputs, or an encoder-decoder prompt, is returned as it is.

    Example:
        >>> salted({"prompt_token_ids": [1, 2], "cache_salt": "mine"}, 3)
        {'prompt_token_ids': [1, 2], 'cache_salt': 'mine|hotweights-kv-epoch-3'}
        >>> salted("Hello", 1)
        {'prompt': 'Hello', 'cache_salt': 'hotweights-kv-epoch-1'}
    """
    if epoch <= 0:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": combined_salt(None, epoch)}
    if isinstance(prompt, Mapping):
        if "encoder_prompt" in prompt or prompt.get("type") == "enc_dec":
            return prompt  # vLLM reads an encoder-decoder prompt's salt elsewhere; RL policies are decoder-only
        return {**prompt, "cache_salt": combined_salt(prompt.get("cache_salt"), epoch)}
    if hasattr(prompt, "cache_salt") and hasattr(prompt, "request_id"):  # an EngineCoreRequest (deprecated by vLLM)
        prompt.cache_salt = combined_salt(prompt.cache_salt, epoch)
    return prompt


class KvEpoch:
    """One engine's KV epoch (see the module docstring): 0 until the first ``keep`` install."""

    def __init__(self) -> None:
        self.epoch = 0

    def bump(self) -> int:
        """Start a new epoch: requests admitted from now on never match a block cached before."""
        self.epoch += 1
        _log.debug("hotweights: KV epoch %d (pause='keep')", self.epoch)
        return self.epoch

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of a ``generate``/``encode`` call with the prompt (first argument, or ``prompt=``)
        salted with the current epoch."""
        epoch = self.epoch
        if epoch <= 0:
            return args, kwargs
        if args:
            return (salted(args[0], epoch), *args[1:]), kwargs
        if "prompt" in kwargs:
            return args, {**kwargs, "prompt": salted(kwargs["prompt"], epoch)}
        return args, kwargs

    def wrap(self, method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        """``method`` (``AsyncLLM.generate`` or ``encode``) with each call's prompt salted (for a server's
        ``AsyncLLM``; an in-process one's handle salts inside its own wrapper)."""

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            args, kwargs = self.call(args, kwargs)
            async for item in method(*args, **kwargs):
                yield item

        return call


def decoding(states: Mapping[str, tuple[int, str | None]]) -> frozenset[str]:
    """The requests that produced tokens already (their KV holds decoded tokens: a preemption recomputes them), out
    of ``states`` (:func:`hotweights.vllm.introspect.requests_in_flight`)."""
    return frozenset(rid for rid, (tokens, _) in states.items() if tokens > 0)


async def recomputed(
    read: Callable[[], Mapping[str, tuple[int, str | None]]],
    preempted: Collection[str],
    label: str,
    timeout: float,
) -> float | None:
    """Wait until each request of ``preempted`` produced a token labelled ``label`` (the new weights: prompt and
    earlier tokens were prefilled again) or ended; ``read()`` gives the requests in flight
    (:func:`hotweights.vllm.introspect.requests_in_flight`). Returns the seconds waited, or None after ``timeout``
    seconds (logged: the install goes on)."""
    start = time.perf_counter()
    waiting = set(preempted)
    while waiting:
        states = read()
        waiting = {rid for rid in waiting if rid in states and states[rid][1] != label}
        if not waiting:
            break
        if time.perf_counter() - start > timeout:
            _log.warning(
                "hotweights: %d request(s) preempted by a pause='recompute' install produced no token on the new "
                "weights within %g s; generation is let back in without them",
                len(waiting),
                timeout,
            )
            return None
        await asyncio.sleep(POLL_S)
    return time.perf_counter() - start
