"""The installer (:class:`Installer`): an install path over the engine's handle.

``Installer(engine, wire, transport, options)`` runs the install session in the engine
(:mod:`hotweights.vllm.worker.session`: ``begin`` -> every bucket through the transport -> ``prepare`` on every
worker -> ``commit``, or ``abort``; :class:`~hotweights.adapters.session.SessionPath`); without a wire it writes
the update as a checkpoint that vLLM's own ``reload_weights`` loads
(:class:`~hotweights.adapters.weights_path.WeightsPath`). Everything an install shares with every path (the lock,
checks, gate, report) is :class:`~hotweights.adapters.WeightInstallAdapter`'s; the named adapters
(:mod:`hotweights.adapters.presets`) are installers built with a wire, a transport and options for one engine kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.contract import PrefixCachePolicy, WeightInstallAdapter
from hotweights.adapters.options import InstallerOptions
from hotweights.adapters.session import SessionPath
from hotweights.adapters.weights_path import WeightsPath
from hotweights.adapters.wires import Wire
from hotweights.core.delta import EncodedDelta, StagedDelta
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.handles import EngineHandle, as_engine
from hotweights.telemetry import logger
from hotweights.transports import EngineLink, WeightTransport, make_transport
from hotweights.vllm import introspect

if TYPE_CHECKING:
    from hotweights.vllm.worker.setter import DirectPlan

__all__ = ["Installer"]


class Installer(WeightInstallAdapter, EngineLink):
    """Installs into one engine through its handle: the install session through ``wire`` and ``transport`` with
    ``options`` checked once, here; or, with ``wire=None``, vLLM's own reload of a checkpoint written on this host.

    Args:
        engine: the engine (a ``vllm.LLM``, an ``AsyncLLM``), or its handle (made once per engine, shared by every
            installer on it: the serving gate, the active version, the delta base, the install lock).
        wire: how the session's calls reach the engine's workers (:class:`~hotweights.adapters.wires.Wire`); None:
            no session, vLLM's ``reload_weights(weights_path=...)`` (``options.rpc_timeout`` bounds it).
        transport: how the tensors travel: a :class:`~hotweights.transports.WeightTransport` or a registered name
            (unused without a wire).
        options: method, commit, verify default, bucket size, RPC timeout (:class:`InstallerOptions`).
        name: the installer's name in reports (with its transport, method and commit mode: its ``label``).
        label: the whole name in reports, where it is not made so.
        verifies_digests_locally: whether the trainer checks the manifest's digests before sending (False: the
            workers check them after transit).
        expected: what the engine accepts; by default read from the checkpoint the engine was started from.
        prefix_cache, lock_timeout: see :class:`WeightInstallAdapter`.
        guard_generation: keep generation calls off the weights while an install writes (the install waits for
            running calls; new ones wait for the install).

    It is also the :class:`~hotweights.transports.EngineLink` its transport connects through.
    """

    name = "installer"

    def __init__(
        self,
        engine: Any,
        wire: Wire | None,
        transport: str | WeightTransport | None = None,
        options: InstallerOptions | None = None,
        *,
        name: str | None = None,
        label: str | None = None,
        verifies_digests_locally: bool | None = None,
        expected: ExpectedWeights | None = None,
        prefix_cache: PrefixCachePolicy = "reset",
        lock_timeout: float | None = 600.0,
        guard_generation: bool = True,
    ) -> None:
        handle: EngineHandle = as_engine(engine)
        self.options = options or InstallerOptions()
        self.wire = wire
        self.transport: WeightTransport = make_transport(transport) if isinstance(transport, str) else transport  # type: ignore[assignment]
        if name is not None:
            self.name = name  # type: ignore[misc]
        if verifies_digests_locally is not None:
            self.verifies_digests_locally = verifies_digests_locally  # type: ignore[misc]
        if wire is None:
            self.path = WeightsPath(self, self.options.rpc_timeout)
        else:
            self.path = SessionPath(self, label)
            self.options.validate(self.abilities, keeps_segments=self.transport.keeps_segments)
        if expected is None:
            expected = handle.expected_weights()
            if expected is None:  # never skipped silently
                logger.warning(
                    "%s: the engine's checkpoint cannot be read from here (not a local directory), so names and "
                    "shapes are checked only by the engine itself, possibly after a partial write. Pass "
                    "expected=ExpectedWeights(...) (e.g. WeightUpdateManifest.from_safetensors(dir).tensors) to "
                    "validate before anything is written.",
                    handle.describe(),
                )
        super().__init__(
            engine=handle,
            expected=expected,
            prefix_cache=prefix_cache,
            lock_timeout=lock_timeout,
            gate=handle.gate if guard_generation else None,
            version=handle.active_version,
            delta_state=handle.delta_state,
        )
        self.engine: EngineHandle = handle
        if wire is not None:
            self.transport.connect(self)

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, Any]:
        return self.path.install(manifest, items, timer)  # type: ignore[attr-defined,no-any-return]

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, Any]:
        if not isinstance(self.path, SessionPath):
            return super()._install_delta(manifest, delta, staged, timer)  # type: ignore[return-value]
        return self.path.install_delta(manifest, delta, staged, timer)

    # ------------------------------------------------------------------ EngineLink (for the transport)
    @property
    def num_workers(self) -> int:
        return self.engine.facts.num_workers

    @property
    def releases_buckets_after_stage(self) -> bool:
        """The workers keep no view of a bucket once its ``stage`` returned (a streaming direct install copies out
        the few parts that wait for the next bucket), so a transport may reuse one buffer."""
        return self.options.commit == "streaming" and self.options.install_method == "direct"

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        assert self.wire is not None
        return self.wire.engine_op(op, **args)

    def on_shutdown(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` when the engine stops (where its kind has a hook: see ``EngineHandle.on_shutdown``)."""
        self.engine.on_shutdown(callback)

    # ------------------------------------------------------------------ an engine in this process
    @property
    def model(self) -> torch.nn.Module:
        """The model the engine serves, where its worker runs in this process."""
        return introspect.inprocess_model(self.engine.llm)  # type: ignore[attr-defined]

    def plan(self, manifest: WeightUpdateManifest) -> DirectPlan:
        """Every copy a direct install of ``manifest`` would make into an engine in this process (target parameter,
        slice, bytes); raises if any tensor cannot be placed.

        Raises:
            WeightManifestValidationError: listing every tensor with no parameter, a wrong shape, or a repacked
                fused parameter that would get only some of its parts.
            EngineNotSupportedError: the model is not one the direct setter's rule proves (see
                :func:`~hotweights.vllm.worker.setter.direct_refusals`).
        """
        from hotweights.vllm.worker.setter import model_slots, plan_direct, refuse_unproven

        model = self.model
        refuse_unproven(model)
        ignored = self.expected.ignored if self.expected is not None else {}
        return plan_direct(model_slots(model), manifest.tensors, ignored)
