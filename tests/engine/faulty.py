"""A worker extension that plants a fault in the engine's own reload (tests only): what the family guard must catch
in an engine whose workers run in another process (an ``AsyncLLM``, a server, a Ray actor).

The fault is read from the file named by ``$HOTWEIGHTS_TEST_FAULT_FILE`` at every reload (empty: none), so one
engine takes several in turn:

- ``stale <part>``: tensors whose name holds ``<part>`` are not loaded (that layer keeps its old weights; vLLM's
  reload only: the direct setter's plan needs every tensor);
- ``scale <part> <factor>``: they are loaded multiplied by ``<factor>`` (a norm scaled by 1.01);
- ``swap <a> <b>``: experts ``a`` and ``b`` are loaded in each other's place (fused 3-D expert tensors: along dim 0);
- ``delay <seconds>``: every forward of the model sleeps that long first (a request that decodes slowly enough to be
  in flight whenever an install comes), beside one of the above after a ``;``: ``delay 0.05; scale norm 1.01``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hotweights.vllm.worker.extension import HotWeightsWorkerExtension

FAULT_FILE = "HOTWEIGHTS_TEST_FAULT_FILE"
EXTENSION = "tests.engine.faulty.FaultyExtension"


def plant(path: Path, fault: str) -> None:
    """Plant ``fault`` (see the module docstring; "" for none) in the engines reading ``path``."""
    path.write_text(fault)


#: The fault of this process, where it is set here rather than in the file (:func:`set_fault`).
_FAULT: list[str] | None = None


def set_fault(fault: str) -> None:
    """Plant ``fault`` in this process's engines (an in-process engine; "" for none)."""
    global _FAULT
    _FAULT = fault.split()


def _faults() -> list[list[str]]:
    if _FAULT is not None:
        return [_FAULT] if _FAULT else []
    name = os.environ.get(FAULT_FILE)
    text = Path(name).read_text() if name and Path(name).exists() else ""
    return [words for part in text.split(";") if (words := part.split())]


def _fault() -> list[str]:
    """The planted fault of the reload (the first that is not a ``delay``)."""
    return next((f for f in _faults() if f[0] != "delay"), [])


def _delay(module: Any, args: Any) -> None:
    for fault in _faults():
        if fault[0] == "delay":
            time.sleep(float(fault[1]))


def install_faults(model: Any) -> None:
    """From now on ``model``'s reload and hotweights' direct setter in this process apply the planted fault."""
    from hotweights.vllm.worker import setter

    if not getattr(model, "_faulty", False):
        load = model.load_weights

        def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *a: Any, **k: Any) -> Any:
            return load(faulty(weights, _fault()), *a, **k)

        model.load_weights, model._faulty = load_weights, True
        model.register_forward_pre_hook(_delay)
    if not getattr(setter, "_faulty", False):
        apply = setter.apply_direct

        def apply_direct(model: Any, plan: Any, tensors: Any, **kwargs: Any) -> int:
            return apply(model, plan, dict(faulty(tensors.items(), _fault())), **kwargs)

        setter.apply_direct, setter._faulty = apply_direct, True  # type: ignore[attr-defined]


#: The row counts of this process's eager logprob rankings, after :func:`count_eager_ranks`.
_EAGER_CALLS: list[int] = []


def count_eager_ranks() -> None:
    """From now on this process counts its eager logprob rankings (the family probe's) in :data:`_EAGER_CALLS`."""
    from hotweights.vllm import patches

    if getattr(patches, "_faulty", False):
        return
    eager = patches._count_at_least

    def counted(x: Any, values: Any) -> Any:
        _EAGER_CALLS.append(int(x.shape[0]))
        return eager(x, values)

    patches._count_at_least, patches._faulty = counted, True  # type: ignore[attr-defined]


def faulty(weights: Iterable[tuple[str, torch.Tensor]], fault: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with ``fault`` applied."""
    kind, args = (fault[0], fault[1:]) if fault else ("", [])
    for name, tensor in weights:
        if kind == "stale" and args[0] in name:
            continue
        if kind == "scale" and args[0] in name:
            tensor = tensor * float(args[1])
        if kind == "swap" and "experts" in name:
            a, b = args
            if f"experts.{a}." in name:
                name = name.replace(f"experts.{a}.", f"experts.{b}.")
            elif f"experts.{b}." in name:
                name = name.replace(f"experts.{b}.", f"experts.{a}.")
            elif tensor.dim() == 3:
                order = list(range(tensor.shape[0]))
                order[int(a)], order[int(b)] = int(b), int(a)
                tensor = tensor[order]
        yield name, tensor


class FaultyExtension(HotWeightsWorkerExtension):
    """hotweights' worker extension, and ``faulty_plant`` (``collective_rpc("faulty_plant")``): from then on the
    model's ``load_weights`` applies the planted fault. Another class name than hotweights' own, but a subclass of it:
    installs into this engine take the install session through the extension, as into one started with hotweights'
    own."""

    def faulty_plant(self) -> None:
        install_faults(self.model_runner.model)  # type: ignore[attr-defined]
        count_eager_ranks()

    def faulty_ranks(self) -> dict[str, Any]:
        """How many times this worker ranked logprobs eagerly (:func:`count_eager_ranks`), and whether vLLM's own
        ranking is in place now."""
        from vllm.v1.sample import sampler
        from vllm.v1.sample.ops import logprobs

        restored = sampler.batched_count_greater_than is logprobs.batched_count_greater_than
        return {"eager_calls": len(_EAGER_CALLS), "restored": restored}

    def hotweights_engine(self, op: str, args_json: str = "{}") -> Any:
        """hotweights' own, after :meth:`faulty_plant` (a server's guard lets only hotweights' methods through); and
        ``"faulty_ranks"``: :meth:`faulty_ranks`, reached through a server's guard."""
        self.faulty_plant()
        if op == "faulty_ranks":
            return self.faulty_ranks()
        return super().hotweights_engine(op, args_json)
