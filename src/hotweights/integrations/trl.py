"""TRL trainers that generate through vLLM sync their weights through hotweights: ``attach(trainer)``.

Works with every trainer that holds a ``trl.generation.vllm_generation.VLLMGeneration`` as
``trainer.vllm_generation`` (``GRPOTrainer``, ``RLOOTrainer``, the distillation trainers, with ``use_vllm=True``).
TRL's own ``sync_weights`` pushes one tensor at a time through ``model.load_weights``; after ``attach`` each sync
gathers every tensor exactly as TRL does (DeepSpeed ZeRO-3, FSDP1/2, PEFT merge and name clean-up, through TRL's
own ``VLLMGeneration._iter_named_params``), and makes **one** atomic :func:`hotweights.install` with
``weight_version = trainer.state.global_step`` and ``cast`` the engine's dtype (floating tensors are cast bucket by
bucket as they are sent).

With a PEFT model and a colocated engine started with LoRA (``with lora_engine(max_lora_rank=r):`` around the
trainer's construction: TRL itself never enables LoRA in vLLM), each sync sends the adapter alone
(:func:`hotweights.install_lora`, a few MB instead of the model) and the engine's ``generate`` uses it for TRL's
rollouts; elsewhere the merged model is installed, as TRL does.

TRL is imported only inside these functions: ``import hotweights`` never imports it.

Example:
    >>> trainer = GRPOTrainer(model=..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate"), ...)  # doctest: +SKIP
    >>> sync = hotweights.integrations.trl.attach(trainer)                                        # doctest: +SKIP
    >>> trainer.train()                                                                           # doctest: +SKIP
    >>> print(sync.last_report)                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

import hotweights
from hotweights._install import InstallOptions, install
from hotweights._lora import install_lora, lora_request
from hotweights.core import attach as _attach
from hotweights.core.errors import EngineNotSupportedError, HotWeightsError
from hotweights.core.report import InstallReport
from hotweights.handles import as_engine
from hotweights.vllm import introspect

__all__ = ["LORA_NAME", "TRLWeightSync", "attach", "lora_engine"]

#: The name the trainer's adapter is installed under in an adapter-only sync.
LORA_NAME = "trl-policy"
#: The install options an adapter-only sync passes on to :func:`hotweights.install_lora`.
_LORA_OPTIONS = frozenset({"pause", "force", "allow_nonfinite"})

_TESTED_TRL = "trl==1.16.0"
# hotweights.install's keyword options that attach() passes on; weight_version and update_id it sets per sync.
_INSTALL_OPTIONS = frozenset(InstallOptions.__annotations__) - {"update_id"}


class TRLWeightSync:
    """What :func:`attach` returns: replaces ``trainer.vllm_generation.sync_weights`` until :meth:`detach`.

    Attributes:
        reports: one :class:`~hotweights.InstallReport` per install made by this handle, oldest first (empty on
            the ranks that do not hold the engine: every rank still takes part in the gather).
    """

    def __init__(
        self, trainer: Any, target: Any, dtype: torch.dtype | None, options: dict[str, Any], lora: bool = False
    ) -> None:
        self.trainer = trainer
        self.lora = lora
        """Whether each sync sends the PEFT adapter alone (:func:`hotweights.install_lora`, as :data:`LORA_NAME`)
        instead of the merged model."""
        self.generation: Any = trainer.vllm_generation
        self.target = target
        """What installs go to: the colocated ``vllm.LLM``, the ``hotweights.connect`` client, or None on ranks
        that only take part in the gather."""
        self.dtype = dtype
        """The engine's dtype: floating tensors are cast to it (None: sent as they are)."""
        self.options = options
        self.reports: list[InstallReport] = []
        self._attached = True
        self._callback = _SyncAtTrainEnd(self)

    @property
    def last_report(self) -> InstallReport | None:
        """The report of the latest install (None before the first one)."""
        return self.reports[-1] if self.reports else None

    def sync(self) -> InstallReport | None:
        """Gather the trainer's weights (every rank must call it, like TRL's ``sync_weights``) and install them in
        one atomic update versioned ``trainer.state.global_step``. Returns the report where this rank installs."""
        gen = self.generation
        if self.lora:
            return self._sync_adapter()
        if gen.mode == "colocate" and gen.enable_sleep_mode:
            # As TRL does: map the weights' memory back before writing into it.
            _empty_device_cache()
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        tensors: dict[str, torch.Tensor] = {}
        copy = _gathered_views(gen)
        for name, param in gen._iter_named_params():  # a collective under ZeRO-3/FSDP: every rank iterates
            if self.target is None:
                continue
            tensor = param.detach()
            if copy:  # the view is released (ZeRO-3) or unmerged (PEFT) when the gather ends: a copy, cast once
                cast = self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype
                tensor = tensor.to(self.dtype) if cast else tensor.clone()
            tensors[name] = tensor
        if self.target is None:
            return None
        version = int(self.trainer.state.global_step)
        options = {**self.options, "force": self._force(version)}
        if self.dtype is not None:  # the rest is cast bucket by bucket as it is sent
            options.setdefault("cast", self.dtype)
        report = install(self.target, tensors, weight_version=version, **options)
        self.reports.append(report)
        return report

    def _force(self, version: int) -> bool:
        """The ``force`` of an install at ``version``: the caller's, or True when the last install was this same
        step (TRL re-pushes it after sleep level 2 discarded the weights: the same version is legitimate)."""
        last = self.last_report
        return bool(self.options.get("force", False)) or (last is not None and last.weight_version == version)

    def _sync_adapter(self) -> InstallReport:
        """The adapter alone, as PEFT saves it, versioned ``trainer.state.global_step``; the engine already holds
        the base (an adapter-only sync needs no collective: every colocated rank holds the whole adapter)."""
        from peft import get_peft_model_state_dict

        model = self.trainer.accelerator.unwrap_model(self.generation.model)
        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        version = int(self.trainer.state.global_step)
        options = {k: v for k, v in self.options.items() if k in _LORA_OPTIONS}
        options["force"] = self._force(version)
        config = model.peft_config[model.active_adapter]
        report = install_lora(self.target, adapter, name=LORA_NAME, weight_version=version, config=config, **options)
        self.reports.append(report)
        return report

    def detach(self) -> None:
        """Give ``sync_weights`` back to TRL (and close the server client :func:`attach` opened); the engine's
        ``generate`` no longer adds the adapter."""
        if not self._attached:
            return
        self._attached = False
        _attach.detach(self)
        if self.generation.__dict__.get("sync_weights") == self.sync:
            del self.generation.sync_weights
        _attach.detach(self.generation)
        remove = getattr(self.trainer, "remove_callback", None)
        if callable(remove):
            remove(self._callback)
        if self.generation.mode == "server" and self.target is not None:
            close = getattr(self.target, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> TRLWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def attach(trainer: Any, *, lora: bool | None = None, **install_options: Any) -> TRLWeightSync:
    """Make ``trainer`` (TRL, ``use_vllm=True``) sync its weights through :func:`hotweights.install`.

    Args:
        trainer: a TRL trainer holding ``trainer.vllm_generation`` (GRPO, RLOO, distillation trainers).
        lora: send a PEFT model's adapter alone (:func:`hotweights.install_lora`, named :data:`LORA_NAME`) and
            make the colocated engine's ``generate`` use it (a call that passes its own ``lora_request`` keeps
            it). None (default): where it can (a PEFT model, TRL's colocate mode, an engine started with LoRA,
            see :func:`lora_engine`, no sleep mode, no ZeRO-3/FSDP sharding the adapter); else the merged model.
            True: it must (:class:`EngineNotSupportedError` naming what prevents it). False: the merged model.
        **install_options: keyword options passed to every :func:`hotweights.install` (``layout``,
            ``metadata``, ``force``, ``digests``, ...); an adapter-only sync takes ``pause`` and ``force`` only.

    Returns:
        The handle: ``last_report``, ``reports``, ``sync()`` and ``detach()``.

    Raises:
        EngineNotSupportedError: the trainer does not generate through vLLM, this TRL version lacks what the
            integration uses, or server mode is asked for and ``hotweights.connect`` is not available.
        HotWeightsError: the trainer is already attached.
        TypeError: an unknown install option.

    Example:
        >>> sync = hotweights.integrations.trl.attach(trainer, digests=False)  # doctest: +SKIP
        >>> trainer.train()                                                     # doctest: +SKIP
    """
    unknown = sorted(set(install_options) - _INSTALL_OPTIONS)
    if unknown:
        raise TypeError(
            f"attach() got unknown install options {unknown}: pass only {sorted(_INSTALL_OPTIONS)} "
            "(weight_version is the trainer's global step)"
        )
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None:
        raise EngineNotSupportedError(
            f"{type(trainer).__name__} has no vllm_generation: build it with use_vllm=True "
            "(GRPOTrainer, RLOOTrainer or a distillation trainer) before calling attach()"
        )
    if _attach.get(gen, "sync") is not None:
        raise HotWeightsError("this trainer is already attached to hotweights: call detach() on the first handle")
    if not callable(getattr(gen, "_iter_named_params", None)):
        raise EngineNotSupportedError(
            f"this TRL's VLLMGeneration has no _iter_named_params (the gather hotweights reuses): install "
            f"{_TESTED_TRL} (pip install 'hotweights[trl]')"
        )
    target: Any = None
    dtype: torch.dtype | None = None
    if gen.mode == "colocate":
        target = gen.llm  # every colocated rank holds its own engine (or its TP shard's)
        dtype = introspect.engine_dtype(target)
    elif gen.mode == "server":
        connect = getattr(hotweights, "connect", None)
        if connect is None:
            raise EngineNotSupportedError(
                "TRL server mode needs hotweights.connect(url) to reach the vLLM server, and this hotweights has "
                "none: use vllm_mode='colocate', or upgrade hotweights"
            )
        if trainer.accelerator.is_main_process:  # as in TRL: only the main process talks to the server
            url = gen.server_base_url or f"http://{gen.server_host}:{gen.server_port}"
            target = connect(url)
            dtype = _remote_dtype(target)
    else:
        raise EngineNotSupportedError(f"unknown TRL vllm_mode {gen.mode!r}: use 'colocate' or 'server'")
    adapter_only = _adapter_only(gen, target, lora)
    ignored = sorted(set(install_options) - _LORA_OPTIONS) if adapter_only else []
    if ignored:
        raise TypeError(
            f"an adapter-only sync passes only {sorted(_LORA_OPTIONS)} to hotweights.install_lora, not {ignored}; "
            "drop them, or pass lora=False to sync the merged model with them"
        )
    handle = TRLWeightSync(trainer, target, dtype, dict(install_options), lora=adapter_only)
    if adapter_only:
        _attach.patch(handle, gen.llm, "generate", functools.partial(_with_adapter, gen.llm))
    _attach.put(gen, "sync", handle)
    gen.sync_weights = handle.sync  # an instance attribute: detach() deletes it and TRL's method is back
    add = getattr(trainer, "add_callback", None)
    if callable(add):  # TRL syncs before it generates, so the last step's weights would wait for the next rollout
        add(handle._callback)
    return handle


@contextlib.contextmanager
def lora_engine(max_lora_rank: int = 16, **engine_kwargs: Any) -> Iterator[None]:
    """Inside it, the ``vllm.LLM`` a TRL trainer builds for colocate mode starts with ``enable_lora=True`` and
    ``max_lora_rank`` (plus ``engine_kwargs``), so that :func:`attach` syncs a PEFT model's adapter alone. TRL 1.16
    has no option for it; this replaces ``trl.generation.vllm_generation.LLM`` while the trainer is built.

    Example:
        >>> with hotweights.integrations.trl.lora_engine(max_lora_rank=16):  # doctest: +SKIP
        ...     trainer = GRPOTrainer(model=..., peft_config=LoraConfig(r=16, ...), args=GRPOConfig(use_vllm=True))
        >>> sync = hotweights.integrations.trl.attach(trainer)            # doctest: +SKIP
    """
    import importlib

    vg: Any = importlib.import_module("trl.generation.vllm_generation")
    build = vg.LLM

    def with_lora(*args: Any, **kwargs: Any) -> Any:
        return build(*args, **{**kwargs, "enable_lora": True, "max_lora_rank": max_lora_rank, **engine_kwargs})

    vg.LLM = with_lora
    try:
        yield
    finally:
        vg.LLM = build


def _adapter_only(gen: Any, target: Any, lora: bool | None) -> bool:
    """Whether syncs send the adapter alone (see :func:`attach`'s ``lora``)."""
    from accelerate.utils import is_peft_model

    if lora is False:
        return False
    dist = getattr(gen, "_dist", None)
    why = []
    model = getattr(gen, "model", None)
    if model is None or not is_peft_model(model):
        why.append("the model is not a PEFT model")
    if gen.mode != "colocate":
        why.append("TRL's server mode (adapter-only syncs need the colocated engine)")
    elif target is not None and as_engine(target).lora.max_rank() is None:
        why.append(
            "the engine was started without LoRA (build the trainer inside "
            "hotweights.integrations.trl.lora_engine(max_lora_rank=r))"
        )
    if getattr(gen, "enable_sleep_mode", False):
        why.append("sleep mode discards the base weights, which an adapter-only sync never sends")
    if getattr(dist, "is_zero3", False) or getattr(dist, "is_fsdp", False):
        why.append("ZeRO-3/FSDP shard the adapter")
    if why and lora:
        raise EngineNotSupportedError(
            f"an adapter-only sync is not possible here: {'; '.join(why)}. Pass lora=False to sync the merged model."
        )
    return not why


def _with_adapter(llm: Any, generate: Any) -> Any:
    """``llm.generate`` that uses the synced adapter unless the call passes its own ``lora_request``."""

    @functools.wraps(generate)
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("lora_request") is None:
            with contextlib.suppress(HotWeightsError):  # before the first sync: the base model
                kwargs["lora_request"] = lora_request(llm, LORA_NAME)
        return generate(*args, **kwargs)

    return run


class _SyncAtTrainEnd:
    """A ``transformers.TrainerCallback`` (duck-typed: every hook the trainer calls is a no-op but ``on_train_end``)
    that installs the last step's weights when training ends, so the engine serves what the trainer holds: TRL
    itself syncs only before it generates, which leaves the engine one step behind after ``trainer.train()``."""

    def __init__(self, handle: TRLWeightSync) -> None:
        self.handle = handle

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        last = self.handle.last_report
        behind = last is None or last.weight_version != int(state.global_step)
        if self.handle._attached and behind:  # every rank takes part in the gather, as in TRL's own sync
            self.handle.generation.sync_weights()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return _no_op
        raise AttributeError(name)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _gathered_views(gen: Any) -> bool:
    """Whether the tensors TRL yields stop being valid once its gather ends (ZeRO-3, FSDP1, PEFT merge)."""
    from accelerate.utils import is_peft_model

    dist = getattr(gen, "_dist", None)
    return bool(
        is_peft_model(gen.model) or getattr(dist, "is_zero3", False) or getattr(dist, "fsdp_version", None) == 1
    )


def _remote_dtype(client: Any) -> torch.dtype | None:
    """The dtype a ``hotweights.connect`` client serves: its ``dtype``, else the one dtype of the floating tensors
    its ``expected_weights()`` lists; None when it tells neither (tensors then travel as they are)."""
    dtype = getattr(client, "dtype", None)
    if dtype is None and callable(getattr(client, "expected_weights", None)):
        expected = client.expected_weights()
        found = {spec.torch_dtype for spec in expected.tensors.values()} if expected is not None else set()
        floating = {d for d in found if d.is_floating_point}
        dtype = floating.pop() if len(floating) == 1 else None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _empty_device_cache() -> None:
    from trl.generation.vllm_generation import empty_cache

    empty_cache()
