"""An installer's path into any multiprocess engine through vLLM's own worker method: no extension, no backend, no
flags (:class:`WeightsPath`).

The one path without the install session: vLLM's ``reload_weights(weights_path=...)`` is its only step, so the
trainer alone validates, and the engine checks no digests."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from hotweights.adapters.call import InstallCall, Items
from hotweights.adapters.protocols import PathOwner
from hotweights.adapters.traits import BarePath
from hotweights.core import two_phase
from hotweights.core.cast import CastItems, uncast
from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.finite import check_finite
from hotweights.core.manifest import _ST_DTYPES, WeightUpdateManifest, dtype_from_str
from hotweights.transports.shm_files import SHM_DIR, sweep_stale
from hotweights.vllm import compat, fixes, introspect

__all__ = ["WeightsPath"]

#: File the update is written to, inside a private directory per install.
CHECKPOINT_FILE = "model.safetensors"


class WeightsPath(BarePath):
    """The path of an installer without the install session: ``collective_rpc("reload_weights", weights_path=...)``,
    which every vLLM worker has.

    The validated update is written as one safetensors file into a private directory in ``/dev/shm`` (mode 0700,
    named ``hotweights-<pid>-…``); every worker then reloads it in one layerwise reload, so fused parameters are
    rebuilt from complete parts. The directory is removed on every outcome. Nothing touches the model until the
    reload starts; generation waits only for the reload itself. ``rpc_timeout``: seconds the reload may take.
    """

    def __init__(self, installer: PathOwner, rpc_timeout: float | None) -> None:
        self.installer = installer
        self.rpc_timeout = rpc_timeout
        sweep_stale(min_age=60.0)  # checkpoint directories of trainers that died mid-install

    @property
    def stages_apart(self) -> bool:
        return True  # the checkpoint is written aside; the engine reloads it after the commit point

    def install(self, manifest: WeightUpdateManifest, items: Items, timer: InstallCall) -> dict[str, int]:
        installer = self.installer
        self._refuse_unmended()
        directory = Path(tempfile.mkdtemp(prefix=f"hotweights-{os.getpid()}-ckpt-", dir=SHM_DIR))
        try:
            with timer("pack"):
                if not timer.allow_nonfinite:  # vLLM's reload has no hook: checked here, on the trainer's device
                    check_finite(uncast(items), f"update {manifest.update_id} (v{manifest.weight_version})")
                _write_safetensors(directory / CHECKPOINT_FILE, items)
            two_phase.commit_point(
                timer.member
            )  # inside a fleet: every replica's checkpoint written before any reloads
            installer._begin_writing(timer)
            with timer("install"):
                installer.engine.workers.call(
                    "reload_weights",
                    timeout=self.rpc_timeout,
                    kwargs={"weights_path": str(directory), "is_checkpoint_format": True},
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return {}  # the engine's reload checks no digests (the trainer checked them before writing the file)

    def _refuse_unmended(self) -> None:
        """vLLM's own reload needs mending for some models (:data:`~hotweights.vllm.fixes.VLLM_FIXES`); the
        mend runs in the engine's processes only through hotweights' vLLM plugin: refuse where it cannot."""
        engine = self.installer.engine
        if engine.kind not in ("llm", "async_llm") or fixes.vllm_fixes_reach_workers():
            return
        needed = fixes.vllm_fixes_for(engine.model.config())  # only those this vLLM needs
        if needed:
            why = "; ".join(fixes.VLLM_FIXES[n].why for n in needed)
            raise EngineNotSupportedError(
                f"this model needs a fix to vLLM {compat.vllm_version() or '?'}'s reload_weights that runs in the "
                f"engine's processes through hotweights' vLLM plugin, and VLLM_PLUGINS="
                f"{os.environ.get('VLLM_PLUGINS')!r} leaves it out ({why}); nothing was written. Add hotweights to "
                f"VLLM_PLUGINS, or start the engine with worker_extension_cls={introspect.WORKER_EXTENSION!r}."
            )


def _write_safetensors(path: Path, items: Items) -> None:
    """``items`` as one safetensors file, written tensor by tensor: a tensor (cast, moved to the host or made
    contiguous where needed) is dropped once its bytes are written, so the update is never held twice."""
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in _described(items):
        n = tensor.numel() * tensor.dtype.itemsize
        header[name] = {
            "dtype": _ST_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, tensor in items:
            host = tensor.detach().to("cpu").contiguous()
            if host.numel():
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]


def _described(items: Items) -> list[tuple[str, torch.Tensor]]:
    """Name and a meta tensor of each item's dtype and shape, without reading (casting) the data."""
    if isinstance(items, CastItems):
        return [(n, torch.empty(t.shape, dtype=items.targets.get(n, t.dtype), device="meta")) for n, t in items.source]
    return [(n, t.to("meta")) for n, t in items]


_ST_NAMES = {dtype_from_str(torch_name): st for st, torch_name in _ST_DTYPES.items()}
