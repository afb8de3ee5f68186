"""Streaming installs: each bucket goes into the live model as soon as it is received and checked.

The staged (atomic) session keeps the whole update aside until its commit; a stream keeps at most the bucket in
flight plus the parts of a layer that are still incomplete, so peak extra memory follows the bucket size, not the
update size. The price: once the first bucket went in, a failure leaves some layers new and some old (``abort``
puts incomplete layers back to their previous weights; completed ones stay new).

Two streams, one per install method:

- :class:`ReloadStream`: one vLLM layerwise reload kept open across buckets; vLLM buffers a layer until all its
  parts (q/k/v, gate/up) arrived, then processes it.
- :class:`DirectStream`: the direct setter's plan for the whole update is made at ``begin`` (a tensor it cannot
  place is refused before anything moves); each parameter is written once all its parts arrived. It keeps no view
  of a bucket after ``feed`` returns (waiting parts are copied), so a sender can reuse one buffer for every bucket.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from hotweights.core.manifest import WeightUpdateManifest
from hotweights.vllm.worker import ops as worker_ops
from hotweights.vllm.worker.runner import kv_cache_lent
from hotweights.vllm.worker.setter import DirectPlan, apply_direct, model_slots, plan_direct

__all__ = ["DirectStream", "ReloadStream", "Stream", "open_stream"]


class Stream(Protocol):
    """What a streaming session does with each checked bucket."""

    #: Whether the stream builds the update aside, in a twin of the model (an atomic session whose tensors go into
    #: it as they are staged, by reference too), rather than into the live model.
    builds_aside: bool

    def prepare(self) -> None:
        """Once every tensor was fed, finish what needs no live write (a twin's last layers); nothing live is
        touched."""

    def feed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Install these tensors (all of one bucket) into the live model, or hold the parts of incomplete layers."""

    def finish(self) -> int:
        """Complete the install once every tensor was fed; returns the layers re-processed or refreshed."""

    def abort(self) -> None:
        """Stop: incomplete layers keep their previous weights; the model is left servable."""


def open_stream(worker: Any, manifest: WeightUpdateManifest, method: str, *, kv_reclaimable: bool = False) -> Stream:
    """A stream for ``method`` into ``worker``'s model: ``"reload"``, ``"direct"``, or ``"aside"`` (into a twin of
    the model, swapped in at the commit: :mod:`hotweights.vllm.worker.aside`). ``kv_reclaimable``: see
    :class:`~hotweights.vllm.worker.session.SessionOptions`."""
    if method == "reload":
        return ReloadStream(worker, kv_reclaimable=kv_reclaimable)
    if method == "direct":
        return DirectStream(worker, manifest)
    if method == "aside":
        from hotweights.vllm.worker.aside import AsideStream

        return AsideStream(worker)
    raise ValueError(f"unknown install method {method!r}; use 'reload', 'direct' or 'aside'")


class ReloadStream:
    """vLLM's layerwise reload, opened with the first bucket and fed one bucket at a time."""

    builds_aside = False

    def __init__(self, worker: Any, *, kv_reclaimable: bool = False) -> None:
        self.worker = worker
        self.model = worker_ops.worker_model(worker)
        self.opened = False  # the reload starts with the first bucket: until then the model serves as before
        self.kv_reclaimable = kv_reclaimable
        # vLLM 0.34's KV-cache loan, which its own reload_weights enters: held from the first bucket to the end
        self.loan = contextlib.ExitStack()

    def feed(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.opened:
            self.loan.enter_context(kv_cache_lent(self.worker, reclaimable=self.kv_reclaimable, lend=True))
            try:
                worker_ops.open_layerwise_reload(self.model)
            except BaseException:
                self.loan.close()
                raise
            self.opened = True
        # Views into the received bucket: a layer still waiting for parts keeps them (and so the bucket) alive.
        self.model.load_weights(iter(tensors.items()))  # type: ignore[operator]

    def prepare(self) -> None:
        """Nothing to finish aside: the reload writes the live model."""

    def finish(self) -> int:
        with self.loan:
            if self.opened:
                worker_ops.close_layerwise_reload(self.worker, self.model)
            return worker_ops.refresh_tied_layers(self.model)

    def abort(self) -> None:
        with self.loan:
            if self.opened:
                worker_ops.close_layerwise_reload(self.worker, self.model, discard_incomplete=True)
                worker_ops.refresh_tied_layers(self.model)


class DirectStream:
    """The direct setter, applied parameter by parameter as their parts arrive."""

    builds_aside = False

    def __init__(self, worker: Any, manifest: WeightUpdateManifest) -> None:
        self.worker = worker
        self.model = worker_ops.worker_model(worker)
        plan = plan_direct(model_slots(self.model), manifest.tensors)  # refuses before anything moves
        self.waiting: dict[str, DirectPlan] = {}  # parameter -> its copies, until all their sources arrived
        for placement, slot in plan.placements:
            self.waiting.setdefault(f"{slot.module_name}.{slot.attr}", DirectPlan()).placements.append(
                (placement, slot)
            )
        self.pending: dict[str, torch.Tensor] = {}
        self.reprocessed = 0

    def feed(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        ready = DirectPlan()
        for param, plan in list(self.waiting.items()):
            if all(p.checkpoint_name in self.pending for p, _ in plan.placements):
                ready.placements += plan.placements
                del self.waiting[param]
        if ready.placements:
            self.reprocessed += apply_direct(self.model, ready, self.pending, refresh_tied=False)
            for p, _ in ready.placements:
                self.pending.pop(p.checkpoint_name, None)
        # Parts still waiting for the rest of their parameter are copied out of the bucket: once ``stage`` returns,
        # this stream holds no view of it, so the sender may reuse its memory for the next bucket.
        for name in tensors.keys() & self.pending.keys():
            self.pending[name] = self.pending[name].clone()

    def prepare(self) -> None:
        """Nothing to finish aside: each parameter went into the live model as it completed."""

    def finish(self) -> int:
        if self.waiting:
            raise ValueError(f"parameters never completed: {sorted(self.waiting)[:5]}")
        worker_ops.after_weights_changed(self.worker)
        return self.reprocessed + worker_ops.refresh_tied_layers(self.model)

    def abort(self) -> None:
        self.pending.clear()  # parameters written so far hold complete new values; the rest were never touched
        worker_ops.after_weights_changed(self.worker)
        worker_ops.refresh_tied_layers(self.model)
