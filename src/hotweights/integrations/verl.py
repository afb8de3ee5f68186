"""verl's rollouts through hotweights: a worker extension verl names in its engine kwargs, nothing else changes.

verl (0.9) syncs a colocated vLLM rollout with ``BucketedWeightSender`` (ZMQ messages describing each bucket, the
bytes in shared memory or a CUDA IPC buffer, one acknowledgement per bucket); its worker side loads each bucket
straight into the live model. With ``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=`` this
module's ``VerlWorkerExtension``, the same RPC (``update_weights_from_ipc``) stages each bucket into hotweights'
install session instead: checked against what the engine serves before anything is written, cast to the engine's
dtype, committed atomically on the last bucket and versioned by ``global_steps`` when passed (else one more than the
last; the adapter that follows a LoRA run's first base sync takes its version). Every message is answered, so the
sender returns; a refused or failed update then raises in the RPC with hotweights' typed error
(:func:`hotweights.core.envelope.decode`), the previous weights serving. A sender silent for :data:`TIMEOUT_ENV`
seconds ends the update the same way. An update of no tensors installs nothing (verl's rollout side of the
``hotweights`` checkpoint engine sends one: :mod:`hotweights.integrations.verl_checkpoint`). verl's messages are
read with an unpickler that admits only the torch types its protocol carries.

``VerlWorkerExtension`` subclasses verl's own extension (``monkey_patch_model`` and the rest stay verl's) and
hotweights' :data:`hotweights.WORKER_EXTENSION`; it is built when first looked up, so importing this module never
imports verl. LoRA syncs (``peft_config``): the base weights under PEFT's names are installed as the checkpoint
names them, the adapter alone through hotweights' adapter-only install as the adapter verl's requests use
(:class:`~hotweights.integrations.verl_update.AdapterUpdate`; vLLM's own LoRA loader loads it: verl's replacement
of it fails on vLLM 0.32).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import mmap
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from hotweights.core import attach
from hotweights.core.envelope import enveloped
from hotweights.core.errors import (
    EngineNotSupportedError,
    HotWeightsTimeoutError,
    InstallError,
)
from hotweights.core.lora import base_name
from hotweights.core.manifest import ExpectedWeights
from hotweights.integrations.verl_update import TRANSPORT, AdapterUpdate, Update, settle
from hotweights.transports import BucketReceiver, Descriptor, Opened, available_transports, register_transport
from hotweights.vllm import introspect
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Receiver",
    "VerlDescriptor",
    "VerlReceiver",
]  # and VerlWorkerExtension, built on use

log = logging.getLogger("hotweights")

#: Seconds the worker waits for verl's sender's next message before it ends the update (the sender is gone).
TIMEOUT_ENV = "HOTWEIGHTS_VERL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
#: Milliseconds between the worker's attempts to reach verl's sender socket. The RPC usually starts before the
#: sender binds its socket, and ZMQ's default (100 ms) then delayed every sync by about 100 ms (measured).
RECONNECT_MS = 2
#: The shared-memory names verl's sender makes (``verl_weights_<uuid4 hex>``): the only files this worker opens.
SHM_NAME = re.compile(r"verl_weights_[0-9a-f]{32}")
SHM_DIR = Path("/dev/shm")

_TORCH_TYPES = {
    "Size",
    "Tensor",
    "device",
    *(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)),
}
#: The globals verl's messages may name: torch's Size, dtypes and device; CUDA IPC handles (``reduce_tensor``).
_ALLOWED = {("torch", n) for n in _TORCH_TYPES} | {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"verl's weight-sync message names {module}.{name}, which it never sends")
        return super().find_class(module, name)


def _loads(data: bytes) -> Any:
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise InstallError(f"a message from verl's sender could not be read ({type(exc).__name__}: {exc})") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerlDescriptor(Descriptor):
    """A bucket this worker packed from verl's buffer (it never leaves the worker's process)."""

    transport: str = TRANSPORT
    buffer: torch.Tensor
    """The packed bucket."""

    def __post_init__(self) -> None:
        super().__post_init__()
        fix = "a 'verl' bucket is packed by this worker from verl's sender; it cannot come from elsewhere"
        self.require("buffer", isinstance(self.buffer, torch.Tensor), "a tensor as its", fix)


class Receiver(BucketReceiver):
    """The engine side of the ``verl`` transport: the bucket this worker packed, where it lies."""

    descriptor = VerlDescriptor

    @classmethod
    def open(cls, descriptor: VerlDescriptor, worker: Any = None, bucket: Any = None, manifest: Any = None) -> Opened:
        return descriptor.buffer, descriptor.buffer


if TRANSPORT not in available_transports():
    register_transport(TRANSPORT, __name__)


# ---------------------------------------------------------------------------------------------------- verl's wire
class _Buffer:
    """verl's bucket buffer: a shared-memory file of the sender's, mapped copy-on-write (a write here never reaches
    the sender's file; never unlinked here unless the sender is gone), or its CUDA IPC buffer."""

    def __init__(self, meta: Any, use_shm: bool, device: torch.device | None) -> None:
        self.path: Path | None = None
        self._map: mmap.mmap | None = None
        if use_shm:
            if not (isinstance(meta, dict) and isinstance(meta.get("name"), str) and isinstance(meta.get("size"), int)):
                raise InstallError(f"verl's sender announced no shared-memory buffer (got {type(meta).__name__})")
            if not SHM_NAME.fullmatch(meta["name"]):
                raise InstallError(f"verl's shared-memory buffer is named {meta['name']!r}, not verl_weights_<hex>")
            self.path = SHM_DIR / meta["name"]
            fd = os.open(self.path, os.O_RDONLY)
            try:
                size = min(int(meta["size"]), os.fstat(fd).st_size)
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
            finally:
                os.close(fd)
            empty = self._map is None
            self.tensor = torch.empty(0, dtype=torch.uint8) if empty else torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            self.tensor = _rebuild_ipc(meta, device)

    def close(self, sender_gone: bool = False) -> None:
        del self.tensor
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                log.debug("hotweights: verl's buffer is still viewed; it is unmapped when the view is freed")
            self._map = None
        if sender_gone and self.path is not None:
            self.path.unlink(missing_ok=True)


def _rebuild_ipc(handle: Any, device: torch.device | None) -> torch.Tensor:
    """A CUDA IPC buffer from verl's ``reduce_tensor`` handle, on this worker's device (as verl's ``rebuild_ipc``)."""
    if not (isinstance(handle, tuple) and len(handle) == 2 and isinstance(handle[1], tuple) and len(handle[1]) > 6):
        raise InstallError(f"verl's sender sent no CUDA IPC handle (got {type(handle).__name__})")
    func, args = handle
    args = list(args)
    if device is not None and device.index is not None:
        args[6] = device.index
    tensor = func(*args)
    if not isinstance(tensor, torch.Tensor):
        raise InstallError("verl's CUDA IPC handle did not rebuild a tensor")
    return tensor.view(torch.uint8).reshape(-1) if tensor.dtype != torch.uint8 else tensor


def _entries(meta: Any) -> tuple[list[tuple[str, torch.Size, torch.dtype, int]], list[tuple[str, Any]]]:
    """A bucket message's tensors in verl's buffer, and the ones sent apart by CUDA IPC handle."""
    if not isinstance(meta, dict) or not isinstance(meta.get("bucket_meta"), dict):
        raise InstallError(f"verl's sender sent a {type(meta).__name__} where a bucket was expected")
    inside, apart = [], []
    for name, m in meta["bucket_meta"].items():
        shape, dtype, offset = m.get("shape"), m.get("dtype"), m.get("offset")
        if not (isinstance(name, str) and isinstance(shape, torch.Size) and isinstance(dtype, torch.dtype)):
            raise InstallError(f"verl's bucket describes {name!r} without a name, torch.Size shape and torch dtype")
        if m.get("handle") is not None:
            apart.append((name, m["handle"]))
        elif isinstance(offset, int):
            inside.append((name, shape, dtype, offset))
        else:
            raise InstallError(f"verl's bucket places {name!r} at no offset")
    return inside, apart


def _step(global_steps: Any) -> int:
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise ValueError(f"global_steps is the trainer's step, a non-negative int, not {global_steps!r}")
    return global_steps


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {seconds}")
    return seconds


# ---------------------------------------------------------------------------------------------------- the extension
class VerlReceiver(HotWeightsWorkerExtension):
    """verl's ``update_weights_from_ipc``, received into hotweights' install session (mixed in before verl's own
    extension by :data:`VerlWorkerExtension`)."""

    @enveloped
    def update_weights_from_ipc(
        self,
        peft_config: dict[str, Any] | None = None,
        base_sync_done: bool = False,
        use_shm: bool = False,
        global_steps: int | None = None,
        **unknown: Any,
    ) -> dict[str, int | str | float]:
        """Receive one weight sync from verl's ``BucketedWeightSender`` and install it atomically.

        Every message is answered, whatever happens, so the sender returns; then a refusal or failure raises here
        (the engine keeps serving what it served). Returns the install's summary with its ``weight_version``.

        Raises:
            WeightManifestValidationError: a tensor the engine does not serve, of another shape, or missing.
            NonFiniteWeightsError: a tensor holds NaN or Inf (each named); the previous weights or adapter serve.
            EngineNotSupportedError: an adapter sync into an engine started without LoRA, or an argument this verl
                version does not send.
            InstallError: vLLM refused the adapter while loading it; the previous adapter serves.
            HotWeightsTimeoutError: the sender sent nothing for :data:`TIMEOUT_ENV` seconds.
        """
        import zmq

        worker: Any = self
        adapter_sync = bool(peft_config) and base_sync_done  # the adapter alone
        peft_base = bool(peft_config) and not base_sync_done  # the base under a PEFT model's names
        refusal: BaseException | None = None
        if unknown:
            refusal = EngineNotSupportedError(
                f"update_weights_from_ipc got {sorted(unknown)}, which hotweights' verl extension does not know: "
                "use the verl version it was tested with (0.9) or remove those arguments"
            )
        elif adapter_sync and introspect.worker_lora_rank(worker) is None:
            refusal = EngineNotSupportedError(
                "verl sent a LoRA adapter, but the engine was started without LoRA: start it with enable_lora=True "
                "and max_lora_rank at least the adapter's rank (verl's rollout does when "
                "actor_rollout_ref.model.lora.merge=False), or set actor_rollout_ref.model.lora.merge=True (verl then "
                "sends the merged weights)"
            )
        version = int(attach.get(worker, "verl_version", 0)) + 1
        lora_base = attach.get(worker, "verl_lora_base")
        attach.put(worker, "verl_lora_base", None)  # it counts for the next sync only
        if adapter_sync and lora_base == version - 1:
            version -= 1  # the adapter right after its step's base: verl's first LoRA step is one version
        timeout, expected = DEFAULT_TIMEOUT_S, None
        try:  # nothing may stop the answers below: a problem found here is the update's refusal
            if global_steps is not None:
                version = _step(global_steps)
            timeout = _timeout()
            expected = _expected(worker)
        except Exception as exc:
            refusal = refusal or exc
        socket: Any = zmq.Context.instance().socket(zmq.REP)
        socket.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        socket.connect(self._get_zmq_handle())  # type: ignore[attr-defined]
        update: Update | AdapterUpdate
        if adapter_sync:
            update = AdapterUpdate(worker, version, expected, dict(peft_config or {}))
        else:
            update = Update(worker, version, expected, _engine_dtype(worker))
        device = getattr(worker, "device", None)
        buffer: _Buffer | None = None
        gone = False
        result: dict[str, int | str | float] = {}

        def receive() -> Any:
            try:
                return socket.recv()
            except zmq.Again:
                raise HotWeightsTimeoutError(
                    f"verl's sender sent nothing for {timeout:g} s ({TIMEOUT_ENV}): the update was dropped, the "
                    "engine serves what it served"
                ) from None

        try:
            data = receive()
            if refusal is None:
                try:
                    buffer = _Buffer(_loads(data), use_shm, device)
                except Exception as exc:
                    refusal = exc
            socket.send(b"")
            answered = False  # the last message
            while True:
                data = receive()  # every message is answered below, whatever it holds
                is_last = False
                try:
                    message = _loads(data)
                    is_last = isinstance(message, dict) and bool(message.get("is_last"))
                    if refusal is None:
                        inside, apart = _entries(message)
                        if peft_base:
                            inside = [(base_name(n), s, d, o) for n, s, d, o in inside]
                            apart = [(base_name(n), h) for n, h in apart]
                        assert buffer is not None
                        for name, handle in apart:  # a tensor larger than verl's bucket, by its own IPC handle
                            alone = _rebuild_ipc(handle, device)
                            update.stage(alone, [(name, _shape_of(handle), _dtype_of(handle), 0)])
                        if inside:
                            update.stage(buffer.tensor, inside, borrow=is_last)
                        if is_last and not update.borrows:  # nothing staged lies in verl's buffer: answer now,
                            buffer.close()  # and the sender cleans up beside the commit
                            buffer, answered = None, True
                            socket.send(b"")
                        if is_last:
                            try:
                                result = update.commit()
                            finally:  # a commit that read verl's buffer is done before the buffer is released
                                if buffer is not None:
                                    settle(buffer.tensor.device)
                except Exception as exc:
                    refusal = refusal or exc
                    update.abort()
                if is_last:
                    break
                socket.send(b"")
            if buffer is not None:
                buffer.close()
                buffer = None
            if not answered:
                socket.send(b"")  # the last answer, once verl's buffer is released (as verl's own receiver does)
        except HotWeightsTimeoutError:
            gone = True
            raise
        finally:
            update.abort()
            if buffer is not None:
                buffer.close(sender_gone=gone)
            socket.close(linger=0)
        if refusal is not None:
            raise refusal
        if not result:  # nothing sent, nothing installed: the version stays
            return {"tensors": 0, "bytes": 0, "weight_version": attach.get(worker, "verl_version", 0)}
        attach.put(worker, "verl_version", version)
        attach.put(worker, "verl_lora_base", version if peft_base else None)
        return {**result, "weight_version": version}

    def hotweights_verl_version(self) -> int | None:
        """The version of the last verl sync this worker installed (None: none yet)."""
        found = attach.get(self, "verl_version")
        return int(found) if found is not None else None


def _shape_of(handle: Any) -> torch.Size:
    size = handle[1][1]
    return size if isinstance(size, torch.Size) else torch.Size(size)


def _dtype_of(handle: Any) -> torch.dtype:
    dtype = handle[1][5]
    if not isinstance(dtype, torch.dtype):
        raise InstallError("verl's CUDA IPC handle names no dtype")
    return dtype


def _expected(worker: Any) -> ExpectedWeights | None:
    """What the engine serves (its checkpoint's specs in its dtype), read once per worker; None when it cannot
    find its checkpoint (then the update is checked as a whole at the last bucket)."""
    from hotweights.vllm.expected import expected_from_config

    config = getattr(worker, "vllm_config", None)
    if config is None:
        return None
    found: ExpectedWeights | None = attach.value(
        worker, "verl_expected", lambda: expected_from_config(config.model_config, getattr(config, "load_config", None))
    )
    return found


def _engine_dtype(worker: Any) -> torch.dtype | None:
    dtype = getattr(getattr(getattr(worker, "vllm_config", None), "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


@functools.cache
def _extension() -> type:
    try:
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    except ImportError as exc:
        raise ImportError(
            f"hotweights.integrations.verl.VerlWorkerExtension subclasses verl's vLLMColocateWorkerExtension, which "
            f"cannot be imported here ({exc}): install verl (tested: verl==0.9.1) in the engine's environment"
        ) from exc

    def __new__(cls: type, **kwargs: Any) -> Any:
        instance = vLLMColocateWorkerExtension.__new__(cls, **kwargs)  # verl's patches, its LoRA loader among them
        _vllms_lora_loader()
        return instance

    return type(
        "VerlWorkerExtension",
        (VerlReceiver, vLLMColocateWorkerExtension),
        {
            "__module__": __name__,
            "__doc__": "verl's worker extension, its weight sync through hotweights.",
            "__new__": __new__,
        },
    )


def _vllms_lora_loader() -> None:
    """vLLM's own LoRA loader back where verl's extension replaced it (``VLLMHijack``, for verl's in-memory adapter
    requests, which hotweights never makes): on vLLM 0.32 verl's loader fails for any model with an
    ``hf_to_vllm_mapper`` (``WeightsMapper`` has no ``get_unstacked_mapper``), Qwen2 and Llama among them."""
    try:
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    except ImportError:
        return
    found = vars(LRUCacheWorkerLoRAManager).get("_load_adapter")
    if found is not None and str(getattr(found, "__module__", "")).startswith("verl."):
        delattr(LRUCacheWorkerLoRAManager, "_load_adapter")  # the base class's, vLLM's own, answers again


def __getattr__(name: str) -> Any:
    if name == "VerlWorkerExtension":
        return _extension()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
