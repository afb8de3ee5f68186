"""``hotweights.install(engine, tensors, weight_version=...)``: one call from a trainer loop, for any engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from hotweights._family import check_family
from hotweights.adapters.contract import WeightInstallAdapter
from hotweights.adapters.registry import adapter_for, adapter_of, cached_adapter
from hotweights.core import attach
from hotweights.core.cast import Cast
from hotweights.core.errors import (
    EngineNotSupportedError,
)
from hotweights.core.families import Unproven
from hotweights.core.layout import WeightLayout
from hotweights.core.manifest import MetadataValue, TensorsLike, WeightUpdateManifest, _as_items
from hotweights.core.report import InstallReport
from hotweights.core.sharded import agree, follow, gathering, is_sharded, same_host
from hotweights.core.sources import LocalTensors, TensorSource
from hotweights.handles import PauseMode, as_engine
from hotweights.transports.shm_writes import opened_for_writes
from hotweights.vllm import patches

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

__all__ = ["InstallOptions", "adapter_for", "detach", "install", "install_async"]


def detach(engine: Any) -> int:
    """Put back everything hotweights changed on ``engine`` (a ``vllm.LLM`` or an ``AsyncLLM``): its generation
    methods, its core client's calls and its sleep calls are vLLM's own again, and what hotweights kept there (the
    engine's handle, adapter, version, delta base, transports) is released. Returns the number of patches undone
    (0: hotweights never touched it).

    Call it when no install runs on the engine, e.g. to hand the engine back to code that must see vLLM unchanged.
    The next hotweights call on the engine attaches again, with a fresh handle (the version is read back from the
    engine).
    """
    handle = attach.get(engine, "handle")
    adapter = cached_adapter(handle) if handle is not None else None
    if adapter is not None:
        adapter.close()
    patches.release(attach.get(engine, "on_shutdown") or [])
    return attach.detach(engine)


class InstallOptions(TypedDict, total=False):
    """The keyword arguments of :func:`install` besides ``weight_version`` (same meaning, same defaults)."""

    update_id: str | None
    layout: WeightLayout | None
    metadata: Mapping[str, MetadataValue] | None
    force: bool
    digests: bool
    pause: PauseMode
    adapter: WeightInstallAdapter | None
    delta: bool
    verify: bool | Literal["strict"] | None
    cast: Cast | None
    unproven: Unproven | None
    group: Any
    allow_nonfinite: bool


def install(
    engine: Any, tensors: TensorsLike, *, weight_version: int, **options: Unpack[InstallOptions]
) -> InstallReport:
    """Install ``tensors`` (checkpoint format, or ``model.state_dict()`` as transformers holds it) into a running
    engine.

    Names transformers 5 holds in memory but not in checkpoints (a MoE model's fused experts
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``, Mixtral's ``mlp``, GraniteMoE's, ERNIE 4.5's, ...)
    are mapped to the checkpoint names the engine loads with transformers' own conversion rules for the engine's
    model type, as views where a view suffices (:func:`hotweights.core.names.to_checkpoint`).
    Builds the manifest, validates it against the tensors and the engine, installs through the adapter that fits
    the engine (see :func:`adapter_for`; the report names it), resets the prefix cache, records the version in the
    engine and returns the report. ``digests=True`` hashes every tensor so the engine verifies the bytes it
    received before installing (see ``InstallReport.digests_verified``).

    Args:
        engine: a ``vllm.LLM`` (in-process or multiprocess, any tensor-parallel size, with or without hotweights'
            worker extension) or an engine handle. An ``AsyncLLM`` goes through :func:`install_async`. None on the
            other ranks of a sharded install (below).
        tensors: a mapping or ``(name, tensor)`` pairs. ``DTensor`` values (FSDP2's ``model.state_dict()``) make
            the call collective: every rank of ``group`` calls ``install`` with its own state dict, one of them
            with the engine and the others with ``engine=None``; each tensor is gathered when the install sends it,
            never the whole model at once, and every rank returns the same report or raises the same error (see
            ``docs/trainers.md``).
        group: the process group of a sharded install (default: the whole world). Passing it makes the call
            collective even with plain tensors: every rank of ``group`` calls ``install``, the rank with the engine
            installs its own tensors and the others (``engine=None``) return its report.
        layout: ``WeightLayout(tp_rank=r, tp_size=n)``: ``tensors`` are this rank's tensor-parallel chunks of the
            checkpoint's tensors (each cut along one dimension, the last chunk padded); the call is collective like a
            ``DTensor`` one, and the chunks are gathered into the engine's shapes (``docs/trainers.md``).
        pause: what happens to requests in flight, for engines with a scheduler to pause (see
            :data:`~hotweights.handles.PauseMode`). A ``vllm.LLM`` always waits for running generation calls.
        adapter: install through this adapter (built on ``engine``, e.g. ``VLLMMultiprocessAdapter(engine,
            commit="streaming")``) instead of the one :func:`adapter_for` picks.
        verify: after the commit, the engine's workers read the live parameters back and compare them with what
            ``tensors`` put there (fused q/k/v and gate/up slices through the direct setter's plan); a mismatch is an
            :class:`InstallError` and generation then fails closed. Needs the install session in the engine (an
            in-process engine, or the worker extension): elsewhere ``ValueError``, nothing written.
            On CPU, linear weights packed by vLLM hold no data: ``report.readback_unreadable`` counts them, and a
            read-back that compared nothing is logged and said in ``report.readback_note``. ``"strict"``: any
            tensor not read back is an :class:`InstallError` (fail closed). Fused-MoE experts are read back in the
            kernel's own layout on CPU.
        cast: ``torch.bfloat16`` (any floating-point dtype) or ``"engine"`` (the dtype the engine expects for each
            tensor): floating-point tensors of another dtype, e.g. a trainer's fp32 master weights, are cast as
            they are sent, bucket by bucket (never a second copy of the model); ``report.cast_tensors`` counts
            them. Without it a dtype that differs from the engine's is refused before anything is written.
        delta: send only what changed since the version last installed into this engine (by any adapter on it):
            unchanged tensors are skipped, tensors with few changed elements go as indices + values (see
            ``docs/delta.md``). The first ``delta=True`` install sends everything (``report.delta == "full"``) and
            from then on the engine's handle keeps a host copy of what the engine serves (the model's size in host
            memory; the workers of a multiprocess engine keep one each, an in-process engine shares the trainer's).
            ``report.bytes_sent`` says what crossed.
        unproven: what to do with a model family the conformance matrix has not proven on this vLLM and device
            (``report.family_check`` says which it was): ``"probe"`` (default, or ``$HOTWEIGHTS_UNPROVEN``) scores
            the engine on a short probe against the sent tensors after the first install into each engine, before
            generation is let back in, and fails closed on a difference (engines that cannot be scored from here,
            e.g. an ``AsyncLLM``, refuse instead); ``"refuse"`` refuses before writing; ``"trust"`` installs
            unchecked. See ``docs/architectures.md``.
        allow_nonfinite: install tensors that hold NaN or Inf. By default the engine's side checks every tensor
            where its bytes already pass (each bucket as it is staged, on the device that holds it) and refuses the
            update before anything is written: a diverged step never reaches the engine.

    Raises:
        WeightManifestValidationError: the tensors do not match what the engine serves; nothing was written.
        NonFiniteWeightsError: a tensor holds NaN or Inf (each one named, with counts); nothing was written and
            the previous version keeps serving. Skip the step, or pass ``allow_nonfinite=True``.
        StaleWeightVersionError: ``weight_version`` is not newer than the active one (pass ``force=True``).
        UnprovenFamilyError: the model's family is not proven on this vLLM and device and cannot be probed from
            here (or ``unproven="refuse"``); nothing was written.
        FamilyProbeError: the first install of an unproven family left the engine scoring the probe off the sent
            tensors; generation fails closed.
        DeltaBaseMismatchError: ``delta=True``, but the engine does not serve the version the delta was computed
            against (someone else installed); nothing was written: install with ``delta=False``.
        EngineNotSupportedError: ``engine`` is not an engine hotweights reaches (or is an ``AsyncLLM``).
        EngineSleepingError: the engine is asleep; wake it first. Nothing was written.
        InstallError: the engine failed while installing.

    Example:
        >>> report = hotweights.install(llm, model.state_dict(), weight_version=step)  # doctest: +SKIP
        >>> print(report)                                                               # doctest: +SKIP
    """
    items = _as_items(tensors)  # once: an iterator (model.named_parameters()) is read here
    collective = _collective(engine, items, options)
    return _run(engine, items, weight_version, collective, **options)


def _collective(engine: Any, items: list[tuple[str, torch.Tensor]], options: Mapping[str, Any]) -> bool:
    """Whether this call is one rank's part of a sharded install: the other ranks' (no engine), a ``group``,
    ``DTensor`` values, or tensor-parallel chunks (``layout`` with ``tp_size > 1``)."""
    layout = options.get("layout")
    chunks = layout is not None and not layout.is_full
    return engine is None or options.get("group") is not None or chunks or is_sharded(items)


async def install_async(
    engine: Any, tensors: TensorsLike, *, weight_version: int, **options: Unpack[InstallOptions]
) -> InstallReport:
    """:func:`install` for async code: same arguments, report and errors; works on any engine, and is the way to
    install into an ``AsyncLLM`` (await it on the loop the engine runs on).

    Validation, packing and copying run in a worker thread, so the event loop keeps serving. Requests in flight
    are handled by ``pause``: ``"wait"`` (default) pauses the scheduler once they finished, so no response mixes
    weights; ``"abort"`` ends them at once (``finish_reason="abort"``; retry them); ``"keep"`` freezes them and they
    finish on the new weights attending to the KV cache the old weights computed (requests admitted after the
    install never reuse it); ``"recompute"`` freezes them and prefills them again on the new weights (inside
    ``report.stall_s``). With either, one response can mix two versions (``weight_versions_of(output)`` says which
    and how): only for off-policy trainers that accept it. Generation is resumed always, also on failure; the
    prefix cache is reset after the write, then the version is recorded in the engine.

    Example:
        >>> report = await hotweights.install_async(engine, model.state_dict(), weight_version=step)  # doctest: +SKIP
    """
    handle = None if engine is None else as_engine(engine)
    if handle is not None and handle.kind == "async_llm":
        from hotweights.handles.async_llm import AsyncLLMHandle

        assert isinstance(handle, AsyncLLMHandle)
        handle.bind(asyncio.get_running_loop(), options.get("pause", "wait"))
    items = _as_items(tensors)  # once: an iterator (model.named_parameters()) is read here
    collective = handle is None or _collective(handle, items, options)
    return await asyncio.to_thread(_run, handle, items, weight_version, collective, on_loop=True, **options)


def _run(
    engine: Any,
    items: list[tuple[str, torch.Tensor]],
    weight_version: int,
    collective: bool,
    *,
    on_loop: bool = False,
    group: Any = None,
    layout: WeightLayout | None = None,
    pause: PauseMode = "wait",
    adapter: WeightInstallAdapter | None = None,
    unproven: Unproven | None = None,
    update_id: str | None = None,
    metadata: Mapping[str, MetadataValue] | None = None,
    digests: bool = False,
    force: bool = False,
    delta: bool = False,
    verify: bool | Literal["strict"] | None = None,
    cast: Cast | None = None,
    allow_nonfinite: bool = False,
) -> InstallReport:
    """One install, start to end: where the tensors come from (this rank's, or gathered from every rank of a
    sharded install, which the engine's rank leads and the others follow), the engine's handle (made here, once),
    the adapter that fits it, the update under the names the engine loads, the family guard, then the adapter's
    install under the engine's install lock. ``on_loop``: called for :func:`install_async` (an ``AsyncLLM`` is
    driven from its loop)."""
    chunks = layout is not None and not layout.is_full
    source: TensorSource = LocalTensors(items)
    if collective:
        tp = (layout.tp_rank, layout.tp_size) if layout is not None and chunks else None
        leader = agree(items, weight_version, engine is not None, group, tp, finite=not allow_nonfinite)
        local = same_host(group)  # then each rank can write its own rows for the engine (rank writes)
        if engine is None:
            if not local:
                return follow(items, leader, group)
            return follow(items, leader, group, open_file=opened_for_writes)  # writes into the leader's buckets
        source = gathering(items, leader, group, tp_size=tp[1] if tp is not None else None, same_host=local)
        layout = None if chunks else layout  # the engine receives whole tensors
    try:
        handle = as_engine(engine)
        if handle.kind == "async_llm" and not on_loop:
            raise EngineNotSupportedError(
                "this is an AsyncLLM: its calls are awaited on its event loop, so install from async code with "
                "`report = await hotweights.install_async(engine, tensors, weight_version=step)`"
            )
        if adapter is not None and getattr(adapter, "engine", handle) is not handle:
            raise ValueError(
                "adapter= was built on another engine than the one passed to install; build it on this one"
            )
        handle.check_pause_mode(pause)
        chosen = adapter or adapter_of(handle)
        sent, manifest = source.update(
            chosen.expected, weight_version, update_id=update_id, layout=layout, metadata=metadata, digests=digests
        )
        family = check_family(handle, sent, unproven)
        with handle.installing(pause, chosen.lock_timeout):
            report = chosen.install(
                manifest,
                sent,
                force=force,
                delta=delta,
                verify=verify,
                cast=cast,
                family=family,
                allow_nonfinite=allow_nonfinite,
            )
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the group broke (maybe why it failed): the others fail on it too
            source.finish(exc)
        raise
    source.finish(report)
    return report


def update_for(
    adapter: WeightInstallAdapter,
    tensors: TensorsLike,
    weight_version: int,
    *,
    update_id: str | None = None,
    layout: WeightLayout | None = None,
    metadata: Mapping[str, MetadataValue] | None = None,
    digests: bool = False,
) -> tuple[list[tuple[str, torch.Tensor]], WeightUpdateManifest]:
    """The tensors under the names ``adapter``'s engine loads, and their manifest."""
    source = LocalTensors(_as_items(tensors))
    return source.update(
        adapter.expected, weight_version, update_id=update_id, layout=layout, metadata=metadata, digests=digests
    )
