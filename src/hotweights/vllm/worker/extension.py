"""The engine side of every multiprocess transport, as a vLLM worker extension: six methods.

Start the engine with ``LLM(..., worker_extension_cls=hotweights.WORKER_EXTENSION)``; the methods below are then
reachable by name through ``collective_rpc`` (strings, ints, bytes and JSON only: no pickle anywhere). An error
any of them raises leaves with its envelope (:mod:`hotweights.core.envelope`): the trainer gets it back typed.

Five of them are the install session (:mod:`hotweights.vllm.worker.session`): ``begin`` -> ``stage`` per bucket ->
``prepare`` -> ``commit``, or ``abort``. The sixth, ``hotweights_engine``, reads and sets the worker's state that
outlives a session: its status, the pause record, the KV cache, the collective group, kept shm segments, the
delta copy, and eager logprob ranking while the family probe runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from hotweights.core import attach
from hotweights.core.envelope import enveloped
from hotweights.vllm.worker.session import PROTOCOL, WorkerSession, session_of

__all__ = ["HotWeightsWorkerExtension"]

#: Longest ``hotweights_engine`` argument (JSON) a worker reads.
MAX_ARGS = 1 << 16


class HotWeightsWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; every method is prefixed ``hotweights_``."""

    @property
    def _hotweights_session(self) -> WorkerSession:
        return session_of(self)

    @enveloped
    def hotweights_begin(
        self, options_json: str, bucket_json: str = "", descriptor: dict[str, Any] | None = None
    ) -> Any:
        """Open an install session (:class:`~hotweights.vllm.worker.session.SessionOptions`, JSON); one left open by a
        crashed trainer is dropped first. With a bucket, the whole update is that bucket: it is staged and
        committed in this one call (one worker: one RPC instead of three), and the commit's summary comes back, or
        ``{"refused": <envelope>}`` when it was refused before anything was written."""
        if not bucket_json:
            return self._hotweights_session.begin(options_json)
        if descriptor is None:
            raise ValueError("a bucket needs its descriptor")
        return self._hotweights_session.install(
            options_json, lambda update_id: self._hotweights_session.stage(update_id, bucket_json, descriptor)
        )

    @enveloped
    def hotweights_stage(self, update_id: str, bucket_json: str, descriptor: dict[str, Any]) -> int:
        """Receive one bucket through its transport and check it aside; returns the bytes staged."""
        return self._hotweights_session.stage(update_id, bucket_json, descriptor)

    @enveloped
    def hotweights_prepare(self, update_id: str) -> list[dict[str, str]]:
        """Ready the session to commit without writing (every bucket arrived; a delta rebuilt aside); the problems
        a delta has (none: ready)."""
        return self._hotweights_session.prepare(update_id)

    @enveloped
    def hotweights_commit(self, update_id: str) -> dict[str, int | str | float]:
        """Install what the session staged, and say how (``install_method``, ``install_reason``), what was checked
        after transit (``digests_verified``) and what was read back."""
        return self._hotweights_session.commit(update_id)

    @enveloped
    def hotweights_abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given); the model was never touched."""
        return self._hotweights_session.abort(update_id)

    @enveloped
    def hotweights_engine(self, op: str, args_json: str = "{}") -> Any:
        """The worker's state outside a session: ``op`` is one of :data:`ENGINE_OPS`, ``args_json`` its arguments
        as a JSON object."""
        run = ENGINE_OPS.get(op)
        if run is None:
            raise ValueError(f"unknown engine operation {op!r}; use one of {sorted(ENGINE_OPS)}")
        if not isinstance(args_json, str) or len(args_json) > MAX_ARGS:
            raise ValueError(f"the arguments of {op!r} are a JSON object of at most {MAX_ARGS} characters")
        try:
            args = json.loads(args_json or "{}")
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise ValueError(f"the arguments of {op!r} are not JSON") from None
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of {op!r} are a JSON object, not {type(args).__name__}")
        return run(self, **args)


def _status(worker: Any) -> dict[str, Any]:
    """The extension is loaded and speaks :data:`~hotweights.vllm.worker.session.PROTOCOL`; whether vLLM's sleep mode
    holds this worker's weights (a paused scheduler alone does not); who recorded the engine's pause; the bytes of
    this worker's own delta copy, and the trainer's shared copy it maps (``""``: none); the install session open
    (``""``: none), the last updates dropped by their staging expiry, and the model's architecture, the vLLM
    version and device kind (what :mod:`hotweights.core.families` proves families on), and the mends of vLLM's
    reload in place in this worker (:data:`~hotweights.vllm.fixes.VLLM_FIXES`), and vLLM's NCCL engine it joined
    through (:func:`hotweights.vllm.nccl.joined`)."""
    from hotweights.vllm.compat import device_kind, vllm_version
    from hotweights.vllm.fixes import apply_vllm_fixes
    from hotweights.vllm.nccl import joined
    from hotweights.vllm.worker.runner import weights_asleep_here

    session = session_of(worker)
    config = getattr(getattr(worker, "model_config", None), "hf_config", None)
    base = session.base
    own = base.copy is not None and (base.mapped is None or base.copy.tensors is not base.mapped.tensors)
    return {
        "hotweights": "hotweights",
        "protocol": PROTOCOL,
        "weights_asleep": weights_asleep_here(),
        "pause_owner": str(attach.get(worker, "pause_owner", "")),
        "delta_copy_bytes": base.copy.nbytes if own and base.copy is not None else 0,
        "delta_shared_base": str(base.mapped.path) if base.mapped is not None else "",
        "session": session.update_id or "",
        "expired": list(session.expiry.expired),
        "architecture": str((getattr(config, "architectures", None) or [""])[0]),
        "vllm": vllm_version(),
        "device": device_kind(),
        "fixes": list(apply_vllm_fixes()),
        "vllm_nccl": joined(worker),
    }


def _pause(worker: Any, action: str, owner: str = "") -> str:
    """Record (``"claim"``) or clear (``"release"``) the hotweights install that paused this engine, as
    :class:`~hotweights.handles.pause.PauseOwner` JSON; returns the record it replaced."""
    if action not in ("claim", "release"):
        raise ValueError(f"unknown pause action {action!r}; use 'claim' or 'release'")
    if not isinstance(owner, str) or len(owner) > 1024:
        raise ValueError("a pause owner record is a string of at most 1024 characters")
    was = str(attach.get(worker, "pause_owner", ""))
    attach.put(worker, "pause_owner", owner if action == "claim" else "")
    return was


def _clear_kv_cache(worker: Any) -> int:
    """Zero the KV cache (after a failure that may have touched live weights); returns tensors zeroed."""
    from hotweights.vllm.worker.ops import clear_kv_cache

    return clear_kv_cache(worker)


def _join_group(
    worker: Any,
    host: str,
    port: int,
    world_size: int,
    backend: str = "gloo",
    timeout: float = 60.0,
    vllm_nccl: dict[str, Any] | None = None,
) -> int:
    """Join the trainer's collective group (closing a stale one first); returns this worker's group rank. With
    ``vllm_nccl`` (its buffer geometry), through vLLM's own NCCL engine (:mod:`hotweights.vllm.nccl`)."""
    if vllm_nccl is not None:
        from hotweights.vllm.nccl import join

        return join(worker, host, port, world_size, backend, timeout, vllm_nccl)
    from hotweights.transports.collective import init_worker_group

    init_worker_group(worker, host, port, world_size, backend, timeout)
    return 1 + int(getattr(worker, "rank", 0))


def _leave_group(worker: Any) -> bool:
    """Drop the collective group (and vLLM's NCCL engine), if any."""
    from hotweights.transports.collective import close_group
    from hotweights.vllm.nccl import leave

    return leave(worker) | close_group(worker)


def _release_segments(worker: Any, ids: list[str] | None = None) -> int:
    """Unmap kept shm segments (``ids``, or all), and those of trainers that are gone; returns how many."""
    from hotweights.transports.shm_files import release_segments

    return release_segments(worker, ids)


def _forget_base(worker: Any) -> bool:
    """Stop keeping a copy for deltas and free it; True when there was one."""
    return session_of(worker).base.stop()


#: The name of a file a trainer makes in its host's shared memory to learn whether an engine's workers see it.
PROOF_NAME = re.compile(r"hotweights-proof-[0-9a-f]{32}")


def _sees_shm(worker: Any, name: str) -> str:
    """The content (at most 64 characters) of the trainer's proof file ``name`` (:data:`PROOF_NAME`, nothing else)
    in this host's shared memory; ``""`` where this worker does not see it (another host, another container)."""
    from hotweights.transports.shm_files import SHM_DIR

    if not isinstance(name, str) or not PROOF_NAME.fullmatch(name):
        raise ValueError("sees_shm reads only a trainer's proof file, hotweights-proof-<32 hex digits>")
    try:
        with open(SHM_DIR / name, encoding="ascii", errors="replace") as f:
            return f.read(64)
    except OSError:
        return ""


def _eager_ranks(worker: Any, on: bool) -> bool:
    """Take (``on``) or give back a hold on eager logprob ranking in this worker, around the family probe
    (:func:`hotweights.vllm.patches.rank_logprobs_eagerly`); False where this worker has no V1 sampler."""
    from hotweights.vllm.patches import rank_logprobs_eagerly

    if not isinstance(on, bool):
        raise ValueError('eager_ranks takes {"on": true} or {"on": false}')
    return rank_logprobs_eagerly(on)


#: What ``hotweights_engine`` does, by operation name.
ENGINE_OPS: dict[str, Callable[..., Any]] = {
    "status": _status,
    "pause": _pause,
    "clear_kv_cache": _clear_kv_cache,
    "join_group": _join_group,
    "leave_group": _leave_group,
    "release_segments": _release_segments,
    "forget_base": _forget_base,
    "sees_shm": _sees_shm,
    "eager_ranks": _eager_ranks,
}
