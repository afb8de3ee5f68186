"""The handle of an engine hosted in a Ray actor (trainer side): every call goes to the actor's
``hotweights_handle`` method (:class:`hotweights.integrations.ray.EngineActor`), which runs it on the engine's own
handle there; buckets travel through Ray's object store (:mod:`hotweights.transports.object_store`).

The actor's engine must be started with hotweights' worker extension (any engine kind that accepts it). Calls carry
strings, JSON and ``ObjectRef`` s: Ray's serializer moves them, and nothing of hotweights is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from hotweights.core.errors import HotWeightsTimeoutError
from hotweights.core.facts import EngineFacts
from hotweights.core.manifest import ExpectedWeights, TensorSpec
from hotweights.handles.handle import EngineHandle, PauseMode
from hotweights.handles.parts import Pausing, ServedModel
from hotweights.handles.workers import Workers

__all__ = ["RayEngineHandle"]

#: Seconds for the actor's small calls (status, prefix cache, version, the gate).
SHORT_TIMEOUT = 60.0
#: Seconds for the family probe (one short request, run by the actor inside the install's hold of the gate).
PROBE_TIMEOUT = 120.0


class RayEngineHandle(EngineHandle):
    """An engine in a Ray actor, reached from any process of the cluster (the driver, or a trainer actor).

    Args:
        actor: the ``ActorHandle`` of an :class:`~hotweights.integrations.ray.EngineActor`.
        timeout: seconds for the actor's small calls.
    """

    kind: ClassVar[str] = "ray"
    pause_modes: ClassVar[tuple[PauseMode, ...]] = ("wait",)

    def __init__(self, actor: Any, *, timeout: float = SHORT_TIMEOUT) -> None:
        self.actor = actor
        self.timeout = timeout
        info = self.run("describe", timeout=timeout)
        if not isinstance(info, dict) or info.get("hotweights") != "hotweights":
            raise TypeError(f"{actor!r} is not a hotweights EngineActor (its describe answered {info!r})")
        self.info: dict[str, Any] = info
        self._gate = RayGate(self)
        extension = str(info["worker_extension"])
        backend = str(info.get("weight_transfer_backend", ""))
        self.facts = EngineFacts(
            num_workers=int(info["num_workers"]), worker_extension=extension, weight_transfer_backend=backend
        )
        self.workers = RayWorkers(self)
        self.pausing = RayPausing(self)
        self.model = RayModel(self)

    def run(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """The actor's answer to ``op`` (its ``hotweights_handle``), within ``timeout`` seconds."""
        import ray
        from ray.exceptions import GetTimeoutError

        ref = self.actor.hotweights_handle.remote(op, *args)
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError as exc:
            ray.cancel(ref)
            raise HotWeightsTimeoutError(
                f"the engine actor did not finish {op!r} within {timeout} s; check the actor is alive (a threaded "
                "actor, max_concurrency >= 2, serves installs while it generates)"
            ) from exc

    def expected_weights(self) -> ExpectedWeights | None:
        text = self.info.get("expected")
        if not text:
            return None
        data = json.loads(text)
        tensors = {n: TensorSpec.model_validate(s) for n, s in data["tensors"].items()}
        return ExpectedWeights(
            tensors=tensors,
            ignored=dict(data.get("ignored", {})),
            model_type=data.get("model_type"),
            architectures=tuple(data.get("architectures", ())),
        )

    @property
    def gate(self) -> RayGate:
        return self._gate

    def reset_prefix_cache(self) -> bool:
        return bool(self.run("reset_prefix_cache", timeout=self.timeout))

    def set_weight_version(self, version: str) -> str | None:
        answer = self.run("set_weight_version", version, timeout=self.timeout)
        return None if answer is None else str(answer)

    def get_weight_version(self) -> str | None:
        answer = self.run("get_weight_version", timeout=self.timeout)
        return None if answer is None else str(answer)

    def describe(self) -> str:
        node = str(self.info.get("node", "?"))[:8]
        return f"Ray actor {self.info.get('actor', '?')} on node {node} ({self.info.get('engine')})"


class RayWorkers(Workers):
    """The workers of an actor's engine, called through the actor; they carry hotweights' extension (the actor
    serves no other engine), may run another hotweights, and map their own host's memory: buckets go through the
    object store."""

    def __init__(self, handle: RayEngineHandle) -> None:
        super().__init__(handle.facts.worker_extension)
        self.handle = handle
        self._extension = True

    def call(
        self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        wait = None if timeout is None else timeout + 5.0  # the actor's own timeout fires first
        return list(self.handle.run("call", method, list(args), kwargs, timeout, timeout=wait))

    @property
    def same_host(self) -> bool:
        return False

    @property
    def same_hotweights(self) -> bool:
        return False

    @property
    def default_transport(self) -> str:
        return "ray"

    def clear_kv_cache(self) -> int | None:
        answer = self.handle.run("clear_kv_cache", timeout=self.handle.timeout)
        return None if answer is None else int(answer)


class RayPausing(Pausing):
    """Whether the actor's engine sleeps, as the actor's own handle says."""

    def __init__(self, handle: RayEngineHandle) -> None:
        super().__init__(handle.workers)
        self.handle = handle

    def weights_asleep(self) -> bool:
        return bool(self.handle.run("is_sleeping", timeout=self.handle.timeout))


class RayModel(ServedModel):
    """The actor's model: config, dtype and family as its describe sent them, scored by the actor inside the
    install's hold of the gate."""

    probes = True

    def __init__(self, handle: RayEngineHandle) -> None:
        super().__init__(handle.workers, handle.expected_weights)
        self.info = handle.info
        self.handle = handle

    def family(self) -> tuple[str | None, str, str]:
        found = self.info.get("family")
        if isinstance(found, list) and len(found) == 3:
            return (None if found[0] is None else str(found[0])), str(found[1]), str(found[2])
        return super().family()

    def config(self) -> Any:
        """The actor engine's transformers config (sent as JSON by the actor), for the family probe's reference."""
        text = self.info.get("config")
        if not text:
            return None
        from hotweights.core.probe import config_from_json

        return config_from_json(str(text))

    def dtype(self) -> torch.dtype:
        dtype = getattr(torch, str(self.info.get("dtype") or "float32"), None)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        answer = self.handle.run("prompt_logprobs", [int(t) for t in token_ids], timeout=PROBE_TIMEOUT)
        return None if answer is None else [None if a is None else float(a) for a in answer]


class RayGate:
    """The :class:`~hotweights.core.gate.WriteGate` of an engine actor: the actor holds its own engine's gate from the
    install's first write to its end (with a bound: a trainer gone mid-write leaves the actor refusing generation,
    not waiting)."""

    def __init__(self, handle: RayEngineHandle) -> None:
        self.handle = handle
        self.refusal: str | None = None

    @contextmanager
    def installing(self, timeout: float | None = None) -> Iterator[float]:
        waited = float(self.handle.run("gate_enter", timeout, timeout=None if timeout is None else timeout + 5.0))
        try:
            yield waited
        finally:
            self.handle.run("gate_exit", timeout=self.handle.timeout)

    def refuse(self, reason: str) -> None:
        self.refusal = reason
        self.handle.run("gate_refuse", reason, timeout=self.handle.timeout)

    def reopen(self) -> None:
        self.refusal = None
        self.handle.run("gate_reopen", timeout=self.handle.timeout)
