"""The probe that guards a family nobody has proven (transformers, no vLLM).

Before the first install of an unproven family into an engine, the trainer computes a reference: the log-probability
of each token of a fixed short prompt, from a transformers model of the engine's config holding the very tensors
that are about to be sent (``from_pretrained(None, config=..., state_dict=...)``: transformers' own conversions map
checkpoint or in-memory names, and tensors of the right dtype are used as they are, not copied). After the write, and
before generation is let back in, the engine scores the same prompt (``prompt_logprobs``); a difference beyond the
engine dtype's tolerance fails the install closed. A stale, unpacked or mis-mapped layer moves these numbers by far
more than kernel rounding does.

Example:
    >>> ref = ProbeReference(token_ids=(3, 5, 7), logprobs=(-1.0, -2.0), tolerance=0.01, median_tolerance=0.005)
    >>> ref.judge([-1.0, -2.005])
    (True, 0.005)
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hotweights.core.cast import CastItems

__all__ = ["PROBE_LENGTH", "ProbeReference", "computing_in", "config_from_json", "probe_tokens", "reference"]

#: Tokens in the probe prompt (the engine scores all but the first).
PROBE_LENGTH = 24

#: The least tolerance on the largest and on the median |engine - reference| log-probability (fp32 engines: vLLM's
#: kernels against transformers' measured below 1e-4 on CPU).
FLOOR_MAX, FLOOR_MEDIAN = 0.02, 0.01
#: A half-precision engine rounds every weight and every layer's output: the tolerances are this many times the
#: difference that rounding the sent tensors to the engine's dtype makes in transformers' own scores (measured on
#: tiny models: bf16 engines land within 0.6x to 0.9x of it; a stale layer moves the scores 20x to 50x as far).
NOISE_FACTOR = 4.0


@dataclass(frozen=True)
class ProbeReference:
    """What the engine must answer for :attr:`token_ids` after the install."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The log-probability of ``token_ids[i + 1]`` after ``token_ids[: i + 1]``."""
    tolerance: float
    """The largest difference accepted at any position."""
    median_tolerance: float | None = None
    """The largest median difference accepted (None: ``tolerance / 2``)."""

    def judge(self, got: Sequence[float | None]) -> tuple[bool, float]:
        """``(within tolerance, largest difference)`` of the engine's answer ``got`` (one per position): both the
        largest and the median difference must be within their tolerances."""
        if len(got) != len(self.logprobs) or any(g is None or not math.isfinite(g) for g in got):
            return False, math.inf
        diffs = [abs(float(g) - r) for g, r in zip(got, self.logprobs, strict=True)]  # type: ignore[arg-type]
        worst = max(diffs, default=0.0)
        median = statistics.median(diffs) if diffs else 0.0
        limit = self.tolerance / 2 if self.median_tolerance is None else self.median_tolerance
        return worst <= self.tolerance and median <= limit, round(worst, 6)


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> tuple[int, ...]:
    """A fixed prompt spread over the vocabulary (ids 2 .. vocab - 1)."""
    span = max(1, vocab_size - 2)
    return tuple(2 + (i * 7919 + 104729) % span for i in range(length))


@torch.no_grad()
def reference(config: Any, tensors: Any, engine_dtype: torch.dtype) -> ProbeReference:
    """The probe's reference from ``tensors`` (a mapping or ``(name, tensor)`` pairs: transformers' in-memory names
    or the checkpoint's) and the engine's transformers ``config``.

    The reference computes in fp32. Where the engine computes in half precision (whatever dtype the tensors hold: fp32
    master weights, or bf16 tensors into a bf16 engine), the scores are computed a second time in the engine's dtype,
    and the tolerances are :data:`NOISE_FACTOR` times the difference (never below :data:`FLOOR_MAX` and
    :data:`FLOOR_MEDIAN`): kernel rounding of this very model sets the bar, not a constant.

    Raises:
        ValueError: transformers has no model class for ``config``, or the tensors do not fill it (named).
    """
    config = _as_served(config)
    vocab = int(getattr(config, "vocab_size", 0) or getattr(_text(config), "vocab_size", 0))
    ids = probe_tokens(vocab)
    held = _held_lazily(config, tensors) if isinstance(tensors, CastItems) and tensors.load is not None else None
    if held is not None:  # a sharded state dict: each module's tensors gathered while it runs, dropped after
        model, fetch, sent = held
    else:
        state = dict(tensors.items() if hasattr(tensors, "items") else tensors)
        model, fetch, sent = _model(config, state), None, _dtype_of(state)  # the sent tensors as they are
    half = engine_dtype.is_floating_point and engine_dtype.itemsize < 4
    # the reference computes in fp32 where the engine or the tensors are half precision: what the sent values mean
    scores = _scores(model, ids, torch.float32 if half or sent.itemsize < 4 else sent, fetch)
    max_tol, median_tol = FLOOR_MAX, FLOOR_MEDIAN
    if half:  # the engine rounds weights and every layer's output: this model's own rounding sets the bar
        noise = [abs(a - b) for a, b in zip(_scores(model, ids, engine_dtype, fetch), scores, strict=True)]
        max_tol = max(max_tol, NOISE_FACTOR * max(noise))
        median_tol = max(median_tol, NOISE_FACTOR * statistics.median(noise))
    return ProbeReference(ids, tuple(scores), round(max_tol, 6), round(median_tol, 6))


def config_from_json(text: str) -> Any:
    """A transformers config from its JSON (``config.to_json_string()``: what an engine in another process sends)."""
    import json

    import transformers

    data = json.loads(text)
    return transformers.AutoConfig.for_model(str(data.pop("model_type")), **data)


def _as_served(config: Any) -> Any:
    """``config`` as transformers runs it over the probe. vLLM clears ``sliding_window`` (None) where it serves every
    layer with full attention (a checkpoint's ``0``, or ``disable_sliding_window``); some transformers classes
    (Qwen2-MoE) build a sliding-window mask whatever their layers are, and refuse None. A window longer than the probe
    is the same full attention over its tokens (a copy of ``config`` gets one; ``config`` is left as it is)."""
    if not any(_cleared_window(c) for c in (config, _text(config))):
        return config
    config = copy.deepcopy(config)
    for c in (config, _text(config)):
        if _cleared_window(c):
            c.sliding_window = PROBE_LENGTH + 1
    return config


def _cleared_window(config: Any) -> bool:
    return "sliding_window" in getattr(config, "__dict__", {}) and config.sliding_window is None


def _model(config: Any, state: dict[str, Any]) -> Any:
    """A transformers model of ``config`` holding ``state`` in its own dtype (``from_pretrained`` keeps a tensor of
    the right dtype as it is)."""
    import transformers

    model_cls = _model_class(transformers, config)
    with _quiet(transformers):
        model, info = model_cls.from_pretrained(
            None, config=config, state_dict=state, output_loading_info=True, dtype=_dtype_of(state)
        )
    missing = [k for k in info.get("missing_keys", ()) if not _tied(k, config)]
    if missing:
        raise ValueError(f"the tensors do not fill a transformers {model_cls.__name__}: missing {sorted(missing)[:3]}")
    return model.eval()


#: Where a parameter's data is read from while its module runs (a lazily held model; None: it holds its data).
Fetch = Callable[[torch.Tensor], torch.Tensor | None]


def _held_lazily(config: Any, items: CastItems) -> tuple[Any, Fetch, torch.dtype] | None:
    """A model of ``config`` whose parameters are placeholders of ``items`` (sharded tensors, gathered when read),
    the fetch that reads each one while its module runs, and the sent dtype. None where transformers would convert a
    tensor (per-expert names into fused experts): a converted placeholder has no data to read."""
    specs = [(name, t.shape, items.targets.get(name, t.dtype)) for name, t in items.source]
    holders = {name: torch.zeros((), dtype=dtype).expand(shape) for name, shape, dtype in specs}
    index = {holders[name].data_ptr(): i for i, (name, _, _) in enumerate(specs)}
    model = _model(config, holders)
    if any(p.data_ptr() not in index for p in model.parameters()):
        return None

    def fetch(param: torch.Tensor) -> torch.Tensor | None:
        i = index.get(param.data_ptr())
        return None if i is None else items[i][1]

    dtypes = [dtype for _, _, dtype in specs if dtype.is_floating_point]
    return model, fetch, dtypes[0] if dtypes else torch.float32


def _scores(model: Any, ids: tuple[int, ...], dtype: torch.dtype, fetch: Fetch | None = None) -> list[float]:
    """transformers' log-probability of each of ``ids[1:]`` after the ones before, computed in ``dtype``."""
    device = next(model.parameters()).device
    with computing_in(model, dtype, fetch):
        logits = model(torch.tensor([ids], device=device)).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
    return [float(x) for x in logprobs[:, 0].cpu()]


#: Bytes of one weight cast at a time: a larger linear layer (an output head over a large vocabulary) is computed
#: in slices of its rows.
CAST_SLICE_BYTES = 4 << 20


@contextlib.contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype, fetch: Fetch | None = None) -> Iterator[None]:
    """Run ``model``'s forward in ``dtype`` while its weights stay as they are: each module's own floating-point
    parameters are cast as it runs and dropped after it, so the extra memory is one module's weights in ``dtype``
    (an embedding looks up, then casts the rows it found; a large linear layer casts slices of its rows in turn).
    Casting a weight before a lookup or a product gives the same numbers as casting the whole model first.

    With ``fetch``, the parameters are placeholders: each module's are read by ``fetch`` as it runs (then cast)."""
    patched: list[torch.nn.Module] = []
    hooks: list[Any] = []
    for module in model.modules():
        if fetch is not None:
            names = [n for n, _ in module.named_parameters(recurse=False)]
            if names:
                hooks.append(module.register_forward_pre_hook(_cast_own(names, dtype, fetch)))
                hooks.append(module.register_forward_hook(_uncast_own))
            continue
        own = [n for n, p in module.named_parameters(recurse=False) if p.is_floating_point() and p.dtype != dtype]
        plain = type(module).forward in (torch.nn.Linear.forward, torch.nn.Embedding.forward)  # not a subclass's own
        if plain and isinstance(module, torch.nn.Linear) and module.weight.numel() * dtype.itemsize > CAST_SLICE_BYTES:
            module.forward = _sliced(module, dtype)  # type: ignore[method-assign]  # also uncast: a CPU kernel
            patched.append(module)  # may repack the whole weight for one product
        elif not own:
            continue
        elif plain and isinstance(module, torch.nn.Embedding):
            module.forward = _looked_up(module, dtype)  # type: ignore[method-assign]
            patched.append(module)
        else:
            hooks.append(module.register_forward_pre_hook(_cast_own(own, dtype)))
            hooks.append(module.register_forward_hook(_uncast_own))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module in patched:
            del module.forward


def _cast_own(names: list[str], dtype: torch.dtype, fetch: Fetch | None = None) -> Any:
    def pre(module: torch.nn.Module, args: Any) -> Any:
        kept = module.__dict__.setdefault("_hotweights_uncast", {})
        for name in names:
            param = module._parameters[name]
            assert param is not None
            data = fetch(param) if fetch is not None else None
            data = param if data is None else data
            kept[name] = param
            module._parameters[name] = data.detach().to(dtype) if data.is_floating_point() else data  # type: ignore[assignment]
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    return pre


def _uncast_own(module: torch.nn.Module, args: Any, output: Any) -> None:
    for name, param in module.__dict__.pop("_hotweights_uncast", {}).items():
        module._parameters[name] = param


def _looked_up(module: torch.nn.Embedding, dtype: torch.dtype) -> Any:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(ids, module.weight, module.padding_idx, module.max_norm)
        return rows.to(dtype)

    return forward


def _sliced(module: torch.nn.Linear, dtype: torch.dtype) -> Any:
    rows = max(1, CAST_SLICE_BYTES // max(1, module.in_features * dtype.itemsize))

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype)
        weight, bias = module.weight, module.bias
        parts = []
        for start in range(0, module.out_features, rows):
            w = weight[start : start + rows].to(dtype)
            b = None if bias is None else bias[start : start + rows].to(dtype)
            parts.append(torch.nn.functional.linear(x, w, b))
        return torch.cat(parts, dim=-1)

    return forward


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
