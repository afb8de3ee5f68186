"""A ``hotweights`` checkpoint engine for verl: the trainer installs into rollout servers on other machines.

verl (0.9) moves weights from a trainer to rollout replicas that do not share its GPUs through a
``CheckpointEngine`` (``verl/checkpoint_engine/base.py``): verl's ``CheckpointEngineManager`` calls ``prepare``,
``build_topology`` and ``init_process_group`` on every trainer and rollout worker, then the trainer's
``send_weights(weights, global_steps)`` beside the rollout's ``receive_weights(global_steps)`` (whose tensors verl's
``ServerAdapter`` loads into the replica's vLLM), then ``finalize``. Naming this module::

    actor_rollout_ref.rollout.checkpoint_engine.backend=hotweights
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=hotweights.integrations.verl_checkpoint

registers the ``hotweights`` backend (verl imports the module on every worker before it builds the engine).
Trainer rank 0 installs each sync into every replica's vLLM server, reached over HTTP (:func:`hotweights.connect`):
checked against what the server serves before a byte moves, streamed in buckets through the transport hotweights
picks (``/dev/shm`` on the trainer's host, else a ``torch.distributed`` broadcast: ``collective``), committed
atomically and versioned by verl's ``global_steps``; several replicas switch together or not at all
(:class:`hotweights.Fleet`). A refused update raises hotweights' typed error from ``send_weights`` (so in verl's
trainer), and every replica keeps serving its previous version. The other trainer ranks walk verl's weight generator
(producing a tensor is collective over them), and the rollout side receives nothing: the weights are in the engine
already, and verl's ``ServerAdapter`` then sends an empty update, which hotweights' verl extension answers without
installing anything.

The replicas run vLLM's dev routes (``VLLM_SERVER_DEV_MODE=1``) and hotweights' verl worker extension
(``engine_kwargs.vllm.worker_extension_cls=hotweights.integrations.verl.VerlWorkerExtension``); their URLs are
the engine's ``urls``, or found as verl names its servers (``docs/verl.md``).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import hotweights
from hotweights.adapters import Installer, VLLMMultiprocessAdapter
from hotweights.core.errors import EngineNotSupportedError
from hotweights.handles.handle import PauseMode
from hotweights.handles.remote import PAUSE_MODES, RemoteHandle
from hotweights.transports import make_transport, transport_type

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError as exc:  # pragma: no cover - this module is only imported by verl
    raise ImportError(
        f"hotweights.integrations.verl_checkpoint is verl's 'hotweights' checkpoint engine, and verl cannot be "
        f"imported here ({exc}): install verl (tested: verl==0.9.1)"
    ) from exc

__all__ = ["BACKEND", "TRANSPORTS", "VERL_EXTENSION", "HotWeightsCheckpointEngine", "VerlServer", "verl_server_urls"]

#: The name verl's configuration gives this engine (``rollout.checkpoint_engine.backend``).
BACKEND = "hotweights"
#: The worker extension the replicas run (hotweights' own, with verl's ``update_weights_from_ipc``).
VERL_EXTENSION = "hotweights.integrations.verl.VerlWorkerExtension"
#: The transports this engine builds (``transport=``; unset: the server's default, ``shm`` on the trainer's host).
TRANSPORTS = ("shm", "collective")
#: How verl 0.9 names a replica's first server actor (vllm_async_server.py:1371, ``vLLMReplica.launch_servers``).
SERVER_ACTOR = "vllm_server_{replica}_0"


class VerlServer(RemoteHandle):
    """A replica's vLLM server started by verl with hotweights' verl extension, a subclass of hotweights' own
    (:data:`hotweights.WORKER_EXTENSION`): its workers answer as hotweights' extension, so it installs as a server
    started with that one."""


@CheckpointEngineRegistry.register(BACKEND)
class HotWeightsCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl's ``hotweights`` checkpoint engine (see the module docstring); verl builds it with its
    ``rollout.checkpoint_engine.engine_kwargs.hotweights`` mapping.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes: unused (hotweights sizes its buckets by
            its transport, or ``bucket_mb``).
        is_master: trainer rank 0 (verl sets it on the trainer ranks): the rank that installs.
        urls: the replicas' server URLs (``http://host:port``). Default: found through Ray as verl names its servers.
        token: the servers' hotweights token (their ``HOTWEIGHTS_TOKEN``; default: this process's).
        transport: ``"shm"`` or ``"collective"``; default: ``shm`` for a server on this host, else ``collective``.
        host: the address of this trainer that the servers reach for the ``collective`` transport (default: this
            node's address as Ray knows it, else loopback).
        backend: the ``collective`` transport's ``torch.distributed`` backend (``"gloo"``; ``"nccl"`` with
            ``device``).
        device: where the ``collective`` transport packs each bucket (``"cpu"``, or ``"cuda:0"`` for NCCL).
        bucket_mb: hotweights' bucket size in MiB (default: the transport's preferred size).
        pause: what a replica does with requests in flight (:data:`hotweights.handles.PauseMode`; verl has aborted
            them already when it syncs).
        timeout: seconds for a server's short requests (and the collective transport's waits).
        force: install a ``global_steps`` not newer than the version served (a trainer resumed from an older step).
        stage_timeout: seconds, with two or more replicas, for every replica to check and receive a sync before any
            writes it; past it every replica aborts and keeps its version (:class:`hotweights.Fleet`'s ``timeout``).
    """

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        urls: Iterable[str] | str | None = None,
        token: str | None = None,
        transport: str | None = None,
        host: str | None = None,
        backend: str = "gloo",
        device: str = "cpu",
        bucket_mb: int | None = None,
        pause: PauseMode = "wait",
        timeout: float = 60.0,
        force: bool = False,
        stage_timeout: float = 600.0,
    ) -> None:
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport is 'shm' or 'collective' (or unset: hotweights picks), not {transport!r}")
        if pause not in PAUSE_MODES:
            raise ValueError(f"pause is one of {PAUSE_MODES}, not {pause!r}")
        try:
            seconds = float(stage_timeout)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"stage_timeout is a number of seconds above 0, not {stage_timeout!r}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.urls = [urls] if isinstance(urls, str) else list(urls) if urls is not None else None
        self.token, self.transport, self.host, self.backend, self.device = token, transport, host, backend, device
        self.bucket_bytes = None if bucket_mb is None else int(bucket_mb) << 20
        self.pause, self.timeout, self.force, self.stage_timeout = pause, timeout, force, seconds
        self.version = 0
        self._replicas: dict[str, tuple[VerlServer, Installer]] = {}

    # ------------------------------------------------------------------------------------------- verl's contract
    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate: the buckets are hotweights' (made per install). The trainer's rank 0 finds its
        replicas here (every sync, so a replica verl added is installed into from then on)."""
        if self.is_master and self.urls is None:
            self._connect(verl_server_urls())
        return {"hotweights": True, "master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: each replica's server is reached over HTTP, its workers by the transport."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Connects trainer rank 0 to the configured replicas once (kept between syncs)."""
        if self.is_master and self.urls is not None:
            self._connect(self.urls)

    def finalize(self) -> None:
        """Nothing to free between syncs: the connections and transports are kept for the next one."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Install ``weights`` (verl's ``(name, tensor)`` generator, sync or async) into every replica as version
        ``global_steps`` (None: one more than the last sync). Returns verl's sync metrics.

        With several replicas the install is :class:`hotweights.Fleet`'s, all or nothing: every replica validates
        and receives the update (staged, nothing written), and only when all have it does any write it.

        Raises:
            WeightManifestValidationError, NonFiniteWeightsError, StaleWeightVersionError, ...: hotweights' typed
                errors: the first replica that refused, with a note naming it; every replica keeps its previous
                version.
            FleetPartialCommitError: a replica failed while writing (after every one had staged): it is fenced
                (refuses generation until the next sync heals it), the others serve ``global_steps``.
            EngineNotSupportedError: trainer rank 0 knows no replica.
        """
        items = [(name, tensor) async for name, tensor in _walk(weights)]  # every rank walks verl's generator
        if not self.is_master:
            return {}
        if not self._replicas:
            raise EngineNotSupportedError(
                "the hotweights checkpoint engine found no rollout server: set "
                "rollout.checkpoint_engine.engine_kwargs.hotweights.urls, or run verl's rollout replicas in this "
                "Ray cluster"
            )
        version = self.version + 1 if global_steps is None else int(global_steps)
        start = time.perf_counter()
        replicas = list(self._replicas.values())
        if len(replicas) == 1:
            server, adapter = replicas[0]
            report = await hotweights.install_async(
                server,
                items,
                weight_version=version,
                adapter=adapter,
                cast="engine",
                pause=self.pause,
                force=self.force,
            )
            sent = report.bytes_sent
        else:  # all or nothing: every replica stages, then every one commits; one refusal aborts them all
            fleet = hotweights.Fleet(
                [s for s, _ in replicas], adapters=[a for _, a in replicas], timeout=self.stage_timeout
            )
            done = await fleet.install_async(
                items, weight_version=version, cast="engine", pause=self.pause, force=self.force
            )
            sent = done.bytes_written
        self.version = version
        return {
            "hotweights/weight_version": float(version),
            "hotweights/seconds": time.perf_counter() - start,
            "hotweights/bytes_sent": float(sent),
            "hotweights/replicas": float(len(replicas)),
        }

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Nothing: trainer rank 0 installed into the replica's engine. verl's ``ServerAdapter`` sends this
        empty update to the engine, which hotweights' verl extension answers without installing anything."""
        return
        yield  # an async generator, as verl's ServerAdapter iterates it

    # ------------------------------------------------------------------------------------------------ the replicas
    def _connect(self, urls: Iterable[str]) -> None:
        for url in urls:
            if url not in self._replicas:
                server = VerlServer(url, token=self.token, timeout=self.timeout)
                adapter = VLLMMultiprocessAdapter(
                    server, transport=self._transport_for(server), bucket_bytes=self.bucket_bytes
                )
                self._replicas[url] = (server, adapter)

    def _transport_for(self, server: VerlServer) -> Any:
        name = self.transport or server.workers.default_transport
        if not transport_type(name).hosts_group:  # nothing of this trainer's to tell it: built by name
            return name
        host = self.host or _node_address()
        return make_transport(name, host=host, backend=self.backend, timeout=self.timeout, device=self.device)

    def adapters(self) -> dict[str, Installer]:
        """The adapter of each replica this rank installs into, by URL (empty on the other ranks)."""
        return {url: adapter for url, (_, adapter) in self._replicas.items()}

    def close(self) -> None:
        """Drop the replicas' transports (a process group, kept shared memory)."""
        replicas, self._replicas = list(self._replicas.values()), {}
        for _, adapter in replicas:
            adapter.close()


async def _walk(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def verl_server_urls() -> list[str]:
    """The URL of each rollout replica's vLLM server in this Ray cluster, as verl 0.9 names and exposes them (the
    actor ``vllm_server_<replica>_0`` and its ``get_server_address()``)."""
    import ray

    urls: list[str] = []
    while True:
        try:
            server = ray.get_actor(SERVER_ACTOR.format(replica=len(urls)))
        except ValueError:
            return urls
        found: Any = ray.get(server.get_server_address.remote())
        address, port = found
        urls.append(f"http://[{address}]:{port}" if ":" in str(address) else f"http://{address}:{port}")


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address()).strip("[]")  # type: ignore[no-untyped-call]
    except ImportError:
        pass
    return "127.0.0.1"
