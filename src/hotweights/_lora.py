"""``hotweights.install_lora``: a LoRA adapter alone into an engine started with ``enable_lora=True``.

An RL run that trains only a LoRA adapter sends the adapter, not a merged model: the base weights never move. The
adapter is checked against the base checkpoint the engine serves (every module's A and B, ranks, shapes, the
engine's ``max_lora_rank``) before anything is written, saved as PEFT saves it in a private directory in
``/dev/shm``, and loaded by vLLM under the engine's gate, replacing the previous version of the same name (vLLM loads
the new one first and keeps the old one if that fails); then the prefix cache is reset (vLLM 0.32 hashes an adapter's
name and path into its cached blocks, and each version has a path of its own; the reset also covers a vLLM that keys
them by name or id alone). Generation asks for it with :func:`lora_request`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.adapters.weights_path import _write_safetensors
from hotweights.core.errors import (
    EngineNotSupportedError,
    HotWeightsError,
    InstallError,
    Mismatch,
    StaleWeightVersionError,
    WeightManifestValidationError,
)
from hotweights.core.finite import check_finite
from hotweights.core.lora import adapter_config, lora_items, lora_mismatches
from hotweights.core.manifest import ExpectedWeights, TensorsLike
from hotweights.core.report import InstallReport, PhaseTimer
from hotweights.handles import EngineHandle, PauseMode, as_engine
from hotweights.telemetry import best_effort, log_report
from hotweights.transports.shm_files import SHM_DIR
from hotweights.versions import lora_directory_prefix
from hotweights.vllm import introspect

__all__ = [
    "checked_adapter",
    "install_lora",
    "install_lora_async",
    "install_lora_in_worker",
    "lora_request",
    "write_adapter",
]

#: The handle's shared state: name -> :class:`_Slot` of the current version; of the previous one; the next id.
_SLOTS = "_hotweights_lora_slots"
_PREVIOUS = "_hotweights_lora_previous"
_IDS = "_hotweights_lora_ids"


@dataclass(frozen=True)
class _Slot:
    lora_id: int
    version: int
    path: str


def _slots(handle: EngineHandle, which: str = _SLOTS) -> dict[str, _Slot]:
    slots: dict[str, _Slot] = handle.shared(which, dict)
    return slots


def install_lora(
    engine: Any,
    tensors: TensorsLike,
    *,
    name: str,
    weight_version: int,
    config: Any = None,
    pause: PauseMode = "wait",
    force: bool = False,
    timeout: float | None = 600.0,
    allow_nonfinite: bool = False,
) -> InstallReport:
    """Install the LoRA adapter ``tensors`` into ``engine`` as ``name``, version ``weight_version``.

    Args:
        engine: a ``vllm.LLM`` (in-process or multiprocess) started with ``enable_lora=True`` and a
            ``max_lora_rank`` at least the adapter's rank. An ``AsyncLLM`` goes through :func:`install_lora_async`.
        tensors: the adapter's weights: ``peft.get_peft_model_state_dict(model)``, or the ``lora_A`` / ``lora_B``
            entries of a PEFT model's ``state_dict()`` (other entries are refused, naming them).
        name: the adapter's name; generation uses it through ``lora_request=hotweights.lora_request(engine, name)``.
        config: the adapter's PEFT ``LoraConfig`` (or its dict: ``lora_alpha`` scales the adapter, so pass it);
            ``r`` and ``target_modules`` default to what the tensors say.
        pause: what happens to requests in flight (see :func:`hotweights.install`); a ``vllm.LLM`` waits for running
            generation calls, so no output mixes two versions of the adapter.
        force: accept a ``weight_version`` not newer than the adapter's current one.
        allow_nonfinite: load an adapter holding NaN or Inf (refused by default: on vLLM's CPU and GPU LoRA
            kernels such an adapter, once loaded, also changes what requests without a ``lora_request`` get).

    Returns:
        The report (``adapter="lora"``, ``previous_version``: the adapter's, None for its first install).

    Raises:
        WeightManifestValidationError: the adapter does not fit the base model or the engine (every mismatch
            listed); nothing was written, the previous version keeps serving.
        NonFiniteWeightsError: a tensor of the adapter holds NaN or Inf (each one named, with counts); nothing was
            written, the previous version keeps serving.
        StaleWeightVersionError: ``weight_version`` is not newer than the adapter's current one.
        EngineNotSupportedError: the engine was started without LoRA, or cannot load adapters from here.
        InstallError: vLLM refused the adapter while loading it; the previous version keeps serving.

    Example:
        >>> report = hotweights.install_lora(llm, get_peft_model_state_dict(model), name="policy",  # doctest: +SKIP
        ...                                  weight_version=step, config=model.peft_config["default"])
        >>> llm.generate(prompts, sp, lora_request=hotweights.lora_request(llm, "policy"))       # doctest: +SKIP
    """
    handle = as_engine(engine)
    if handle.kind == "async_llm":
        raise EngineNotSupportedError(
            "this is an AsyncLLM: install its adapter from async code with "
            "`await hotweights.install_lora_async(engine, tensors, name=..., weight_version=step)`"
        )
    return _install_lora(handle, tensors, name, weight_version, config, pause, force, timeout, allow_nonfinite)


async def install_lora_async(
    engine: Any,
    tensors: TensorsLike,
    *,
    name: str,
    weight_version: int,
    config: Any = None,
    pause: PauseMode = "wait",
    force: bool = False,
    timeout: float | None = 600.0,
    allow_nonfinite: bool = False,
) -> InstallReport:
    """:func:`install_lora` for async code, and for an ``AsyncLLM`` (await it on the loop the engine runs on)."""
    handle = as_engine(engine)
    if handle.kind == "async_llm":
        from hotweights.handles.async_llm import AsyncLLMHandle

        assert isinstance(handle, AsyncLLMHandle)
        handle.bind(asyncio.get_running_loop(), pause)
    args = (handle, tensors, name, weight_version, config, pause, force, timeout, allow_nonfinite)
    return await asyncio.to_thread(_install_lora, *args)


def checked_adapter(
    tensors: TensorsLike,
    expected: ExpectedWeights | None,
    max_rank: int | None,
    *,
    name: str,
    config: Any = None,
    nonfinite: bool = False,
    supported: Collection[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter's A and B weights under PEFT's saved names and its ``adapter_config.json``, once every check
    passed (one pass, before anything is written): names, ranks and shapes against the base checkpoint ``expected``
    and ``max_rank``, target modules among ``supported`` (the last part of a module's name, e.g. ``q_proj``; None:
    not checked here), and no NaN or Inf unless ``nonfinite``.

    Raises:
        WeightManifestValidationError: every mismatch, listed.
        NonFiniteWeightsError: each tensor holding NaN or Inf, with counts.
    """
    items, problems = lora_items(tensors)
    if not items and not problems:
        problems.append(Mismatch("missing", "<module>.lora_A.weight", "the adapter's A and B weights", "none"))
    problems += lora_mismatches(items, expected, max_rank)
    if supported is not None:
        problems += _unsupported(items, set(supported))
    if problems:
        raise WeightManifestValidationError(problems, context=f"LoRA adapter {name!r}")
    if not nonfinite:  # an adapter is small: one pass over it, before anything is written
        check_finite(items.items(), context=f"LoRA adapter {name!r}")
    return items, adapter_config(config, items)


def write_adapter(items: dict[str, torch.Tensor], files: dict[str, Any], weight_version: int) -> Path:
    """``items`` and ``files`` (from :func:`checked_adapter`) saved as PEFT saves an adapter, in a private directory
    in ``/dev/shm`` named for ``weight_version`` (what :func:`hotweights.lora_version_of` reads)."""
    directory = Path(tempfile.mkdtemp(prefix=lora_directory_prefix(weight_version), dir=SHM_DIR))
    try:
        _write_safetensors(directory / "adapter_model.safetensors", list(items.items()))
        (directory / "adapter_config.json").write_text(json.dumps(files))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def _unsupported(items: dict[str, torch.Tensor], supported: set[str]) -> list[Mismatch]:
    modules = sorted({n.rsplit(".lora_", 1)[0] for n in items})
    found = f"a module the engine's LoRA layers do not take; they take {', '.join(sorted(supported))}"
    return [Mismatch("unexpected", m, actual=found) for m in modules if m.rsplit(".", 1)[-1] not in supported]


def lora_request(engine: Any, name: str) -> Any:
    """vLLM's ``LoRARequest`` for the adapter last installed as ``name`` (pass it as ``lora_request=`` to
    ``generate``); :class:`HotWeightsError` when none was installed into this engine under that name."""
    slot = _slots(as_engine(engine)).get(name)
    if slot is None:
        raise HotWeightsError(f"no LoRA adapter {name!r} was installed into this engine; install_lora it first")
    return introspect.lora_request(name, slot.lora_id, slot.path)


def _install_lora(
    handle: EngineHandle,
    tensors: TensorsLike,
    name: str,
    weight_version: int,
    config: Any,
    pause: PauseMode,
    force: bool,
    timeout: float | None,
    allow_nonfinite: bool = False,
) -> InstallReport:
    max_rank = handle.lora.max_rank()
    if max_rank is None:
        raise EngineNotSupportedError(
            f"{handle.describe()} was started without LoRA; start it with enable_lora=True and max_lora_rank at "
            "least the adapter's rank (or install the merged model with hotweights.install)"
        )
    handle.check_pause_mode(pause)
    timer = PhaseTimer()
    with timer("validate"):
        expected = handle.expected_weights()
        items, files = checked_adapter(tensors, expected, max_rank, name=name, config=config, nonfinite=allow_nonfinite)
    with handle.installing(pause, timeout):
        slots = _slots(handle)
        slot = slots.get(name)
        if slot is not None and weight_version <= slot.version and not force:
            raise StaleWeightVersionError(weight_version, slot.version)
        lora_id = next(handle.shared(_IDS, lambda: itertools.count(1)))  # every version an id of its own
        with timer("pack"):
            directory = write_adapter(items, files, weight_version)
        try:
            with ExitStack() as held:  # generation waits from here to the reset
                with timer("wait_generation"):
                    held.enter_context(handle.gate.installing(timeout))
                start = time.perf_counter()
                with timer("install"):
                    _load(handle, name, lora_id, directory, slot)
                    retired = _retire(handle, name, slot)
                with timer("reset_prefix_cache"):  # no block cached with the old version may serve the new one
                    reset = handle.reset_prefix_cache()
            stall = time.perf_counter() - start
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if not slots:
            previous = _slots(handle, _PREVIOUS)
            handle.on_shutdown(lambda: _remove([*slots.values(), *previous.values()]))
        slots[name] = _Slot(lora_id, weight_version, str(directory))
    if retired is not None:
        shutil.rmtree(retired.path, ignore_errors=True)  # removed from the engine: nothing reads it any more
    return log_report(
        InstallReport(
            update_id=uuid.uuid4().hex,
            weight_version=weight_version,
            previous_version=slot.version if slot is not None else None,
            adapter="lora",
            num_tensors=len(items),
            num_bytes=sum(t.numel() * t.element_size() for t in items.values()),
            prefix_cache_reset=reset,
            phases=timer.phases,
            stall_s=stall,
        )
    )


def _load(handle: EngineHandle, name: str, lora_id: int, directory: Path, slot: _Slot | None) -> None:
    try:
        handle.lora.load_adapter(name, lora_id, str(directory))
    except HotWeightsError:
        raise
    except Exception as exc:
        serving = f"v{slot.version}" if slot is not None else "no adapter"
        raise InstallError(
            f"vLLM refused LoRA adapter {name!r}: {type(exc).__name__}: {exc}. It loads the new adapter before it "
            f"drops the old one, so {name!r} still serves {serving}. Fix the adapter (or the engine's LoRA settings) "
            "and install again."
        ) from exc


def _retire(handle: EngineHandle, name: str, slot: _Slot | None) -> _Slot | None:
    """``slot`` (the version just replaced) becomes ``name``'s previous version, still loadable; the one before it
    is removed from the engine (best effort: vLLM may have evicted it already) and returned, its files to delete."""
    previous = _slots(handle, _PREVIOUS)
    retired = previous.pop(name, None)
    if slot is not None:
        previous[name] = slot
    if retired is not None:
        with best_effort(f"remove LoRA adapter {name!r} v{retired.version} from the engine"):
            handle.lora.unload_adapter(retired.lora_id)
    return retired


def _remove(slots: list[_Slot]) -> None:
    for slot in slots:
        shutil.rmtree(slot.path, ignore_errors=True)


# ------------------------------------------------------------------------------------ from inside a worker
def install_lora_in_worker(
    worker: Any,
    tensors: TensorsLike,
    *,
    name: str,
    lora_id: int,
    weight_version: int,
    config: Any,
    expected: ExpectedWeights | None,
) -> dict[str, int | str | float]:
    """:func:`install_lora`'s checks and load, from inside a vLLM worker (where a framework's RPC delivers an
    adapter: verl's LoRA sync): ``tensors`` checked (also against the target modules the worker's LoRA layers
    take), saved as PEFT saves them, and loaded by the worker's own ``add_lora`` with ``load_inplace`` as adapter
    ``name`` of id ``lora_id``: vLLM loads the new adapter before it drops the one of that id, so a refused adapter
    leaves the previous one serving. vLLM holds the adapter in memory once loaded: the directory goes at once.
    Returns the install's summary.

    Raises:
        EngineNotSupportedError: the engine was started without LoRA.
        WeightManifestValidationError: the adapter does not fit the base model or the engine (every mismatch).
        NonFiniteWeightsError: a tensor holds NaN or Inf (each named, with counts).
        InstallError: vLLM refused the adapter while loading it; the previous adapter of that id still serves.
    """
    max_rank = introspect.worker_lora_rank(worker)
    if max_rank is None:
        raise EngineNotSupportedError(
            f"LoRA adapter {name!r} arrived, but the engine was started without LoRA: start it with enable_lora=True "
            "and max_lora_rank at least the adapter's rank"
        )
    start = time.perf_counter()
    supported = introspect.worker_lora_modules(worker)
    items, files = checked_adapter(tensors, expected, max_rank, name=name, config=config, supported=supported)
    checked = time.perf_counter()
    directory = write_adapter(items, files, weight_version)
    written = time.perf_counter()
    try:
        worker.add_lora(introspect.lora_request(name, lora_id, str(directory), replace=True))
    except HotWeightsError:
        raise
    except Exception as exc:
        raise InstallError(
            f"vLLM refused LoRA adapter {name!r}: {type(exc).__name__}: {exc}. It loads the new adapter before it "
            "drops the old one, so the previous adapter still serves."
        ) from exc
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "tensors": len(items),
        "bytes": sum(t.numel() * t.element_size() for t in items.values()),
        "adapter": "lora",
        "lora_id": lora_id,
        "validate_s": checked - start,
        "pack_s": written - checked,
        "install_s": time.perf_counter() - written,
    }
