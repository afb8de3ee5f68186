"""The engine side of every multiprocess transport, as a vLLM worker extension.

Start the engine with ``LLM(..., worker_extension_cls=hotweights.WORKER_EXTENSION)``; the methods below are then
reachable by name through ``collective_rpc`` (strings, ints, bytes and JSON only: no pickle anywhere).

An install is a *session*: ``begin`` (manifest) -> ``stage`` per bucket -> ``finish``. Staging only maps or
copies bytes aside and checks them against the manifest; nothing touches the model until ``finish``, which
installs every staged tensor in one layerwise reload. So a fused parameter whose parts arrive in different buckets
is still correct, and ``abort`` (or a trainer that never comes back) leaves the previous weights serving.

A *streaming* session (``begin(..., commit="streaming")``) installs each bucket as it arrives instead, holding only
incomplete layers: memory follows the bucket, but an abort after the first bucket leaves a mix of old and new
layers (see :mod:`hotweights.engine.streaming`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hotweights.engine import delta as delta_state
from hotweights.engine.staging import InstallSession, StagingArea
from hotweights.engine.worker_ops import reload_checkpoint_tensors

if TYPE_CHECKING:
    import torch

    from hotweights.core.manifest import WeightUpdateManifest
    from hotweights.engine.direct import DirectPlan

__all__ = ["HotWeightsWorkerExtension"]


class HotWeightsWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; every method is prefixed ``hotweights_``."""

    _hotweights_staging: StagingArea | None = None

    @property
    def _hotweights(self) -> StagingArea:
        if self._hotweights_staging is None:
            self._hotweights_staging = StagingArea(self)
        return self._hotweights_staging

    def hotweights_begin(self, manifest_json: str, commit: str = "atomic", method: str = "reload") -> str:
        """Open a session for an update; a session left open by a crashed trainer is dropped first.

        ``commit="atomic"`` stages every bucket aside until ``finish``; ``"streaming"`` installs each bucket as it
        arrives. ``method`` is decided here, before any byte moves (:func:`~hotweights.engine.direct.choose_method`):
        ``"direct"`` plans the direct setter (an update it cannot place is refused), ``"auto"`` plans it and keeps it
        only if the model passes the setter's safety rule and the plan places everything (else ``"reload"``).
        """
        from hotweights.engine.direct import choose_method
        from hotweights.engine.worker_ops import worker_model

        if commit not in ("atomic", "streaming"):
            raise ValueError(f"unknown commit mode {commit!r}; use 'atomic' or 'streaming'")
        if method not in ("auto", "reload", "direct"):
            raise ValueError(f"unknown install method {method!r}; use 'auto', 'direct' or 'reload'")
        chosen: list[Any] = []

        def choose(manifest: WeightUpdateManifest) -> tuple[DirectPlan | None, str, str]:
            chosen[:] = choose_method(lambda: worker_model(self), manifest.tensors, method)
            return chosen[0], chosen[1], chosen[2]

        if commit == "atomic":
            update_id = self._hotweights.begin(manifest_json)
            session = self._hotweights.current(update_id)
            try:
                session.direct_plan, session.method, session.method_reason = choose(session.manifest)
            except BaseException:
                self._hotweights.abort(update_id)
                raise
            return update_id
        from hotweights.engine.streaming import open_stream

        if method != "auto":  # a forced method: the stream plans (or refuses) itself
            chosen[:] = [None, method, f"install_method={method!r} was asked for"]
        update_id = self._hotweights.begin(
            manifest_json, lambda m: open_stream(self, m, chosen[1] if chosen else choose(m)[1])
        )
        session = self._hotweights.current(update_id)
        session.method, session.method_reason = chosen[1], chosen[2]
        delta_state.forget(self)  # a streaming install writes as it receives: the delta copy cannot follow it
        return update_id

    def hotweights_stage(self, update_id: str, bucket_json: str, descriptor: dict[str, Any]) -> int:
        """Receive one bucket through its transport and keep its tensors aside; returns the bytes staged."""
        return self._hotweights.stage(update_id, bucket_json, descriptor)

    def hotweights_finish(
        self, update_id: str, method: str = "reload", ignored: dict[str, str] | None = None, verify: bool = False
    ) -> dict[str, int | str]:
        """Install every staged tensor, if and only if all of them arrived: in one layerwise reload
        (``method="reload"``) or by the direct setter (``"direct"``: planned first, then copied in place); ``"auto"``:
        as decided at ``begin``. The summary names the method that ran and why (``install_method``,
        ``install_reason``). ``verify`` reads the live parameters back afterwards (:meth:`_readback`)."""
        if method not in ("reload", "direct", "auto"):
            raise ValueError(f"unknown install method {method!r}; use 'auto', 'direct' or 'reload'")
        staging = self._hotweights
        session = staging.current(update_id)
        if verify and session.stream is not None:
            raise ValueError("verify needs an atomic commit: a streaming install keeps no copy of what it wrote")
        ran = session.method if method == "auto" or session.stream is not None else method
        ran = ran or "reload"
        reason = session.method_reason if ran == session.method else f"install_method={ran!r} was asked for"
        if session.stream is not None:
            refreshed, session = staging.finish_stream(update_id)
        else:
            items, session = staging.take(update_id)
            delta_state.forget(self)  # from the first write until the install is done, the copy is stale
            if ran == "direct":
                from hotweights.engine.direct import apply_direct
                from hotweights.engine.worker_ops import after_weights_changed, worker_model

                plan = session.direct_plan  # made at begin when the trainer said "direct" or "auto" there
                if plan is None:
                    plan = self._direct_plan(session.manifest)
                refreshed = apply_direct(worker_model(self), plan, dict(items))
                after_weights_changed(self)
            else:
                refreshed = reload_checkpoint_tensors(self, items)
        if session.stream is None:
            delta_state.remember(self, session.manifest, items)  # while delta installs are asked for
        summary: dict[str, int | str] = {
            "tensors": len(session.manifest.tensors),
            "bytes": session.nbytes,
            "digests_verified": session.digests_verified,
            "tied_layers_refreshed": refreshed,
            "install_method": ran,
            "install_reason": reason,
        }
        if verify:
            summary.update(self._readback(session, items))
        return summary

    def hotweights_install(
        self,
        manifest_json: str,
        bucket_json: str,
        descriptor: dict[str, Any],
        method: str = "auto",
        verify: bool = False,
    ) -> dict[str, int | str]:
        """``begin`` + ``stage`` + ``finish`` of an atomic update that fits in one bucket, in one call (one RPC
        instead of three); the summary is ``finish``'s. An update refused before the install (by the plan, or by
        the checks of its bucket) drops the session and returns ``{"refused": "<why>"}``: nothing was written.
        Only for an engine with one worker: with several, one could refuse while another installs."""
        try:
            update_id = self.hotweights_begin(manifest_json, "atomic", method)
            try:
                self.hotweights_stage(update_id, bucket_json, descriptor)
            except BaseException:
                self._hotweights.abort(update_id)
                raise
        except Exception as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
        return self.hotweights_finish(update_id, method, None, verify)

    def _readback(self, session: InstallSession, items: list[tuple[str, torch.Tensor]]) -> dict[str, int | str]:
        """Compare the live parameters with what the staged tensors put there; raise naming every tensor that
        differs. The direct setter's plan knows each fused slice: a reload install is checked with it when the
        model passes the setter's safety rule (its post-processing then leaves data-holding parameters as loaded).
        Fused-MoE experts are checked in the kernel's own layout (:func:`~hotweights.engine.readback.verify_experts`)
        on every model. What neither covers is counted unreadable, and ``readback_note`` says why."""
        from hotweights.engine.direct import direct_refusals, model_slots, plan_direct, verify_readback
        from hotweights.engine.readback import verify_experts
        from hotweights.engine.worker_ops import worker_model

        model = worker_model(self)
        tensors = dict(items)
        experts_equal, experts_bad, note = verify_experts(model, tensors)
        plan = session.direct_plan
        refusals = direct_refusals(model) if plan is None else ()
        if plan is None and not refusals:
            plan = plan_direct(model_slots(model), session.manifest.tensors)
        if plan is not None:
            verified, unreadable, bad = verify_readback(model, plan, tensors)
            bad = sorted(set(bad) | experts_bad)
        else:
            verified, bad = len(experts_equal), sorted(experts_bad)
            unreadable = len(tensors) - verified - len(bad)
            note = note or refusals[0]
        if bad:
            raise ValueError(
                f"readback after the install: {len(bad)} tensor(s) in the live parameters differ from what the trainer "
                f"sent: {bad[:5]}"
            )
        summary: dict[str, int | str] = {"readback_verified": verified, "readback_unreadable": unreadable}
        if unreadable and note:
            summary["readback_note"] = note
        return summary

    def _direct_plan(self, manifest: WeightUpdateManifest) -> DirectPlan:
        """The direct setter's plan for ``manifest`` on this worker's model (raises if it cannot place it)."""
        from hotweights.engine.direct import model_slots, plan_direct
        from hotweights.engine.worker_ops import worker_model

        return plan_direct(model_slots(worker_model(self)), manifest.tensors)

    # Delta installs (:mod:`hotweights.engine.delta`): begin -> stage per bucket -> prepare -> commit, or abort.
    def hotweights_delta_track(self, on: bool = True) -> bool:
        """Keep (``on``) a host copy of every full install from now on, for deltas to apply to; or drop it."""
        return delta_state.track(self, on)

    def hotweights_delta_begin(self, delta_json: str, wire_json: str = "") -> dict[str, Any]:
        """Open a delta session if this worker's copy is the delta's base (``{"ok": False, "serving": ...}``
        otherwise); its wire tensors then arrive through ``hotweights_stage`` like any bucket."""
        return delta_state.begin(self, self._hotweights, delta_json, wire_json)

    def hotweights_delta_prepare(self, update_id: str) -> list[dict[str, str]]:
        """Check the staged delta completely and rebuild its tensors aside; the problems found (none: ready)."""
        return delta_state.prepare(self, self._hotweights, update_id)

    def hotweights_delta_commit(self, update_id: str, method: str = "auto") -> dict[str, int | str]:
        """Install every tensor of the blocks the prepared delta touched, then move the copy to its version."""
        return delta_state.commit(self, update_id, method)

    def hotweights_delta_abort(self, update_id: str | None = None) -> bool:
        """Drop the open delta session; the model and the copy were never touched."""
        return delta_state.abort(self, self._hotweights, update_id)

    def hotweights_abort(self, update_id: str | None = None) -> bool:
        """Drop the open session (only ``update_id``'s when given); the model was never touched."""
        return self._hotweights.abort(update_id)

    def hotweights_clear_kv_cache(self) -> int:
        """Zero the KV cache (after a failure that may have touched live weights); returns tensors zeroed."""
        from hotweights.engine.worker_ops import clear_kv_cache

        return clear_kv_cache(self)

    def hotweights_init_communicator(
        self, host: str, port: int, world_size: int, backend: str = "gloo", timeout: float = 60.0
    ) -> int:
        """Join the trainer's collective group (closing a stale one first); returns this worker's group rank."""
        from hotweights.transports.collective import init_worker_group

        init_worker_group(self, host, port, world_size, backend, timeout)
        return 1 + int(getattr(self, "rank", 0))

    def hotweights_close_communicator(self) -> bool:
        """Drop the collective group, if any."""
        from hotweights.transports.collective import close_group

        return close_group(self)

    def hotweights_release_segments(self, ids: list[str] | None = None) -> int:
        """Unmap kept shm segments (``ids``, or all), and those of trainers that are gone; returns how many."""
        from hotweights.transports.shm import release_segments

        return release_segments(self, ids)

    def hotweights_weights_asleep(self) -> bool:
        """Whether vLLM's sleep mode holds this worker's weights offloaded or discarded (a paused scheduler alone
        does not): an install must not write them."""
        from hotweights.engine.compat import weights_asleep_here

        return weights_asleep_here()

    def hotweights_pause_owner(self, action: str = "read", owner: str = "") -> str:
        """The record of the hotweights install that paused this engine (``""``: none), as
        :class:`~hotweights.handles.pause.PauseOwner` JSON. ``action="claim"`` stores ``owner`` instead,
        ``"release"`` clears it; either returns the record it replaced."""
        if action not in ("read", "claim", "release"):
            raise ValueError(f"unknown action {action!r}; use 'read', 'claim' or 'release'")
        if len(owner) > 1024:
            raise ValueError("a pause owner record is at most 1024 characters")
        was = str(getattr(self, "_hotweights_pause_owner", ""))
        if action != "read":
            self._hotweights_pause_owner = owner if action == "claim" else ""
        return was

    def hotweights_ping(self) -> str:
        """Cheap round trip; tells the trainer the extension is loaded."""
        return "hotweights"
