"""The probe that guards a family nobody has proven (transformers, no vLLM).

Before the first install of an unproven family into an engine, the trainer computes a reference: the log-probability
of each token of a fixed short prompt, from a transformers model of the engine's config holding the very tensors
that are about to be sent (``from_pretrained(None, config=..., state_dict=...)``: transformers' own conversions map
checkpoint or in-memory names, and tensors of the right dtype are used as they are, not copied). After the write, and
before generation is let back in, the engine scores the same prompt (``prompt_logprobs``); a difference beyond the
engine dtype's tolerance fails the install closed. A stale, unpacked or mis-mapped layer moves these numbers by far
more than kernel rounding does.

Example:
    >>> ref = ProbeReference(token_ids=(3, 5, 7), logprobs=(-1.0, -2.0), tolerance=0.01)
    >>> ref.judge([-1.0, -2.005])
    (True, 0.005)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PROBE_LENGTH", "ProbeReference", "probe_tokens", "reference"]

#: Tokens in the probe prompt (the engine scores all but the first).
PROBE_LENGTH = 24

#: Largest |engine - reference| log-probability accepted, by the engine's dtype: vLLM's kernels against
#: transformers' on the same tensors (fp32: measured below 1e-4 on CPU; half types round every layer).
_TOLERANCE = {torch.float32: 0.02, torch.bfloat16: 0.5, torch.float16: 0.3}


@dataclass(frozen=True)
class ProbeReference:
    """What the engine must answer for :attr:`token_ids` after the install."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The log-probability of ``token_ids[i + 1]`` after ``token_ids[: i + 1]``."""
    tolerance: float

    def judge(self, got: Sequence[float | None]) -> tuple[bool, float]:
        """``(within tolerance, largest difference)`` of the engine's answer ``got`` (one per position)."""
        if len(got) != len(self.logprobs) or any(g is None or not math.isfinite(g) for g in got):
            return False, math.inf
        worst = max((abs(float(g) - r) for g, r in zip(got, self.logprobs, strict=True)), default=0.0)  # type: ignore[arg-type]
        return worst <= self.tolerance, round(worst, 6)


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> tuple[int, ...]:
    """A fixed prompt spread over the vocabulary (ids 2 .. vocab - 1)."""
    span = max(1, vocab_size - 2)
    return tuple(2 + (i * 7919 + 104729) % span for i in range(length))


@torch.no_grad()
def reference(config: Any, tensors: Any, engine_dtype: torch.dtype) -> ProbeReference:
    """The probe's reference from ``tensors`` (a mapping or ``(name, tensor)`` pairs: transformers' in-memory names
    or the checkpoint's) and the engine's transformers ``config``.

    Raises:
        ValueError: transformers has no model class for ``config``, or the tensors do not fill it (named).
    """
    import transformers

    model_cls = _model_class(transformers, config)
    state = dict(tensors.items() if hasattr(tensors, "items") else tensors)
    with _quiet(transformers):
        model, info = model_cls.from_pretrained(
            None, config=config, state_dict=state, output_loading_info=True, dtype=_dtype_of(state)
        )
    missing = [k for k in info.get("missing_keys", ()) if not _tied(k, config)]
    if missing:
        raise ValueError(f"the tensors do not fill a transformers {model_cls.__name__}: missing {sorted(missing)[:3]}")
    model.eval()
    vocab = int(getattr(config, "vocab_size", 0) or getattr(_text(config), "vocab_size", 0))
    ids = probe_tokens(vocab)
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device)).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
    tolerance = _TOLERANCE.get(engine_dtype, 0.5)
    return ProbeReference(ids, tuple(float(x) for x in logprobs[:, 0].cpu()), tolerance)


def _model_class(transformers: Any, config: Any) -> Any:
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(name), None)
        if cls is not None:
            return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError) as exc:
        raise ValueError(f"transformers has no causal-LM class for {type(config).__name__}") from exc


def _dtype_of(state: dict[str, Any]) -> torch.dtype:
    for t in state.values():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return torch.float32


def _text(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _tied(key: str, config: Any) -> bool:
    return key.endswith("lm_head.weight") and bool(getattr(_text(config), "tie_word_embeddings", False))


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bar or load report from transformers while the reference is built."""
    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    verbosity = logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
