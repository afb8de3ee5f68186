"""The named adapters: an :class:`~hotweights.adapters.Installer` built for one kind of engine (functions, not
subclasses), and the one :func:`hotweights.install` picks for each route of an engine's handle
(:mod:`hotweights.adapters.registry`).

- :func:`VLLMInProcessAdapter`: an in-process ``vllm.LLM``; its worker called directly, the tensors by reference;
- :func:`VLLMDirectSetterAdapter`: the same with ``install_method="direct"``, and a dry run (``plan``);
- :func:`VLLMMultiprocessAdapter`: an engine started with ``hotweights.WORKER_EXTENSION``, over any transport;
- :func:`VLLMWeightTransferAdapter`: an engine started with the ``"hotweights"`` weight-transfer backend;
- :func:`VLLMWeightsPathAdapter`: any other engine on this host, through vLLM's own ``reload_weights``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from hotweights.adapters.contract import PrefixCachePolicy
from hotweights.adapters.installer import Installer
from hotweights.adapters.options import CommitMode, InstallerOptions, InstallMethod
from hotweights.adapters.wires import ExtensionWire, InProcessWire, TransferAPIWire
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles import EngineHandle, as_engine
from hotweights.handles.llm import LLMHandle
from hotweights.transports import WeightTransport
from hotweights.vllm import introspect
from hotweights.vllm.plugin import BACKEND

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "EngineOptions",
    "SessionAdapterOptions",
    "VLLMDirectSetterAdapter",
    "VLLMInProcessAdapter",
    "VLLMMultiprocessAdapter",
    "VLLMWeightTransferAdapter",
    "VLLMWeightsPathAdapter",
    "extension",
    "inprocess",
    "split_options",
    "weight_transfer",
    "weights_path",
]


class EngineOptions(TypedDict, total=False):
    """What every installer bound to an engine takes (defaults in :class:`~hotweights.adapters.Installer`)."""

    expected: ExpectedWeights | None
    prefix_cache: PrefixCachePolicy
    lock_timeout: float | None
    guard_generation: bool


class SessionAdapterOptions(EngineOptions, total=False):
    """What the named adapters that run the install session take besides their transport: the fields of
    :class:`InstallerOptions` and of :class:`EngineOptions`."""

    bucket_bytes: int | None
    install_method: InstallMethod
    commit: CommitMode
    rpc_timeout: float | None
    verify: bool
    buckets_in_flight: int | None


def split_options(options: SessionAdapterOptions) -> tuple[InstallerOptions, EngineOptions]:
    """A named adapter's keyword arguments: the installer's options, and what every engine adapter takes."""
    fields = InstallerOptions.__dataclass_fields__
    chosen = InstallerOptions(**{k: v for k, v in options.items() if k in fields})  # type: ignore[arg-type]
    common: EngineOptions = {k: v for k, v in options.items() if k not in fields}  # type: ignore[assignment]
    return chosen, common


def VLLMInProcessAdapter(
    engine: Any,
    *,
    install_method: InstallMethod | None = None,
    rpc_timeout: float | None = None,
    verify: bool = False,
    **options: Unpack[EngineOptions],
) -> Installer:
    """Installs checkpoint-format tensors into an in-process ``vllm.LLM``; ``install_method="auto"`` by default (what
    :func:`hotweights.install` uses there).

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The install session
    (:mod:`hotweights.vllm.worker.session`) runs in the engine's worker, called directly: the manifest and the tensors
    are handed over by reference, never serialised or copied. The worker checks the manifest against the
    checkpoint it serves, then installs every tensor at once: by vLLM's layerwise reload (``install_method=
    "reload"``: fused parameters are rebuilt from complete parts and vLLM's post-load processing, e.g. oneDNN packing
    on CPU, runs on the new weights), by the direct setter (``"direct"``), or by whichever the setter's plan proves
    safe (``"auto"``, the default). Nothing is staged
    aside (the tensors are the caller's), so a failure while writing leaves a partial update: the engine then
    fails closed until a full install.

    Args:
        engine: the ``vllm.LLM``.
        install_method: ``"auto"`` (default), ``"reload"`` or ``"direct"``.
        expected: what the engine accepts; by default read from the safetensors headers of the model directory the
            engine was started from, in the engine's dtype.
        prefix_cache: ``"reset"`` (default) or ``"keep"``.
        rpc_timeout: seconds the install may take (None: no limit).
        lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).
        verify: default of ``install(..., verify=...)``: read the live parameters back after the install.

    Example:
        >>> adapter = VLLMInProcessAdapter(llm)                                      # doctest: +SKIP
        >>> manifest = WeightUpdateManifest.from_module(model, weight_version=step)  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                            # doctest: +SKIP
    """
    method = install_method or "auto"
    return _in_this_process(engine, method, verify, rpc_timeout, "inprocess", f"inprocess-{method}", options)


def VLLMDirectSetterAdapter(engine: Any, *, verify: bool = False, **options: Unpack[EngineOptions]) -> Installer:
    """Copies checkpoint-format tensors into the engine's own parameters, in place: the in-process install session
    with ``install_method="direct"``.

    Checkpoint names are mapped to vLLM parameters from the model's metadata (``packed_modules_mapping``, fused
    layers' head counts and output sizes, vocab padding, tensor-parallel rank, LoRA ``base_layer``): q/k/v land in
    their ``qkv_proj`` slices, gate/up in ``gate_up_proj``. :meth:`plan` is a dry run; an update that cannot be
    placed entirely is refused before the first copy. Parameters are written in place; layers that vLLM repacked on
    CPU (0-element parameters) are rebuilt from a full weight and re-processed. A fused parameter is written only
    with all its parts (q, k and v; gate and up) in the same update.

    Args:
        engine: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); for multiprocess engines use
            ``VLLMMultiprocessAdapter(llm, install_method="direct")``.
        expected, prefix_cache, lock_timeout, guard_generation: as for the other adapters.
        verify: default of ``install(..., verify=...)``: after the copies, read every placed slice back from the
            live parameters and compare it with the trainer's tensor (a ``verify`` phase in the report); a mismatch
            is an :class:`InstallError` and generation fails closed. On CPU, linear weights packed by vLLM hold no
            data to read (``report.readback_unreadable``); an engine that keeps them unpacked is verified whole.

    Example:
        >>> adapter = VLLMDirectSetterAdapter(llm)                                     # doctest: +SKIP
        >>> print("\\n".join(adapter.plan(manifest).describe()[:3]))                   # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                             # doctest: +SKIP
    """
    return _in_this_process(engine, "direct", verify, None, "direct-setter", "direct-setter", options)


def _in_this_process(
    engine: Any,
    method: InstallMethod,
    verify: bool,
    rpc_timeout: float | None,
    name: str,
    label: str,
    options: EngineOptions,
) -> Installer:
    """The installer of an in-process ``vllm.LLM``: its worker called directly, the tensors by reference."""
    handle = as_engine(engine)
    if not isinstance(handle, LLMHandle) or not handle.facts.inprocess:
        raise EngineNotSupportedError(
            "this vllm.LLM runs its engine in other processes; the in-process adapters hand tensors over by "
            "reference and cannot reach them. Start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0, or use "
            "hotweights.install(llm, ...) to pick an adapter that fits."
        )
    chosen = InstallerOptions(install_method=method, verify=verify, rpc_timeout=rpc_timeout)
    wire = InProcessWire(handle.llm, rpc_timeout)
    return Installer(handle, wire, "reference", chosen, name=name, label=label, **options)


def VLLMMultiprocessAdapter(
    engine: Any, *, transport: str | WeightTransport = "shm", **options: Unpack[SessionAdapterOptions]
) -> Installer:
    """Installs into an engine started with ``worker_extension_cls=hotweights.WORKER_EXTENSION``.

    The install session (:mod:`hotweights.vllm.worker.session`) through the extension's worker methods: the update is
    cut into buckets; each bucket goes through the transport and is staged by every worker with one RPC; with
    several workers all of them confirm they are ready (``prepare``) before any installs what it staged (by
    default with the direct setter where it is proven safe, else in one layerwise reload: see ``install_method``).
    Until then the model is untouched: any failure aborts the session and the previous weights keep serving
    (``commit="atomic"``, the default). The engine host then holds the whole update once, on top of the model. A
    one-bucket update into one worker is begun, staged and committed in one RPC.

    With ``commit="streaming"`` buckets are cut between layers and each one is installed as soon as the workers
    received it: the extra memory is one bucket (plus a layer whose parts span buckets), not the whole update.
    Generation waits from the first bucket to the end. Everything that can be checked before the first byte moves
    still is (names, shapes, dtypes; the direct setter's plan), but a failure *during* the transfer (a dead
    sender, a digest mismatch in a later bucket) leaves some layers new and some old: the install then raises
    :class:`InstallError`, the KV cache is zeroed, and a full install must follow before serving.

    Args:
        engine: the engine (a multiprocess ``vllm.LLM``, an ``AsyncLLM`` or an engine handle), started with the
            hotweights worker extension.
        transport: ``"shm"`` (default, same host), ``"bytes"``, or a :class:`WeightTransport` instance.
        bucket_bytes: bucket size (default: the transport's ``preferred_bucket_bytes``, capped at an eighth of
            available memory).
        install_method: how the workers install what they staged: ``"auto"`` (default: the direct setter where
            the workers' plan proves it safe at ``begin``, else vLLM's layerwise reload; see
            :func:`~hotweights.vllm.worker.setter.direct_refusals`), ``"direct"`` (the direct setter: planned, then
            copied into the parameters in place) or ``"reload"``. ``report.install_method``/``install_reason`` say which
            ran and why.
        commit: ``"atomic"`` (stage everything, then install: all or nothing) or ``"streaming"`` (install bucket
            by bucket: memory bounded by the bucket, a failed transfer leaves a partial update).
        expected, prefix_cache, lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: wrap this ``LLM``'s generation methods so that an install never overlaps a generation
            call in another thread (the install waits for running calls; new ones wait for the install).
        rpc_timeout: seconds each RPC may take before :class:`HotWeightsTimeoutError`.
        verify: default of ``install(..., verify=...)``: after the commit every worker reads its parameters back and
            compares them with the staged tensors (each fused slice through the direct setter's plan); a mismatch
            is an :class:`InstallError` and generation fails closed. Parameters that hold no data (linear weights
            packed by vLLM on CPU) cannot be read: ``report.readback_unreadable`` counts them. Needs
            ``commit="atomic"`` (a streaming install keeps no copy of what it wrote).

    Example:
        >>> llm = LLM(model=path, worker_extension_cls=hotweights.WORKER_EXTENSION)       # doctest: +SKIP
        >>> adapter = VLLMMultiprocessAdapter(llm, transport="shm")                      # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                # doctest: +SKIP
    """
    handle = as_engine(engine)
    if not handle.workers.extension:
        raise EngineNotSupportedError(
            f"this engine ({handle.describe()}) was not started with hotweights' worker extension, which "
            "VLLMMultiprocessAdapter (and with it streaming commits, kept shm segments and the direct setter) "
            f"needs; start it with worker_extension_cls={introspect.WORKER_EXTENSION!r}"
            + (
                " (it runs in this process: VLLMInProcessAdapter needs no extension)"
                if handle.facts.inprocess
                else ", or use hotweights.install(engine, ...), which reaches it without the extension"
            )
        )
    chosen, common = split_options(options)
    wire = ExtensionWire(handle, chosen.rpc_timeout)
    return Installer(handle, wire, transport, chosen, name="multiprocess", verifies_digests_locally=False, **common)


def VLLMWeightTransferAdapter(
    engine: Any, *, transport: str | WeightTransport = "shm", **options: Unpack[SessionAdapterOptions]
) -> Installer:
    """Drives vLLM's ``init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update``.

    The engine is started with ``weight_transfer_config={"backend": "hotweights"}`` (registered by hotweights'
    vLLM plugin), a thin shim over the same install session the worker extension runs
    (:mod:`hotweights.vllm.worker.transfer_backend`); buckets travel through any hotweights transport. With
    ``transport="collective"`` the trainer is rank 0 of a process group created through
    ``init_weight_transfer_engine`` — NCCL on GPU, gloo on CPU — and a new adapter (e.g. after a trainer restart)
    replaces the workers' stale group. Options, validation, versions, prefix cache and all-or-nothing installs are
    as for :class:`VLLMMultiprocessAdapter`; but vLLM's calls return nothing, so the report cannot say which method
    ran (``install_method`` is None) or what was read back (``verify`` is refused), and ``digests_verified``
    counts the digests the workers checked by having accepted every bucket (a mismatch raises).

    Example:
        >>> llm = LLM(model=path, weight_transfer_config={"backend": "hotweights"})            # doctest: +SKIP
        >>> adapter = VLLMWeightTransferAdapter(llm, transport="collective")                  # doctest: +SKIP
        >>> adapter.install(manifest, model.state_dict())                                     # doctest: +SKIP
    """
    handle = as_engine(engine)
    backend = handle.facts.weight_transfer_backend
    if backend != BACKEND:
        raise EngineNotSupportedError(
            f"this engine's weight transfer backend is {backend or 'not configured'!r}; start it with "
            f"LLM(..., weight_transfer_config={{'backend': {BACKEND!r}}}) with hotweights installed"
        )
    chosen, common = split_options(options)
    wire = TransferAPIWire(handle, chosen.rpc_timeout)
    name = "vllm-weight-transfer"
    return Installer(handle, wire, transport, chosen, name=name, verifies_digests_locally=False, **common)


def VLLMWeightsPathAdapter(
    engine: Any, *, rpc_timeout: float | None = 300.0, **options: Unpack[EngineOptions]
) -> Installer:
    """Installs through ``collective_rpc("reload_weights", weights_path=...)``, which every vLLM worker has.

    The validated update is written as one safetensors file into a private directory in ``/dev/shm`` (mode 0700,
    named ``hotweights-<pid>-…``); every worker then reloads it in one layerwise reload, so fused parameters are
    rebuilt from complete parts. The directory is removed on every outcome. Nothing touches the model until the
    reload starts; generation waits only for the reload itself.

    This is the zero-configuration path: a plain ``LLM(model=...)`` or ``AsyncLLM`` needs no extension. The worker
    extension buys more (bucketed, pre-checked staging with an all-or-nothing commit, streaming with bounded memory,
    the direct setter, kept segments: see :class:`VLLMMultiprocessAdapter`). Here the host holds the update once in
    ``/dev/shm`` for the length of the install, and a reload that fails midway leaves a partial update (the engine
    then fails closed). Afterwards the workers' model config names the removed directory: a later
    ``reload_weights()`` without arguments would not find it (hotweights always passes its own).

    Args:
        engine: a multiprocess ``vllm.LLM``, an ``AsyncLLM``, or an engine handle whose workers can read this host's
            ``/dev/shm``.
        rpc_timeout: seconds the reload may take before :class:`HotWeightsTimeoutError`.
        expected, prefix_cache, lock_timeout, guard_generation: see :class:`VLLMMultiprocessAdapter`.

    Example:
        >>> llm = LLM(model=path)                                   # doctest: +SKIP
        >>> VLLMWeightsPathAdapter(llm).install(manifest, tensors)  # doctest: +SKIP
    """
    chosen = InstallerOptions(rpc_timeout=rpc_timeout)
    return Installer(engine, None, None, chosen, name="weights-path", **options)


# ---------------------------------------------------------------------- what hotweights.install builds per route
def inprocess(handle: EngineHandle) -> Installer:
    """The route ``inprocess``: the session in this process, ``install_method="auto"``."""
    return VLLMInProcessAdapter(handle)


def extension(handle: EngineHandle) -> Installer:
    """The route ``extension``: the worker extension, over the engine's default transport."""
    return VLLMMultiprocessAdapter(handle, transport=handle.workers.default_transport)


def weight_transfer(handle: EngineHandle) -> Installer:
    """The route ``weight_transfer``: vLLM's weight-transfer API, over the engine's default transport."""
    return VLLMWeightTransferAdapter(handle, transport=handle.workers.default_transport)


def weights_path(handle: EngineHandle) -> Installer:
    """The route ``weights_path``: vLLM's own reload of a checkpoint written on this host."""
    return VLLMWeightsPathAdapter(handle)
