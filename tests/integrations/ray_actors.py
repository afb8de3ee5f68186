"""Actor classes for ``test_ray.py``: importable by Ray's worker processes (the test puts the repository on their
``PYTHONPATH``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import hotweights
from hotweights.integrations.ray import EngineActor


class EngineHost(EngineActor):
    """A rollout actor: a tiny in-process ``vllm.LLM`` with the worker extension."""

    def __init__(self, path: str) -> None:
        from hotweights.testing import start_engine

        self.llm = start_engine(path, worker_extension_cls=hotweights.WORKER_EXTENSION)

    def greedy(self) -> list[list[int]]:
        from hotweights.testing import greedy_vllm

        return greedy_vllm(self.llm)

    def version(self) -> str | None:
        from hotweights.handles import as_engine

        return as_engine(self.llm).get_weight_version()

    def status(self) -> dict[str, Any] | None:
        from hotweights.handles import as_engine

        return as_engine(self.llm).workers.status()

    def pid(self) -> int:
        return os.getpid()

    def plant(self, fault: str) -> None:
        """From now on this engine's writes apply ``fault`` (see ``tests/engine/faulty.py``; "" for none)."""
        from hotweights.vllm import introspect
        from tests.engine.faulty import install_faults, set_fault

        set_fault(fault)
        install_faults(introspect.inprocess_model(self.llm))


class Trainer:
    """The trainer's actor: holds both policies and installs them into the engine actors it is handed."""

    def __init__(self, paths: dict[str, str], engines: list[Any], staging_expiry: float = 600.0) -> None:
        from safetensors.torch import load_file

        from hotweights.integrations.ray import engine

        self.policies = {k: load_file(str(Path(p) / "model.safetensors")) for k, p in paths.items()}
        self.engines = [engine(a) for a in engines]
        self.fleet = hotweights.Fleet(self.engines, staging_expiry=staging_expiry)

    def install(self, which: str, version: int) -> dict[str, Any]:
        report = self.fleet.install(self.policies[which], weight_version=version)
        return {
            "ok": report.ok,
            "update_bytes": report.update_bytes,
            "bytes_written": report.bytes_written,
            "adapters": [r.adapter for r in report.replicas if r is not None],
            "versions": [r.engine_weight_version for r in report.replicas if r is not None],
            "text": str(report),
        }

    def install_into(self, index: int, which: str, version: int, unproven: bool) -> dict[str, Any]:
        """One install into engine actor ``index`` (``unproven``: as on a vLLM where no family is proven): its report,
        or the error it raised."""
        from hotweights.core import families

        proven, families.PROVEN = families.PROVEN, ({} if unproven else families.PROVEN)
        try:
            report = hotweights.install(self.engines[index], self.policies[which], weight_version=version)
        except hotweights.HotWeightsError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        finally:
            families.PROVEN = proven
        return {"family_check": report.family_check, "phases": report.phases}

    def stage_and_die(self, which: str, version: int) -> None:
        """Stage on every replica, then die by SIGKILL before committing (a trainer lost between the phases)."""
        self.fleet.stage(self.policies[which], weight_version=version)
        os.kill(os.getpid(), signal.SIGKILL)
