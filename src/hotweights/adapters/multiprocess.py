"""Install into an engine started with hotweights' worker extension: the install session over a transport."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hotweights.adapters.installer import Installer, SessionAdapterOptions, split_options
from hotweights.adapters.wires import ExtensionWire
from hotweights.core.errors import EngineNotSupportedError
from hotweights.handles import EngineHandle, as_engine
from hotweights.transports import WeightTransport
from hotweights.vllm import introspect

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VLLMMultiprocessAdapter"]


class VLLMMultiprocessAdapter(Installer):
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

    name = "multiprocess"
    verifies_digests_locally = False  # the workers verify after transit

    def __init__(
        self, engine: Any, *, transport: str | WeightTransport = "shm", **options: Unpack[SessionAdapterOptions]
    ) -> None:
        handle = as_engine(engine)
        if handle.worker_extension != introspect.WORKER_EXTENSION:
            raise EngineNotSupportedError(
                f"this engine ({handle.describe()}) was not started with hotweights' worker extension, which "
                "VLLMMultiprocessAdapter (and with it streaming commits, kept shm segments and the direct setter) "
                f"needs; start it with worker_extension_cls={introspect.WORKER_EXTENSION!r}"
                + (
                    " (it runs in this process: VLLMInProcessAdapter needs no extension)"
                    if handle.inprocess
                    else ", or use hotweights.install(engine, ...), which reaches it without the extension"
                )
            )
        chosen, common = split_options(options)
        super().__init__(handle, ExtensionWire(handle, chosen.rpc_timeout), transport, chosen, **common)


def for_engine(handle: EngineHandle) -> VLLMMultiprocessAdapter:
    """The adapter :func:`hotweights.install` builds on the route ``extension``:
    the worker extension, over the engine's default transport."""
    return VLLMMultiprocessAdapter(handle, transport=handle.default_transport)
