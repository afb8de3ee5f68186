"""verl's tensors copied straight into each parameter's next storage, so that the commit swaps storage instead of
copying the update a second time (a CPU worker's direct install; :mod:`hotweights.integrations.verl_update`).

Atomic as any staged install: the next storage is memory the model does not use, written while the previous weights
serve, and staged into the install session like any bucket (so every tensor is checked, NaN and Inf included). At
the commit, after every check passed, each parameter is pointed at its next storage (``param.data``: the same
``Parameter``, so whatever holds the parameter, a tied head included, sees it); the direct setter's copies then find
every tensor in place, and it re-processes the layers that derive state from their weight as always. The storage
each parameter leaves is the next sync's, up to :data:`~hotweights.integrations.verl_update.REUSE_BUDGET` in all.

Only where nothing keeps a parameter's address: a CPU worker whose model runs eagerly (CUDA graphs and compiled
graphs may capture addresses; a GPU's copies are fast anyway). A parameter is copied at the commit as before when its
tensors do not fill whole rows of it (tensor parallelism), when it is in another dtype than the update's tensor, or
when it shares its storage or its tensors with another parameter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from hotweights.core import attach
from hotweights.core.manifest import TensorSpec

__all__ = ["NextParams"]


@dataclass
class _Param:
    """One parameter of the model and its next storage."""

    key: str
    module: torch.nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    gaps: tuple[tuple[int, int], ...]
    """Rows no tensor of the update writes (a vocabulary's padding): taken from the live parameter at the swap."""
    storage: torch.Tensor | None = None

    def flat(self) -> torch.Tensor:
        assert self.storage is not None
        return self.storage.view(-1).view(torch.uint8)


class NextParams:
    """Where each checkpoint tensor of one update goes: rows of its parameter's next storage."""

    def __init__(self, worker: Any, rows: dict[str, tuple[_Param, int]]) -> None:
        self.worker = worker
        self.rows = rows
        self.params = list({id(p): p for p, _ in rows.values()}.values())
        self.left: list[tuple[_Param, torch.Tensor]] = []
        """The storage each parameter left at the swap."""

    @classmethod
    def of(cls, worker: Any, session: Any, specs: Mapping[str, TensorSpec]) -> NextParams | None:
        """The next storages of the direct install ``session`` opened (an ``InstallSession``), or None where the
        update is packed instead (see the module's docstring)."""
        plan = getattr(session, "direct_plan", None)
        if getattr(session, "method", None) != "direct" or plan is None or not _swappable(worker):
            return None
        from hotweights.vllm.worker.runner import worker_model

        modules = _modules(worker_model(worker))
        groups = [(g, modules.get(g.module_name)) for g in plan.by_param()]
        params = Counter(id(getattr(m, g.attr, None)) for g, m in groups)
        names = Counter(name for g, _ in groups for name, *_ in g.copies)
        rows: dict[str, tuple[_Param, int]] = {}
        for group, module in groups:
            found = _rows_of(group, module, specs)
            shared = params[id(getattr(module, group.attr, None))] > 1 or any(names[n] > 1 for n in found or ())
            if found is not None and not shared:  # one parameter, its own tensors: else copied at the commit
                rows.update(found)
        return cls(worker, rows) if rows else None

    def place(self, name: str, tensor: torch.Tensor) -> tuple[_Param, torch.Tensor]:
        """Copy ``tensor`` (cast to the parameter's dtype) into its rows of its parameter's next storage; returns
        the parameter and those rows."""
        p, start = self.rows[name]
        if p.storage is None:
            kept: dict[str, torch.Tensor] = attach.value(self.worker, "verl_next", dict)
            found = kept.pop(p.key, None)
            fits = found is not None and tuple(found.shape) == p.shape and found.dtype == p.dtype
            p.storage = found if fits and found is not None else torch.empty(p.shape, dtype=p.dtype)
        rows = p.storage if tensor.dim() == 0 else p.storage.narrow(0, start, tensor.shape[0])
        rows.copy_(tensor)
        return p, rows

    @torch.no_grad()
    def swap(self) -> Callable[[], None]:
        """Point every parameter at its next storage; returns what puts the previous storages back."""
        self.left = []
        for p in self.params:
            assert p.storage is not None, f"{p.key} received nothing"
            live = getattr(p.module, p.attr).data
            for start, stop in p.gaps:
                p.storage[start:stop].copy_(live[start:stop])
            getattr(p.module, p.attr).data = p.storage
            self.left.append((p, live))

        def undo() -> None:
            for p, live in self.left:
                getattr(p.module, p.attr).data = live
            self.left = []

        return undo

    def release(self, budget: int) -> None:
        """An update that was not installed: its next storages are the next sync's, up to ``budget`` bytes."""
        _keep(self.worker, [(p, p.storage) for p in self.params if p.storage is not None], budget)
        for p in self.params:
            p.storage = None

    def keep(self, budget: int) -> None:
        """After the swap: the storages the parameters left are the next sync's, up to ``budget`` bytes in all."""
        _keep(self.worker, self.left, budget)
        self.left = []


def _keep(worker: Any, storages: Iterable[tuple[_Param, torch.Tensor]], budget: int) -> None:
    kept: dict[str, torch.Tensor] = attach.value(worker, "verl_next", dict)
    kept.clear()
    total = 0
    for p, storage in storages:
        if storage.numel() and total + storage.nbytes <= budget:
            kept[p.key] = storage
            total += storage.nbytes


def _rows_of(
    group: Any, module: torch.nn.Module | None, specs: Mapping[str, TensorSpec]
) -> dict[str, tuple[_Param, int]] | None:
    """Where each checkpoint tensor of one parameter's copies (a ``DirectPlan.by_param()`` group) goes in its next
    storage: ``name -> (parameter, first row)``; None when the parameter is copied at the commit instead: a part of
    a tensor (tensor parallelism) or columns, a parameter in another dtype than the update's tensor (vLLM on CPU
    keeps biases in float32: the tensor is rounded to the engine's dtype first, as a fresh load does), or rows no
    tensor writes in a parameter vLLM re-packed (they cannot be read)."""
    param = getattr(module, group.attr, None)
    shape = tuple(group.rank_shape)
    if module is None or not isinstance(param, torch.Tensor) or not shape or param.device.type != "cpu":
        return None
    p = _Param(f"{group.module_name}.{group.attr}", module, group.attr, shape, param.dtype, ())
    rows: dict[str, tuple[_Param, int]] = {}
    covered = []
    for name, covers, (dim, dst_start, src_start, length) in group.copies:
        spec = specs.get(name)
        if spec is None or spec.torch_dtype != param.dtype:
            return None
        if covers and tuple(spec.shape) == shape:
            rows[name] = (p, 0)
            covered.append((0, shape[0]))
        elif dim == 0 and src_start == 0 and spec.shape and length == spec.shape[0]:
            rows[name] = (p, dst_start)
            covered.append((dst_start, dst_start + length))
        else:
            return None
    p.gaps = _gaps(covered, shape[0])
    return None if p.gaps and param.numel() == 0 else rows


def _swappable(worker: Any) -> bool:
    """A CPU worker whose model runs without a compiled graph (nothing holds a parameter's address)."""
    config = getattr(worker, "vllm_config", None)
    device = getattr(getattr(config, "device_config", None), "device_type", None)
    mode = getattr(getattr(config, "compilation_config", None), "mode", None)
    return device == "cpu" and mode is not None and int(mode) == 0


def _gaps(covered: list[tuple[int, int]], rows: int) -> tuple[tuple[int, int], ...]:
    gaps, at = [], 0
    for start, stop in sorted(covered):
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    if at < rows:
        gaps.append((at, rows))
    return tuple(gaps)


_MODULES: WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = WeakKeyDictionary()


def _modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name -> submodule, made once per model (an install replaces parameters, never modules)."""
    found = _MODULES.get(model)
    if found is None:
        found = _MODULES[model] = dict(model.named_modules())
    return found
