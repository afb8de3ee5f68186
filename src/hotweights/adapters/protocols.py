"""What the parts of an install ask of the installer that runs them, as typing protocols.

The install's steps see it as what each uses (all of it is :class:`~hotweights.adapters.WeightInstallAdapter`):
:mod:`~hotweights.adapters.checks` a :class:`CheckedAdapter`, :mod:`~hotweights.adapters.failure` a
:class:`RecoveringAdapter`, :mod:`~hotweights.adapters.probe_step` a :class:`ProbedAdapter`, and
:mod:`~hotweights.adapters.commit`, which hands it on to both, an :class:`InstallingAdapter`; an installer's path
(:class:`~hotweights.adapters.session.SessionPath`, :class:`~hotweights.adapters.weights_path.WeightsPath`) as a
:class:`PathOwner` (what :class:`~hotweights.adapters.Installer` is). So the steps and the paths depend on these
few members, and the classes that run them import them, never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.options import InstallerOptions
from hotweights.adapters.wires import Wire
from hotweights.core.active import ActiveVersion
from hotweights.core.delta import DeltaBase, DeltaState, EncodedDelta, StagedDelta
from hotweights.core.gate import WriteGate
from hotweights.core.manifest import ExpectedWeights, WeightUpdateManifest
from hotweights.handles import EngineHandle
from hotweights.transports import WeightTransport

__all__ = ["CheckedAdapter", "InstallingAdapter", "PathOwner", "ProbedAdapter", "RecoveringAdapter"]


class CheckedAdapter(Protocol):
    """What :mod:`~hotweights.adapters.checks` reads of the adapter: what the engine serves and takes, its versions."""

    @property
    def engine(self) -> EngineHandle | None: ...
    @property
    def expected(self) -> ExpectedWeights | None: ...
    @property
    def formats(self) -> frozenset[str]: ...
    @property
    def sharded(self) -> bool: ...
    @property
    def verifies_digests_locally(self) -> bool: ...
    @property
    def _delta(self) -> DeltaState: ...
    @property
    def _version(self) -> ActiveVersion: ...

    def _engine_version_now(self) -> str | None: ...


class RecoveringAdapter(Protocol):
    """What :mod:`~hotweights.adapters.failure` asks of the adapter when a write fails: recover, fence, say what
    serves."""

    @property
    def gate(self) -> WriteGate | None: ...
    @property
    def _delta(self) -> DeltaState: ...
    @property
    def active_weight_version(self) -> int | None: ...
    @active_weight_version.setter
    def active_weight_version(self, version: int | None) -> None: ...

    def _recover(self) -> str: ...
    def reopen_serving(self) -> None: ...


class ProbedAdapter(RecoveringAdapter, Protocol):
    """What :mod:`~hotweights.adapters.probe_step` asks of the adapter: the engine's log-probabilities on a clean
    prefix cache, and the failure path when they differ."""

    def _reset_prefix_cache(self) -> bool: ...
    def _probe_logprobs(self, token_ids: tuple[int, ...], label: str) -> list[float | None] | None: ...


class InstallingAdapter(ProbedAdapter, Protocol):
    """What :mod:`~hotweights.adapters.commit` writes through and reports on (and hands to the probe and the
    failure path)."""

    active_update_id: str | None

    @property
    def prefix_cache(self) -> str: ...
    @property
    def label(self) -> str: ...

    def _install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, int] | None: ...
    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: InstallCall
    ) -> dict[str, int] | None: ...
    def _capture_base(self, items: Items, version: int) -> DeltaBase: ...
    def _record_engine_version(self, version: str) -> str | None: ...


class PathOwner(Protocol):
    """The installer an install path serves: its engine, wire, transport and options, and the install's gate."""

    @property
    def engine(self) -> EngineHandle: ...
    @property
    def wire(self) -> Wire | None: ...
    @property
    def transport(self) -> WeightTransport: ...
    @property
    def options(self) -> InstallerOptions: ...
    @property
    def _delta(self) -> DeltaState: ...

    def _begin_writing(self, timer: InstallCall) -> None: ...
    def engine_op(self, op: str, **args: Any) -> list[Any]: ...
