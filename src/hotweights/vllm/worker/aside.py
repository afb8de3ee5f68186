"""Installs built aside: vLLM's layerwise reload into a twin of the model while the engine serves on the old
weights; the commit swaps the twin's layers in.

``install_method="aside"`` (an atomic commit). Each bucket, as it is staged, goes into a *twin* of the model: every
module copied shallowly, with its own parameter, buffer and child tables, so vLLM's layerwise reload can put the
twin's tensors on ``meta``, load the new weights and run each layer's post-load processing (on CPU, the re-packing
into oneDNN's layout) without touching a live module. ``prepare`` finishes the layers vLLM processes last and
re-ties shared weights (a tied LM head) inside the twin. ``commit`` then moves each processed layer's derived
attributes (a packed handle, a quant method's state) into the live module, and its tensors: one whose shape, dtype
and device did not change keeps its identity and takes the new values (a copy, as vLLM's own reload makes, so a
kernel that holds it sees them), any other is replaced. Nothing is loaded or processed while generation is held.

Cost: the engine holds the new weights, processed, beside the old ones from the first bucket until the commit
(about one more copy of the model). ``abort`` drops the twin; the live model was never touched.

CPU only: on an accelerator, CUDA graphs hold the parameters' addresses, so new tensors cannot be swapped in (a
GPU commit copies into them, which is what vLLM's own reload does; use ``reload``). Layers whose attention scales
the update changes are refused before the commit (vLLM reloads them in place only).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MethodType
from typing import Any

import torch

from hotweights.vllm.fixes import apply_vllm_fixes
from hotweights.vllm.worker import ops as worker_ops
from hotweights.vllm.worker.runner import mark_weight_update

__all__ = ["AsideStream", "Twin"]

#: A module's tensor tables (swapped for processed layers only) and its tree.
_TABLES = frozenset({"_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"})


class Twin:
    """A shallow twin of ``model``'s module tree: each module copied with its own ``_parameters``, ``_buffers``,
    ``_modules`` and quant method, sharing every tensor with its live module until vLLM's reload replaces them
    in the twin. ``pairs`` lists ``(live, twin)`` for every module (a module reached twice is copied once)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        self._method_type = QuantizeMethodBase
        self.twin_of: dict[int, torch.nn.Module] = {}
        self.live_of: dict[int, torch.nn.Module] = {}
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.initial: dict[int, dict[str, Any]] = {}  # id(twin) -> its attributes as copied
        self.clones: set[int] = set()  # ids of the tensors copied for the twin before its reload (_own_tensors)
        self.root = self._copy(model)

    def touched(self, copied: torch.nn.Module) -> bool:
        """Whether processing changed ``copied``'s own attributes (a quant method that is a module of its own
        keeps its kernel and quant config there), apart from its tensors."""
        before = self.initial[id(copied)]
        now = copied.__dict__
        keys = (before.keys() | now.keys()) - _TABLES
        return any(k not in before or k not in now or before[k] is not now[k] for k in keys)

    def _copy(self, module: torch.nn.Module) -> torch.nn.Module:
        found = self.twin_of.get(id(module))
        if found is not None:
            return found
        twin = module.__class__.__new__(module.__class__)
        state = dict(module.__dict__)
        state["_parameters"] = dict(module._parameters)
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        children: dict[str, Any] = {}
        state["_modules"] = children
        for key, value in state.items():
            if isinstance(value, self._method_type):  # post-load processing may keep state on the method itself
                state[key] = copy.copy(value)
        object.__setattr__(twin, "__dict__", state)
        self.initial[id(twin)] = dict(state)
        self.twin_of[id(module)] = twin
        self.live_of[id(twin)] = module
        self.pairs.append((module, twin))
        for name, child in module._modules.items():
            children[name] = None if child is None else self._copy(child)
        return twin

    def drop(self) -> None:
        """Forget the twin: its records in vLLM's reload table go too (their loaders are bound to the twin's
        modules, so the table's weak keys would never be released), with every reference this object holds."""
        from vllm.model_executor.model_loader.reload import layerwise

        for _, copied in self.pairs:
            layerwise.LAYERWISE_INFO.pop(copied, None)
        self.pairs.clear()
        self.initial.clear()
        self.clones.clear()
        self.twin_of.clear()
        self.live_of.clear()

    def live(self, value: Any) -> Any:
        """``value`` as the live model sees it: a twin module is its live module, a method bound to one is bound
        to the live module instead."""
        if isinstance(value, torch.nn.Module):
            return self.live_of.get(id(value), value)
        if isinstance(value, MethodType) and id(value.__self__) in self.live_of:
            return value.__func__.__get__(self.live_of[id(value.__self__)])
        return value


class AsideStream:
    """A :class:`~hotweights.vllm.worker.streaming.Stream` into a twin of ``worker``'s model: ``feed`` loads each
    bucket into it, ``prepare`` finishes it, ``finish`` swaps its processed layers into the live model."""

    #: An atomic session whose tensors go into the stream as they are staged (by reference too).
    builds_aside = True

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.model = worker_ops.worker_model(worker)
        device = next((p.device for p in self.model.parameters() if not p.is_meta), torch.device("cpu"))
        if device.type != "cpu":
            raise ValueError(
                f"install_method='aside' swaps new tensors into the model, which CUDA graphs on {device.type} do not "
                "see; nothing was written. Use install_method='reload' (or 'auto') on this engine."
            )
        self.twin: Twin | None = None
        self.changed: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.touched: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.retied = 0
        self.aliases: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        self.prepared = False

    @torch.no_grad()
    def feed(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        if self.twin is None:
            apply_vllm_fixes()  # MoE experts re-packed as their layers complete
            twin = Twin(self.model)
            try:
                for live, copied in twin.pairs:
                    _give_reload_info(layerwise, live, copied, twin)
                    _own_tensors(twin, live, copied)  # what vLLM loads in place (biases) is the twin's own copy
                layerwise.initialize_layerwise_reload(twin.root)
                for live, copied in twin.pairs:
                    # processed layers keep their new tensors: never copied into the live ones
                    layerwise.get_layerwise_info(copied).kernel_tensors = None
                    _refuse_shared(live, copied)
            except BaseException:
                twin.drop()
                raise
            self.twin = twin
        marked = mark_weight_update(True)
        try:
            self.twin.root.load_weights(iter(tensors.items()))  # type: ignore[operator]
        finally:
            if marked:
                mark_weight_update(False)

    @torch.no_grad()
    def prepare(self) -> None:
        """Process the layers vLLM processes last (partly loaded ones); tie shared weights inside the twin; refuse
        an update of attention scales. Nothing live is touched."""
        if self.prepared or self.twin is None:
            return
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import layerwise

        changed: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        refused: list[str] = []
        for live, twin in self.twin.pairs:
            info = layerwise.get_layerwise_info(twin)
            if not info.can_load():  # processed while loading
                changed.append((live, twin))
            elif info.load_numel > 0:
                if is_deferred_attention_layer(twin):
                    refused.append(type(live).__name__)
                else:  # partly loaded (e.g. padding it never receives): processed now, as vLLM's finalize does
                    layerwise._layerwise_process(twin, info)
                    changed.append((live, twin))
            info.reset()  # type: ignore[no-untyped-call]
        if refused:
            raise ValueError(
                f"install_method='aside' cannot rebuild attention scales ({sorted(set(refused))}): vLLM reloads them "
                "in the live layer only; nothing was written. Use install_method='reload'."
            )
        root = self.twin.root  # as vLLM's finalize leaves the model
        if hasattr(root, "_original_do_torchao_reload"):
            root._do_torchao_reload = root._original_do_torchao_reload
        retied = _retie(self.twin, changed)
        self.changed, self.retied = changed + retied, len(retied)
        swapped = {id(live) for live, _ in self.changed}
        self.touched = [
            (live, twin) for live, twin in self.twin.pairs if id(live) not in swapped and self.twin.touched(twin)
        ]
        self.aliases = _aliases(self.twin, self.changed, {id(live) for live, _ in self.touched})
        self.prepared = True

    def finish(self) -> int:
        """Swap every processed layer into the live model; returns the tied layers rebuilt."""
        self.prepare()
        twin = self.twin
        if twin is None:
            return 0
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for live, copied in self.changed:
            copies += _swap(twin, live, copied)
        for live, copied in self.touched:
            _swap(twin, live, copied, tensors=False)
        _copy_values(twin, copies)
        for holder, key, tensor in self.aliases:  # other modules' references to a replaced tensor follow it
            holder[key] = tensor
        self.twin, self.changed, self.touched, self.aliases = None, [], [], []
        twin.drop()
        worker_ops.after_weights_changed(self.worker)
        return self.retied

    def abort(self) -> None:
        twin, self.twin, self.changed, self.touched, self.aliases = self.twin, None, [], [], []
        if twin is not None:  # the live model was never touched
            twin.drop()


def _give_reload_info(layerwise: Any, live: torch.nn.Module, twin_module: torch.nn.Module, twin: Twin) -> None:
    """The twin's copy of what vLLM recorded to reload ``live`` (its tensors' shapes and loaders, on ``meta``),
    with the loaders bound to the twin's module."""
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    info = layerwise.get_layerwise_info(live)

    def rebound(tensor: torch.Tensor) -> torch.Tensor:
        meta = to_meta_tensor(tensor)
        for key, value in meta.__dict__.items():  # a reload of the live model leaves its buffering loader here
            value = _bound_to(value, live, twin_module)
            if isinstance(value, MethodType) and value.__self__ is layer_ref_sentinel:
                value = value.__func__.__get__(twin_module)
            meta.__dict__[key] = value
        return meta

    params, buffers = info.restore_metadata
    copied = layerwise.get_layerwise_info(twin_module)
    copied.restore_metadata = ({n: rebound(t) for n, t in params.items()}, {n: rebound(t) for n, t in buffers.items()})
    copied.restore_device = info.restore_device


def _own_tensors(twin: Twin, live: torch.nn.Module, copied: torch.nn.Module) -> None:
    """Give the twin its own copy of the tensors vLLM's reload never moves to ``meta`` (``SKIP_TENSORS``: biases
    and tensors it never loads), before the reload wraps their loaders: vLLM loads those in place. The copies are
    recorded in ``twin.clones``."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    for table in ("_parameters", "_buffers"):
        shared = copied.__dict__[table]
        for name, tensor in list(shared.items()):
            if tensor is None or tensor.is_meta or name not in SKIP_TENSORS:
                continue
            own = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            own.copy_(tensor)
            own.__class__ = tensor.__class__
            own.__dict__ = {k: _bound_to(v, live, copied) for k, v in tensor.__dict__.items()}
            shared[name] = own
            twin.clones.add(id(own))


def _refuse_shared(live: torch.nn.Module, copied: torch.nn.Module) -> None:
    """After vLLM put the twin's tensors on ``meta``: none may still be a live tensor (a load would write into the
    model that serves)."""
    for table in ("_parameters", "_buffers"):
        original = live.__dict__[table]
        for name, tensor in copied.__dict__[table].items():
            if tensor is not None and not tensor.is_meta and tensor is original.get(name):
                raise ValueError(
                    f"install_method='aside': vLLM would load {type(live).__name__}.{name} in place, into the live "
                    "model; nothing was written. Use install_method='reload' for this model."
                )


def _bound_to(value: Any, live: torch.nn.Module, copied: torch.nn.Module) -> Any:
    """A tensor attribute of ``live``'s, for the twin: a loader without the buffering wrapper a reload of the live
    model may have left on it, bound to the twin's module."""
    while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
        value = value.__wrapped__
    if isinstance(value, MethodType) and value.__self__ is live:
        return value.__func__.__get__(copied)
    return value


def _retie(twin: Twin, changed: list[tuple[torch.nn.Module, torch.nn.Module]]) -> list[tuple[Any, Any]]:
    """Weights the live model shares between modules (a tied LM head borrows the embedding's) are shared in the
    twin too: a module that borrows a processed module's weight gets the new one and is re-processed (its packed
    copy rebuilt from it). Returns the borrowers re-processed."""
    processed = {id(live) for live, _ in changed}
    owners: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
    retied: list[tuple[Any, Any]] = []
    for live, copied in twin.pairs:
        for name, tensor in live._parameters.items():
            if tensor is None:
                continue
            owner = owners.setdefault(id(tensor), (live, copied))
            if owner[0] is live or id(owner[0]) not in processed or id(live) in processed:
                continue
            new = owner[1]._parameters.get(name)
            if new is None or new.is_meta:
                continue
            copied._parameters[name] = new
            method = getattr(copied, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(copied)
            retied.append((live, copied))
    return retied


def _aliases(
    twin: Twin, changed: list[tuple[Any, Any]], rewritten: set[int]
) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Where the live model keeps a reference to a tensor the swap replaces, outside the swapped tables and the
    attributes of ``rewritten`` modules (vLLM's reload copies into the old tensors, so references stay valid there;
    a swap must move them): ``(table, key, new tensor)`` for each. A view of a replaced tensor, or one held in a
    container, cannot follow: refused (``ValueError``), nothing written."""
    replaced: dict[int, torch.Tensor] = {}
    storages: dict[int, str] = {}
    swapped = {id(live) for live, _ in changed}
    for live, copied in changed:
        for table in ("_parameters", "_buffers"):
            for name, old in live.__dict__[table].items():
                new = copied.__dict__[table].get(name)
                if old is None or new is None or new is old or _same_layout(old, new):
                    continue  # kept, its values copied: references to it stay valid
                replaced[id(old)] = new
                if old.nbytes and not old.is_meta:
                    storages[old.untyped_storage().data_ptr()] = f"{type(live).__name__}.{name}"
    found: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    refused: list[str] = []
    for live, _ in twin.pairs:
        if id(live) in swapped:
            continue
        own = [] if id(live) in rewritten else [k for k in live.__dict__ if k not in _TABLES]  # those: the twin's
        places = [(live.__dict__, k) for k in own]
        places += [(live.__dict__[t], k) for t in ("_parameters", "_buffers") for k in live.__dict__[t]]
        for holder, key in places:
            value = holder[key]
            if isinstance(value, torch.Tensor) and id(value) in replaced:
                found.append((holder, key, replaced[id(value)]))
                continue
            for tensor in _tensors_in(value):
                if tensor.nbytes and not tensor.is_meta and tensor.untyped_storage().data_ptr() in storages:
                    refused.append(
                        f"{type(live).__name__}.{key} (shares {storages[tensor.untyped_storage().data_ptr()]})"
                    )
    if refused:
        raise ValueError(
            f"install_method='aside' cannot follow references to the weights it replaces: {sorted(set(refused))[:3]}; "
            "nothing was written. Use install_method='reload' for this model."
        )
    return found


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors ``value`` is or holds one level down (a list, tuple or dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []


def _swap(
    twin: Twin, live: torch.nn.Module, copied: torch.nn.Module, *, tensors: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give ``live`` the twin's derived attributes and, with ``tensors`` (a processed layer), its tensors; in place:
    the live module object stays the one the engine's forward context and compiled code know. A live tensor of the
    same layout as its new one is kept: ``(live tensor, new tensor)`` is returned for :func:`_copy_values`."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    state = live.__dict__
    for key in [k for k in state if k not in copied.__dict__ and k not in _TABLES]:
        del state[key]  # removed by the processing (e.g. vLLM's "already processed" marker)
    for key, value in copied.__dict__.items():
        if key not in _TABLES:
            state[key] = twin.live(value)
    if not tensors:
        return copies
    for table in ("_parameters", "_buffers"):
        mine: dict[str, Any] = live.__dict__[table]
        new: dict[str, Any] = copied.__dict__[table]
        for name in list(mine):
            if name not in new:
                del mine[name]
        for name, tensor in new.items():
            kept = mine.get(name)
            if kept is not None and tensor is not None and kept is not tensor and _same_layout(kept, tensor):
                copies.append((kept, tensor))  # as vLLM's reload: whatever holds the live tensor sees the values
                continue
            if tensor is not None:
                for key, value in list(tensor.__dict__.items()):  # loaders bound to the twin: to the live module
                    tensor.__dict__[key] = twin.live(value)
            mine[name] = tensor
    live._non_persistent_buffers_set.clear()
    live._non_persistent_buffers_set.update(copied._non_persistent_buffers_set)
    return copies


def _copy_values(twin: Twin, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each new tensor's values into the live tensor it replaces. A live tensor two modules share (an MoE
    gate's correction bias, registered on the gate and on the experts) takes the values vLLM loaded, not those of
    a copy the twin made before its reload and never loaded (:func:`_own_tensors`)."""
    written: set[int] = set()
    for kept, new in sorted(copies, key=lambda c: id(c[1]) in twin.clones):
        if id(new) in twin.clones and (id(kept) in written or torch.equal(kept, new)):
            continue
        kept.data.copy_(new)
        written.add(id(kept))


def _same_layout(kept: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the commit copies ``new``'s values into the live tensor ``kept`` (and keeps it) rather than replacing
    it: same shape, dtype and device, and ``kept`` holds memory."""
    return (
        not kept.is_meta
        and kept.shape == new.shape
        and kept.dtype == new.dtype
        and kept.device == new.device
        and (kept.nbytes > 0 or new.nbytes == 0)
    )
