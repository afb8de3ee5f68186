"""A fake engine and wire for your own tests: ``hotweights.install`` without vLLM, in milliseconds.

:class:`FakeEngine` serves a set of tensors (a state dict). ``hotweights.install(fake, tensors, weight_version=v)``
runs hotweights' real trainer side against it: validation against what the fake serves, the manifest, versions,
buckets through a real transport (``bytes`` by default), the two-phase session (``begin`` -> ``stage`` per bucket
-> ``prepare`` -> ``commit``, or ``abort``), the serving gate and the report. :class:`FakeWire` is the engine side:
it stages each bucket with hotweights' own staging area (the one vLLM's workers use, digests checked) and swaps the
staged tensors into :attr:`FakeEngine.weights` at commit, all at once.

Use it where a real engine is too slow or absent (a trainer's unit tests, CI without vLLM): it proves your loop
calls hotweights correctly, sends what the engine expects and handles each failure. It proves nothing about vLLM:
test that against a real engine (:mod:`hotweights.testing`).

Example:
    >>> import torch, hotweights
    >>> from hotweights.fake import FakeEngine
    >>> fake = FakeEngine({"w": torch.zeros(2, 2)})
    >>> report = hotweights.install(fake, {"w": torch.ones(2, 2)}, weight_version=1)
    >>> fake.weights["w"].sum().item(), fake.version, fake.calls
    (4.0, 1, ['begin', 'stage', 'prepare', 'commit'])
    >>> fake.fail_at = "commit"           # the next install fails while writing: generation then fails closed
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch

from hotweights.adapters.installer import Installer
from hotweights.adapters.options import InstallerOptions, PathAbilities
from hotweights.adapters.registry import register_route
from hotweights.core.delta import DeltaBase
from hotweights.core.errors import EngineNotSupportedError, WeightManifestValidationError
from hotweights.core.gate import ServingGate
from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest
from hotweights.handles import EngineHandle
from hotweights.handles.workers import NoWorkers
from hotweights.transports import Descriptor
from hotweights.vllm.worker.session import SessionOptions
from hotweights.vllm.worker.staging import StagingArea

__all__ = ["FakeEngine", "FakeWire", "Verb"]

Verb = Literal["begin", "stage", "prepare", "commit"]
"""A session call of the fake's wire, where :attr:`FakeEngine.fail_at` can make it fail."""


class FakeEngine(EngineHandle):
    """An engine that serves ``weights`` (name -> tensor; copied) and installs through :class:`FakeWire`.

    Args:
        weights: what the engine serves at start: it accepts exactly these names, shapes and dtypes.
        transport: how the buckets travel to the fake's wire (``"bytes"``, ``"shm"`` or a transport instance).
        bucket_bytes: bucket size (None: the transport's own).

    Attributes:
        weights: what the engine serves now (after the last commit).
        calls: every session call its wire received, in order (``"begin"``, ``"stage"``, ... , ``"abort"``).
        fail_at: make the next session call of this verb raise ``RuntimeError`` (then reset to None). ``"commit"``
            writes half the tensors first, as a crash mid-write would: hotweights then fails closed.
        prefix_cache_resets: how many times an install reset the prefix cache.
    """

    kind: ClassVar[str] = "fake"
    pause_modes = ("wait", "abort", "keep")
    guards_family = False
    workers = NoWorkers("a FakeEngine has no workers to call; its wire is FakeWire")

    def __init__(
        self, weights: Mapping[str, torch.Tensor], *, transport: Any = "bytes", bucket_bytes: int | None = None
    ) -> None:
        if not weights:
            raise ValueError("a FakeEngine serves at least one tensor: pass the state dict it starts with")
        self.weights: dict[str, torch.Tensor] = {n: t.detach().clone() for n, t in weights.items()}
        self.calls: list[str] = []
        self.fail_at: Verb | None = None
        self.prefix_cache_resets = 0
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self._recorded: str | None = None
        self._gate = ServingGate()

    # ------------------------------------------------------------------ what a test reads
    @property
    def version(self) -> int | None:
        """The weight version the fake serves (None: the weights it started with)."""
        return None if self._recorded is None else int(self._recorded)

    @contextmanager
    def generating(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the engine as a generation call does: an install waits for it, and after an install that failed
        while writing it raises :class:`~hotweights.PartialUpdateError`."""
        with self._gate.serving(timeout):
            yield

    # ------------------------------------------------------------------ EngineHandle
    @property
    def route(self) -> str:
        return "fake"

    @property
    def gate(self) -> ServingGate:
        return self._gate

    def expected_weights(self) -> ExpectedWeights:
        return ExpectedWeights({n: TensorSpec.of(t) for n, t in self.weights.items()})

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def set_weight_version(self, version: str) -> str | None:
        self._recorded = version
        return version

    def get_weight_version(self) -> str | None:
        return self._recorded

    def describe(self) -> str:
        return f"a FakeEngine serving {len(self.weights)} tensor(s)"


class FakeWire:
    """The engine side of :class:`FakeEngine`: the session's five calls, in this process.

    ``begin`` refuses a manifest that differs from what the fake serves (typed, every mismatch named); ``stage``
    opens each bucket through its transport into hotweights' staging area (digests checked); ``prepare`` checks
    that every tensor arrived; ``commit`` swaps them in at once; ``abort`` drops what was staged.
    """

    one_call = False
    reads_back = False
    releases_segments = False
    summarises = True

    def __init__(self, engine: FakeEngine, timeout: float | None = None) -> None:
        self.engine = engine
        self.timeout = timeout
        self._staging = StagingArea(self)

    def _enter(self, verb: str) -> None:
        self.engine.calls.append(verb)
        if self.engine.fail_at == verb:
            self.engine.fail_at = None
            if verb != "commit":
                raise RuntimeError(f"injected failure at {verb} (FakeEngine.fail_at)")

    def begin(
        self, options: SessionOptions, manifest: WeightUpdateManifest | None = None, lent: DeltaBase | None = None
    ) -> None:
        self._enter("begin")
        if options.delta is not None or manifest is None:
            raise EngineNotSupportedError("a FakeEngine installs full updates only; install with delta=False")
        problems = self.engine.expected_weights().mismatches(manifest)
        if problems:
            raise WeightManifestValidationError(problems, context="weight update (checked by the fake engine)")
        self._staging.begin(manifest, check=False, finite=not options.allow_nonfinite)

    def stage(self, update_id: str, bucket_json: str, descriptor: Descriptor) -> None:
        self._enter("stage")
        self._staging.stage(update_id, bucket_json, descriptor)

    def prepare(self, update_id: str) -> list[list[dict[str, str]]]:
        self._enter("prepare")
        self._staging.check_complete(update_id)
        return [[]]

    def commit(self, update_id: str) -> list[dict[str, Any]]:
        crash = self.engine.fail_at == "commit"
        self._enter("commit")
        staged, session = self._staging.take(update_id)
        new = {n: t.clone() for n, t in staged}
        if crash:  # as a worker that died mid-write leaves it: some tensors new, some old
            for name in list(new)[: max(1, len(new) // 2)]:
                self.engine.weights[name] = new[name]
            raise RuntimeError("injected failure at commit, after writing some tensors (FakeEngine.fail_at)")
        self.engine.weights = {**self.engine.weights, **new}
        why = "the fake engine swaps the staged tensors in"
        return [{"install_method": "fake", "install_reason": why, "digests_verified": session.digests_verified}]

    def abort(self, update_id: str) -> None:
        self.engine.calls.append("abort")
        self._staging.abort(update_id)

    def install(self, options: SessionOptions, manifest: WeightUpdateManifest, payload: Any) -> list[Any]:
        raise EngineNotSupportedError("FakeWire has no one-call install")

    def engine_op(self, op: str, **args: Any) -> list[Any]:
        raise EngineNotSupportedError(f"a FakeEngine runs no worker operation ({op!r})")


class _FakeInstaller(Installer):
    name = "fake"
    verifies_digests_locally = False  # the fake's staging area checks them, as a worker's does

    @property
    def abilities(self) -> PathAbilities:
        return PathAbilities(self.label)  # no read-back, no deltas


def for_engine(handle: EngineHandle) -> Installer:
    """The installer :func:`hotweights.install` builds on a :class:`FakeEngine`."""
    assert isinstance(handle, FakeEngine)
    options = InstallerOptions(bucket_bytes=handle.bucket_bytes)
    return _FakeInstaller(handle, FakeWire(handle), handle.transport, options)


register_route("fake", f"{__name__}:for_engine")
