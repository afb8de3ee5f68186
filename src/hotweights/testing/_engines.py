"""Real vLLM engines for tests, small and CPU-friendly, and their greedy outputs beside transformers' (needs
``vllm``, imported when an engine starts). Public through :mod:`hotweights.testing`."""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "BLOCK_SIZE",
    "PROMPTS",
    "EventLoopThread",
    "engine_settings",
    "greedy_hf",
    "greedy_vllm",
    "start_async_engine",
    "start_engine",
    "start_reference_engine",
    "stop_engine",
    "wait_for_stopped_engines",
]

T = TypeVar("T")

#: Block size the helpers start engines with; ``PROMPTS`` has one prompt longer than a block.
BLOCK_SIZE = 32

#: Greedy test prompts: three short ones and one longer than a KV block (exercises the prefix cache).
PROMPTS: list[list[int]] = [
    [1, 2, 3, 4, 5],
    [17, 99, 3, 250, 7, 7, 8],
    [900, 12, 512],
    [(i * 37 + 11) % 1000 for i in range(BLOCK_SIZE + 9)],
]


def start_engine(
    path: str | os.PathLike[str], dtype: str = "float32", *, multiprocess: bool | None = None, **overrides: Any
) -> Any:
    """A small CPU-friendly ``vllm.LLM`` on a local model directory (no tokenizer, prefix caching on).

    ``multiprocess`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING`` for this engine (None: leave the environment as is).
    """
    from vllm import LLM

    if multiprocess is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        import vllm.envs

        # vLLM caches its environment once an engine has started; a later engine must see the new mode.
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()

    return LLM(**_engine_kwargs(path, dtype, overrides))


def _engine_kwargs(path: str | os.PathLike[str], dtype: str, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=str(path),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=128,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
    )
    return {**kwargs, **overrides}


def engine_settings(llm: Any) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments (all but ``model``) that start an engine with ``llm``'s settings, read from
    its ``llm.llm_engine.vllm_config``: dtype, eager or compiled (``enforce_eager`` and the compilation mode), context
    length, seed, KV cache, scheduler limits, tensor-parallel size and LoRA.

    "Exact" in hotweights means equal to a freshly started engine *with the same settings*: in bf16, an eager and a
    compiled engine give different tokens on the same weights, so a reference must copy them. Finer settings vLLM
    derives at start-up (e.g. the compilation's passes) are left to vLLM's defaults, and the executor backend (e.g.
    TRL's ``external_launcher``) is not copied: pass an override to :func:`start_reference_engine` where one differs.
    """
    config = llm.llm_engine.vllm_config
    model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    compilation = config.compilation_config
    impl = model.model_impl
    settings: dict[str, Any] = dict(
        dtype=str(model.dtype).removeprefix("torch."),
        max_model_len=model.max_model_len,
        enforce_eager=model.enforce_eager,
        seed=model.seed,
        skip_tokenizer_init=model.skip_tokenizer_init,
        trust_remote_code=model.trust_remote_code,
        quantization=model.quantization,
        model_impl=getattr(impl, "value", impl),
        max_logprobs=model.max_logprobs,
        logprobs_mode=model.logprobs_mode,
        block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        kv_cache_dtype=cache.cache_dtype,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        compilation_config={"mode": int(compilation.mode)},
    )
    if cache.kv_cache_memory_bytes is not None:
        settings["kv_cache_memory_bytes"] = cache.kv_cache_memory_bytes
    if model.hf_overrides:
        settings["hf_overrides"] = model.hf_overrides
    if not model.skip_tokenizer_init:
        settings["tokenizer"] = model.tokenizer
    if config.lora_config is not None:
        lora = config.lora_config
        settings.update(enable_lora=True, max_lora_rank=lora.max_lora_rank, max_loras=lora.max_loras)
    return settings


def start_reference_engine(llm: Any, path: str | os.PathLike[str], **overrides: Any) -> Any:
    """A fresh ``vllm.LLM`` on the checkpoint in ``path`` with ``llm``'s settings (:func:`engine_settings`): the
    reference a hot-installed ``llm`` must equal, token for token, once it serves the same weights.

    The engine runs in this process or not as ``VLLM_ENABLE_V1_MULTIPROCESSING`` says; stop it with
    :func:`stop_engine`.
    """
    from vllm import LLM

    return LLM(model=str(path), **{**engine_settings(llm), **overrides})


def start_async_engine(path: str | os.PathLike[str], dtype: str = "float32", **overrides: Any) -> Any:
    """The ``AsyncLLM`` counterpart of :func:`start_engine` (same settings; always multiprocess).

    Call it on the event loop the engine will run on (e.g. through :meth:`EventLoopThread.run`); stop it with
    ``engine.shutdown()``.
    """
    import vllm.envs
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    getattr(vllm.envs, "disable_envs_cache", lambda: None)()
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_kwargs(path, dtype, overrides)))


class EventLoopThread:
    """An event loop in a daemon thread, as in an async trainer; :meth:`run` awaits a coroutine on it from the
    calling thread.

    Example:
        >>> loop = EventLoopThread()                                          # doctest: +SKIP
        >>> engine = loop.call(start_async_engine, path)                      # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        """Await ``coro`` on the loop; its result (or exception) within ``timeout`` seconds."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` called on the loop's thread (e.g. to build an ``AsyncLLM`` there)."""

        async def on_loop() -> T:
            return fn(*args, **kwargs)

        return self.run(on_loop())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


#: Multiprocess engines told to stop by ``stop_engine(llm, wait=False)`` whose teardown is still running.
_STOPPING: list[threading.Thread] = []


def stop_engine(llm: Any, *, wait: bool = True) -> None:
    """Shut an engine down now.

    In-process engines must be stopped explicitly: vLLM ``gc.freeze()``-s objects at start-up, so a dropped engine
    may be collected much later, and its finalizer then tears down the process-wide parallel groups that the
    *current* engine uses ("pipeline model parallel group is not initialized"). An in-process engine is always
    stopped before this returns.

    ``wait=False`` lets a multiprocess engine finish its teardown in the background (vLLM takes about 4 s on CPU
    to let its processes exit) while the caller starts the next engine; :func:`wait_for_stopped_engines` waits for
    every such engine, and runs at exit. Use it only where the next engine does not need the memory the old one
    frees (not on a GPU), and not before checking what the engine's exit removes (its shared-memory files).
    """
    from vllm.v1.engine.core_client import MPClient

    core = llm.llm_engine.engine_core
    if wait or not isinstance(core, MPClient):
        core.shutdown()
        return
    thread = threading.Thread(target=core.shutdown, name="hotweights-stop-engine", daemon=True)
    thread.start()
    _STOPPING.append(thread)


def wait_for_stopped_engines(timeout: float = 30.0) -> None:
    """Wait (at most ``timeout`` seconds each) for the engines ``stop_engine(llm, wait=False)`` left stopping."""
    while _STOPPING:
        _STOPPING.pop().join(timeout)


atexit.register(wait_for_stopped_engines)


def greedy_vllm(llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    """Greedy token ids from a ``vllm.LLM`` for each prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.no_grad()
def greedy_hf(model: Any, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    """Greedy token ids from a transformers model, one prompt at a time (no padding).

    A plain argmax decode, like vLLM's ``ignore_eos=True`` greedy sampling: the end-of-sequence token may be picked
    and decoding goes on (``generate(min_new_tokens=...)`` would forbid it instead).
    """
    result = []
    for p in prompts:
        ids = torch.tensor([list(p)])
        out = model(ids, use_cache=True)
        new: list[int] = []
        while True:
            new.append(int(out.logits[0, -1].argmax()))
            if len(new) == max_tokens:
                break
            out = model(torch.tensor([new[-1:]]), past_key_values=out.past_key_values, use_cache=True)
        result.append(new)
    return result
