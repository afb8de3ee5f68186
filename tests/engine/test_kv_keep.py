"""``pause="keep"`` keeps the KV cache of requests in flight, ``pause="recompute"`` prefills them again on the new
weights: each checked token by token against transformers, on one real ``AsyncLLM`` (fp32, eager, greedy).

The references, for a request whose first ``s`` tokens the old weights sampled:

- kept KV: the old model over the prompt and tokens ``[:s-1]`` (their keys and values), then the new model over
  token ``s-1`` and on, attending to those keys and values (vLLM computes a sampled token's KV at the next step);
- recompute: the new model over the prompt and tokens ``[:s]``, then on.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import hotweights
from hotweights.core import families
from hotweights.handles import as_engine
from hotweights.handles.async_llm import PauseGate
from hotweights.testing import BLOCK_SIZE, EventLoopThread, greedy_hf, start_async_engine

from .conftest import Checkpoints, TinyCheckpoint, Variant, our_shm

pytestmark = pytest.mark.engine

VARIANT = Variant("qwen2", torch.float32, tie=False)
MAX_TOKENS = 96
#: As many as the engine runs at once (max_num_seqs=4): all four are decoding when the install pauses it.
CROSSING = [[(i * 37 + 11 + k * 101) % 1000 for i in range(12 + k)] for k in range(4)]
#: Two full KV blocks and a tail: cached whole by a request before the install.
SHARED = [(i * 53 + 7) % 1000 for i in range(2 * BLOCK_SIZE + 6)]
_ids = itertools.count()


@torch.no_grad()
def _continue(model: Any, out: Any, n: int) -> list[int]:
    """Greedy tokens from ``out`` (a forward pass with its cache) on, ``n`` of them."""
    new: list[int] = []
    while len(new) < n:
        new.append(int(out.logits[0, -1].argmax()))
        if len(new) < n:
            out = model(torch.tensor([new[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return new


@torch.no_grad()
def kept_reference(old: Any, new: Any, prompt: Sequence[int], done: Sequence[int], n: int) -> list[int]:
    """``new`` continuing ``done`` with the keys and values ``old`` computed for the prompt and ``done[:-1]``."""
    past = old(torch.tensor([[*prompt, *done[:-1]]]), use_cache=True).past_key_values
    return _continue(new, new(torch.tensor([[done[-1]]]), past_key_values=past, use_cache=True), n)


@torch.no_grad()
def recompute_reference(new: Any, prompt: Sequence[int], done: Sequence[int], n: int) -> list[int]:
    """``new`` over the prompt and ``done``, then on."""
    return _continue(new, new(torch.tensor([[*prompt, *done]]), use_cache=True), n)


@dataclass
class Engine:
    loop: EventLoopThread
    engine: Any
    a: TinyCheckpoint
    b: TinyCheckpoint
    version: int = 0

    @property
    def gate(self) -> PauseGate:
        gate = as_engine(self.engine).gate
        assert isinstance(gate, PauseGate)
        return gate

    async def final(self, prompt: Sequence[int], max_tokens: int, seen: Callable[[int], None] | None = None) -> Any:
        """The final output of one greedy request; ``seen(n)`` after each output with ``n`` tokens so far."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": list(prompt)}, sp, request_id=f"k{next(_ids)}"):
            final = out
            if seen is not None:
                seen(len(out.outputs[0].token_ids))
        return final

    def greedy(self, prompt: Sequence[int], max_tokens: int = 8) -> list[int]:
        return list(self.loop.run(self.final(prompt, max_tokens)).outputs[0].token_ids)

    def install_during(
        self, ckpt: TinyCheckpoint, pause: str, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS
    ) -> tuple[list[Any], hotweights.InstallReport]:
        """Start ``prompts``; once each produced two tokens, install ``ckpt`` with ``pause``; their final outputs
        and the report."""

        async def scenario() -> tuple[list[Any], hotweights.InstallReport]:
            decoding = [asyncio.Event() for _ in prompts]

            def seen(i: int) -> Callable[[int], None]:
                return lambda n: decoding[i].set() if n >= 2 else None

            tasks = [asyncio.create_task(self.final(p, max_tokens, seen(i))) for i, p in enumerate(prompts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), 120)
            self.version += 1
            options: dict[str, Any] = {"pause": pause}
            report = await hotweights.install_async(
                self.engine, ckpt.state_dict(), weight_version=self.version, **options
            )
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 120)), report

        return self.loop.run(scenario())


@pytest.fixture(scope="module")
def eng(checkpoint: Checkpoints) -> Iterator[Engine]:
    a, b = checkpoint.expected(VARIANT, 1), checkpoint.expected(VARIANT, 2)
    loop = EventLoopThread()
    engine = loop.call(start_async_engine, a.path)
    try:
        yield Engine(loop, engine, a, b)
    finally:
        engine.shutdown()
        loop.close()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    assert our_shm() == []


def _check_crossed(outs: list[Any], old: Any, new: Any, pause: str) -> None:
    """Every request crossed the install, and equals the reference of ``pause`` (which differs from the other)."""
    for prompt, out in zip(CROSSING, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        versions = hotweights.weight_versions_of(out)
        assert len(tokens) == MAX_TOKENS and len(versions.spans) == 2, f"did not cross the install: {versions}"
        s = versions.spans[0].end
        assert 2 <= s < MAX_TOKENS
        kept = kept_reference(old, new, prompt, tokens[:s], MAX_TOKENS - s)
        recomputed = recompute_reference(new, prompt, tokens[:s], MAX_TOKENS - s)
        assert kept != recomputed, "the two references agree here: this request cannot tell the modes apart"
        assert tokens[s:] == (kept if pause == "keep" else recomputed), f"{pause}: not its reference (s={s})"
        assert versions.kv == ("kept" if pause == "keep" else "recomputed")


def test_keep_decodes_on_the_old_weights_kv(eng: Engine) -> None:
    """Before: vLLM preempted every request under "keep" and recomputed it on the new weights (0 of 4 matched the
    kept-KV reference)."""
    outs, report = eng.install_during(eng.b, "keep", CROSSING)
    _check_crossed(outs, eng.a.model, eng.b.model, "keep")
    assert report.prefix_cache_reset is True  # the new KV epoch keeps old blocks from new requests
    assert eng.greedy(SHARED) == greedy_hf(eng.b.model, [SHARED])[0]


def test_recompute_prefills_again_on_the_new_weights_within_the_stall(eng: Engine) -> None:
    outs, report = eng.install_during(eng.a, "recompute", CROSSING)
    _check_crossed(outs, eng.b.model, eng.a.model, "recompute")
    waited = eng.gate.recompute_s
    assert waited is not None and waited > 0, "the install did not wait for the re-prefill"
    assert report.stall_s is not None and report.stall_s >= waited
    assert eng.greedy(SHARED) == greedy_hf(eng.a.model, [SHARED])[0]


def test_a_request_after_a_keep_install_never_reuses_old_blocks(eng: Engine) -> None:
    """A prompt whose blocks the old weights cached (and a request still decoding on them holds, so vLLM cannot drop
    the cache) is served after the install as a fresh engine on the new weights serves it."""
    old, new = eng.a.model, eng.b.model  # the engine serves A (the previous test installed it)
    assert eng.greedy(SHARED) == greedy_hf(old, [SHARED])[0]  # its blocks are cached now
    sibling = [*SHARED[: 2 * BLOCK_SIZE], 5, 6, 7]  # the same two full blocks, another tail
    outs, _ = eng.install_during(eng.b, "keep", [SHARED], max_tokens=40)
    assert len(hotweights.weight_versions_of(outs[0]).spans) == 2, "the old request was over before the install"
    fresh = greedy_hf(new, [SHARED, sibling])
    assert fresh != greedy_hf(old, [SHARED, sibling])
    assert [eng.greedy(SHARED), eng.greedy(sibling)] == fresh
    # a user's own cache_salt is kept (combined with the epoch): its requests are served right too
    from vllm import SamplingParams

    async def salted() -> Any:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        prompt = {"prompt_token_ids": sibling, "cache_salt": "user-salt"}
        final = None
        async for out in eng.engine.generate(prompt, sp, request_id=f"k{next(_ids)}"):
            final = out
        return final

    assert list(eng.loop.run(salted()).outputs[0].token_ids) == fresh[1]


def test_keep_through_a_probed_first_install_labels_what_decoded_during_the_probe(
    eng: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No family proven (vLLM 0.31, 0.33, 0.34, GPUs): the first install into the engine is probed. Under keep, the
    requests in flight decode on the new weights while the probe runs, so their tokens from then on carry the new
    version: the kept-KV reference holds from the labelled switch (labelled from the version record instead, the
    tokens decoded during the probe would read as the old version's)."""
    monkeypatch.setattr(families, "PROVEN", {})
    as_engine(eng.engine).__dict__.pop("_hotweights_family_probed", None)  # as on the engine's first install
    on_a = eng.greedy(SHARED) == greedy_hf(eng.a.model, [SHARED])[0]
    old, new = (eng.a, eng.b) if on_a else (eng.b, eng.a)
    outs, report = eng.install_during(new, "keep", CROSSING)
    assert "probed at" in (report.family_check or "") and "family_probe" in report.phases, report.family_check
    _check_crossed(outs, old.model, new.model, "keep")
    assert eng.greedy(SHARED) == greedy_hf(new.model, [SHARED])[0]
