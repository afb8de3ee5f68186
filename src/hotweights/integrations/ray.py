"""Engines hosted in Ray actors, as verl, OpenRLHF and SkyRL run their rollout workers.

Rollout side: mix :class:`EngineActor` into the actor class and keep the engine in ``self.llm`` (a ``vllm.LLM``
started with ``worker_extension_cls=hotweights.WORKER_EXTENSION``, in-process or multiprocess). Trainer side, in any
process of the cluster (the driver, or the trainer's own actor): :func:`engine` turns the actor handle into an
engine hotweights installs into, alone or in a :class:`hotweights.Fleet`. Each bucket is put into the object store
once; every actor fetches it (zero-copy on its node, moved between nodes by Ray) and hands it to its workers.

Example:
    >>> @ray.remote(max_concurrency=2)                                                   # doctest: +SKIP
    ... class Rollout(hotweights.integrations.ray.EngineActor):
    ...     def __init__(self, path):
    ...         self.llm = vllm.LLM(path, worker_extension_cls=hotweights.WORKER_EXTENSION)
    ...     def generate(self, prompts, params):
    ...         return self.llm.generate(prompts, params)
    >>> actors = [Rollout.remote(path) for _ in range(4)]                                 # doctest: +SKIP
    >>> fleet = hotweights.Fleet([hotweights.integrations.ray.engine(a) for a in actors])  # doctest: +SKIP
    >>> fleet.install(model.state_dict(), weight_version=step)                            # doctest: +SKIP
"""

from __future__ import annotations

import json
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

from hotweights.core.errors import HotWeightsError, HotWeightsTimeoutError
from hotweights.handles import EngineHandle, as_engine
from hotweights.handles.actor import RayEngineHandle

__all__ = ["HOLD_LIMIT_S", "EngineActor", "engine"]

#: Seconds an actor lets one install hold its engine's gate (the writes, the prefix-cache reset, the version): past
#: it, the trainer is presumed gone mid-write and the engine refuses generation until a full install.
HOLD_LIMIT_S = 600.0

#: One handle per actor while anything in this process holds it (a Fleet, an adapter): dropped with its last user,
#: so a process that reaches many short-lived actors does not keep a model-sized delta base for each.
_HANDLES: weakref.WeakValueDictionary[str, RayEngineHandle] = weakref.WeakValueDictionary()
_HANDLES_LOCK = threading.Lock()


def engine(actor: Any) -> RayEngineHandle:
    """The engine handle of an :class:`EngineActor` (one per actor in this process while it is held, so its version
    and delta base are kept across installs)."""
    key = actor._actor_id.hex()
    with _HANDLES_LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            handle = _HANDLES[key] = RayEngineHandle(actor)
        return handle


class EngineActor:
    """Mixin for a Ray actor class hosting an engine in ``self.llm`` (rename with ``hotweights_engine_attr``).

    Its one remote method, :meth:`hotweights_handle`, is what :class:`~hotweights.handles.actor.RayEngineHandle` calls.
    Make the actor threaded (``max_concurrency >= 2``) so an install stages while a rollout generates; generation
    through ``self.llm`` waits while an install writes, as in any process.
    """

    hotweights_engine_attr = "llm"

    def hotweights_handle(self, op: str, *args: Any) -> Any:
        """Run ``op`` (``describe``, ``call``, ``reset_prefix_cache``, ``set_weight_version``, ``get_weight_version``,
        ``is_sleeping``, ``clear_kv_cache``, ``gate_enter``, ``gate_exit``, ``gate_refuse``, ``gate_reopen``,
        ``prompt_logprobs``) on
        this actor's engine handle."""
        side = self.__dict__.get("_hotweights_side")
        if side is None:
            side = self.__dict__["_hotweights_side"] = _ActorSide(getattr(self, self.hotweights_engine_attr))
        method = _OPS.get(op)
        if method is None:
            raise ValueError(f"unknown hotweights actor operation {op!r}; one of {sorted(_OPS)}")
        return method(side, *args)


class _ActorSide:
    """The actor's end: its engine's handle, and the gate an install holds across calls."""

    def __init__(self, llm: Any) -> None:
        self.handle: EngineHandle = as_engine(llm)
        self.handle.gate  # noqa: B018 - from now on the engine's generation goes through its gate
        self._release: threading.Event | None = None
        self._holder: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        """Work an install runs inside its hold of the gate (the family probe), run by the thread that holds it."""
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        import ray

        from hotweights.vllm.introspect import WORKER_EXTENSION

        h = self.handle
        if not h.workers.extension:
            raise HotWeightsError(
                f"this actor's engine ({h.describe()}) was started without hotweights' worker extension; start it "
                f"with worker_extension_cls={WORKER_EXTENSION!r}"
            )
        expected = h.expected_weights()
        context = ray.get_runtime_context()
        config = h.model.config()
        return {
            "hotweights": "hotweights",
            "num_workers": h.facts.num_workers,
            "worker_extension": h.facts.worker_extension,
            "weight_transfer_backend": h.facts.weight_transfer_backend,
            "expected": _expected_json(expected) if expected is not None else "",
            "node": context.get_node_id(),
            "actor": context.get_actor_id() or "",
            "engine": h.describe(),
            "family": list(h.model.family()),
            "config": config.to_json_string(use_diff=False) if config is not None else "",
            "dtype": str(h.model.dtype()).removeprefix("torch."),
        }

    def call(self, method: str, args: list[Any], kwargs: dict[str, Any] | None, timeout: float | None) -> list[Any]:
        with ExitStack() as stack:
            local = [self._resolve(a, stack) for a in args]
            return self.handle.workers.call(method, *local, timeout=timeout, kwargs=kwargs)

    def _resolve(self, arg: Any, stack: ExitStack) -> Any:
        """A ``"ray"`` descriptor becomes one this engine's workers open: the bytes fetched from the object store
        (zero-copy on this node), by reference in-process or in a shared-memory file of this host."""
        from hotweights.transports import MalformedDescriptorError
        from hotweights.transports.object_store import ObjectStoreDescriptor

        try:
            sent = ObjectStoreDescriptor.from_wire(arg)
        except MalformedDescriptorError:
            return arg  # not a bucket in the object store: passed on as it is
        import ray

        data = memoryview(ray.get(sent.ref))  # a read-only numpy array
        if data.nbytes != sent.nbytes:
            raise ValueError(f"ray bucket has {data.nbytes} bytes, its descriptor declares {sent.nbytes}")
        if self.handle.facts.inprocess:
            from hotweights.transports.bytes import BytesDescriptor

            return BytesDescriptor(data=data, nbytes=data.nbytes).to_wire()
        from hotweights.transports.shm import published

        return stack.enter_context(published(data))

    def gate_enter(self, timeout: float | None) -> float:
        """Hold the engine's gate for an install, from a thread of its own (Ray reuses its threads for other calls,
        generation included, which must not pass as the install's own): released by :meth:`gate_exit`, or after
        :data:`HOLD_LIMIT_S` with generation refused."""
        entered, release = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def hold() -> None:
            try:
                with self.handle.gate.installing(timeout) as waited:
                    outcome["waited"] = waited
                    entered.set()
                    if not self._serve_jobs(release, time.monotonic() + HOLD_LIMIT_S):
                        self.handle.gate.refuse(
                            f"generation refused: an install held this engine's gate for more than {HOLD_LIMIT_S:g} s "
                            "(its trainer is presumed gone while writing), so the engine may hold a mix of old and new "
                            "weights. Install a full update first."
                        )
            except BaseException as exc:
                outcome["error"] = exc
                entered.set()

        with self._lock:
            if self._release is not None:
                raise HotWeightsError("another install holds this engine's gate; retry once it finished")
            holder = threading.Thread(target=hold, name="hotweights-gate", daemon=True)
            self._release, self._holder = release, holder  # claimed: a second install is refused, not queued
        holder.start()
        bound = (HOLD_LIMIT_S if timeout is None else timeout) + 5.0  # installing() raises at its timeout first
        if not entered.wait(bound) or "error" in outcome:
            release.set()
            with self._lock:
                self._release, self._holder = None, None
            if "error" in outcome:
                raise outcome["error"]
            raise HotWeightsTimeoutError(f"the engine's gate was not entered within {bound:g} s; nothing was written")
        return float(outcome["waited"])

    def _serve_jobs(self, release: threading.Event, deadline: float) -> bool:
        """Run the install's work inside the hold (the thread that holds the gate passes it) until ``release``;
        False when ``deadline`` passed first."""
        while not release.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                job = self._jobs.get(timeout=left)
            except queue.Empty:
                return False
            if job is not None:
                job()
        return True

    def gate_exit(self) -> bool:
        with self._lock:
            release, holder, self._release, self._holder = self._release, self._holder, None, None
        if release is None or holder is None:
            return False
        release.set()
        self._jobs.put(None)  # wake the holder
        holder.join()
        return True

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None] | None:
        """The family probe's scores, computed by the thread that holds the gate for the running install."""
        if self._release is None:
            raise HotWeightsError("the family probe runs inside an install, and no install holds this engine's gate")
        done: Future[list[float | None] | None] = Future()

        def job() -> None:
            try:
                done.set_result(self.handle.model.prompt_logprobs([int(t) for t in token_ids]))
            except BaseException as exc:
                done.set_exception(exc)

        self._jobs.put(job)
        return done.result(HOLD_LIMIT_S)

    def gate_refuse(self, reason: str) -> None:
        self.handle.gate.refuse(reason)

    def gate_reopen(self) -> None:
        self.handle.gate.reopen()

    def reset_prefix_cache(self) -> bool:
        return self.handle.reset_prefix_cache()

    def set_weight_version(self, version: str) -> str | None:
        return self.handle.set_weight_version(version)

    def get_weight_version(self) -> str | None:
        return self.handle.get_weight_version()

    def is_sleeping(self) -> bool:
        return self.handle.pausing.weights_asleep()

    def clear_kv_cache(self) -> int | None:
        return self.handle.workers.clear_kv_cache()


_OPS = {
    name: getattr(_ActorSide, name)
    for name in (
        "describe",
        "call",
        "reset_prefix_cache",
        "set_weight_version",
        "get_weight_version",
        "is_sleeping",
        "clear_kv_cache",
        "gate_enter",
        "gate_exit",
        "gate_refuse",
        "gate_reopen",
        "prompt_logprobs",
    )
}


def _expected_json(expected: Any) -> str:
    return json.dumps(
        {
            "tensors": {n: s.model_dump(mode="json") for n, s in expected.tensors.items()},
            "ignored": dict(expected.ignored),
            "model_type": expected.model_type,
            "architectures": list(expected.architectures),
        }
    )
