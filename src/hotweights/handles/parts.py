"""The small parts a handle holds besides its workers: what the engine says of its pause and sleep
(:class:`Pausing`), its LoRA adapters (:class:`LoraOps`) and the model it serves as the family guard reads it
(:class:`ServedModel`). Each default here is what an engine kind that offers nothing more answers, so a test double
of a handle sets none of them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.manifest import ExpectedWeights
from hotweights.handles.pause import PauseOwner
from hotweights.handles.workers import STATUS_TIMEOUT, NoWorkers, Workers

__all__ = ["LoraOps", "Pausing", "ServedModel"]

log = logging.getLogger("hotweights")


class PartOwner(Protocol):
    """What a handle's parts ask of the handle that builds them: its workers, pause mode and versions."""

    @property
    def workers(self) -> Workers: ...
    @property
    def pause_mode(self) -> str: ...

    def expected_weights(self) -> ExpectedWeights | None: ...
    def get_weight_version(self) -> str | None: ...


class Pausing:
    """What an engine says of its own pause and sleep, and the record of which install paused it (kept by the
    workers' extension: see :mod:`hotweights.handles.pause`)."""

    def __init__(self, workers: Workers | None = None) -> None:
        self.workers = workers or NoWorkers()

    def weights_asleep(self) -> bool:
        """True while the engine's weights are asleep (offloaded or discarded): they must not be written. A paused
        scheduler alone is not sleep."""
        return False

    def scheduler_paused(self) -> bool | None:
        """Whether the engine's scheduler is paused, by anyone; None where it cannot be told."""
        return None

    def owner(self, action: str = "read", owner: PauseOwner | None = None) -> PauseOwner | None:
        """The hotweights install recorded as holding the engine's pause (None: none, or no worker extension to
        keep the record); ``action="claim"`` records ``owner``, ``"release"`` clears it (both return the record
        they replaced)."""
        if not self.workers.extension:
            return None
        try:
            if action == "read":
                status = self.workers.status()
                text = str(status.get("pause_owner", "")) if status else ""
            else:
                args = json.dumps({"action": action, "owner": owner.to_json() if owner else ""})
                text = str(self.workers.call("hotweights_engine", "pause", args, timeout=STATUS_TIMEOUT)[0])
        except Exception:  # e.g. a server running an older hotweights: no record is kept there
            log.debug("hotweights: the pause record could not be %s", action, exc_info=True)
            return None
        return PauseOwner.from_json(text)


class LoraOps:
    """The engine's LoRA adapters: vLLM's ``add_lora``/``remove_lora`` where it was started with ``enable_lora``;
    none here."""

    def max_rank(self) -> int | None:
        """The largest LoRA rank the engine takes; None where it was started without LoRA (``enable_lora``)."""
        return None

    def load_adapter(self, name: str, lora_id: int, path: str) -> None:
        """Load the LoRA adapter saved in ``path`` as ``name`` (id ``lora_id``), replacing the one of that id: vLLM
        loads the new one first and keeps the old one if that fails."""
        raise EngineNotSupportedError("hotweights cannot install LoRA adapters into this engine")

    def unload_adapter(self, lora_id: int) -> None:
        """Unload the LoRA adapter of id ``lora_id`` (one hotweights loaded)."""
        raise EngineNotSupportedError("hotweights cannot remove LoRA adapters from this engine")


class ServedModel:
    """The model an engine serves, as the family guard reads it (:mod:`hotweights._family`): its config, dtype,
    family, the mends of vLLM's reload in place, and its scores of a prompt inside an install.

    Args:
        workers: asked for what cannot be read from here (through the worker extension).
        expected: what the engine accepts (its architectures name the family where nothing else can).
    """

    #: Whether :meth:`prompt_logprobs` can score the engine while an install holds its gate.
    probes: bool = False

    def __init__(
        self, workers: Workers | None = None, expected: Callable[[], ExpectedWeights | None] = lambda: None
    ) -> None:
        self.workers = workers or NoWorkers()
        self.expected = expected

    def config(self) -> Any:
        """The transformers config of the engine's model, or None where it cannot be read from here."""
        return None

    def dtype(self) -> torch.dtype:
        """The dtype the engine keeps its weights in (``torch.float32`` where it cannot be read)."""
        return torch.float32

    def vllm_fixes(self) -> tuple[str, ...] | None:
        """The mends of vLLM's reload (:data:`~hotweights.vllm.fixes.VLLM_FIXES`) in place where the engine's
        workers run: asked of the workers through the worker extension; else, where hotweights' vLLM plugin reaches
        the engine's processes, the ones this environment applies; ``()`` where the plugin is kept out
        (``VLLM_PLUGINS``); None where it cannot be told from here."""
        from hotweights.vllm.fixes import apply_vllm_fixes, vllm_fixes_reach_workers

        if self.workers.extension:
            answers = self.workers.call("hotweights_engine", "status", "{}", timeout=STATUS_TIMEOUT)
            fixes = answers[0].get("fixes") if answers and isinstance(answers[0], dict) else None
            if isinstance(fixes, list):
                return tuple(str(f) for f in fixes)
        if self.config() is None:
            return None
        return apply_vllm_fixes() if vllm_fixes_reach_workers() else ()

    def family(self) -> tuple[str | None, str, str]:
        """``(architecture, vLLM version, device kind)`` of the engine, as far as they can be read from here: from
        the engine's own config in this process, else from the workers (worker extension); ``None``/``""`` where
        unknown."""
        from hotweights.vllm import compat

        config = self.config()
        if config is not None:
            names = getattr(config, "architectures", None) or [None]
            return names[0], compat.vllm_version(), compat.device_kind()
        if self.workers.extension:  # an engine that cannot be reached raises here, as it should
            answers = self.workers.call("hotweights_engine", "status", "{}", timeout=STATUS_TIMEOUT)
            status = answers[0] if answers and isinstance(answers[0], dict) else {}
            if status.get("architecture"):
                return str(status["architecture"]), str(status.get("vllm", "")), str(status.get("device", ""))
        names = list(getattr(self.expected(), "architectures", None) or []) or [None]
        return names[0], "", ""

    def prompt_logprobs(self, token_ids: Sequence[int], label: str | None = None) -> list[float | None] | None:
        """The engine's log-probability of each of ``token_ids[1:]`` after the tokens before it, computed while the
        calling thread holds the gate (an install's own check); None where this engine kind cannot be asked so.
        ``label``: the version being installed, which requests in flight that decode while the probe runs (an
        ``AsyncLLM`` or a server under ``keep`` or ``recompute``) carry."""
        return None
