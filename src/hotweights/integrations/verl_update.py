"""One verl sync into a worker's install session (:mod:`hotweights.integrations.verl`'s receiver): each of verl's
buckets checked against what the engine serves, then copied (cast to the engine's dtype) straight into the
parameters' next storage where the worker allows it (:mod:`hotweights.integrations.verl_params`: the commit then
swaps storage), else packed into a hotweights bucket or, for verl's last bucket, staged where it lies; committed
atomically once every tensor arrived.

verl's LoRA syncs (``lora.merge=False``): the first (``peft_config`` set, ``base_sync_done=False``) is the base
model under a PEFT model's names, which :func:`hotweights.core.lora.base_name` gives back as the checkpoint names
them (then it installs as any sync). Each later one (``base_sync_done=True``) is the adapter alone:
:class:`AdapterUpdate` copies each of its tensors out of verl's buffer as it arrives and, at the last bucket,
installs them with :func:`hotweights._lora.install_lora_in_worker` (every check before anything is written; vLLM
loads the new adapter before it drops the old one) under the id and name verl's rollout puts in its requests
(:func:`verl_adapter`). verl's own receiver removes its adapter before the new one arrives; here a refused adapter
leaves the previous one serving.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hotweights.core import attach
from hotweights.core.buckets import ALIGNMENT, Bucket, BucketEntry
from hotweights.core.errors import Mismatch, WeightManifestValidationError
from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest, dtype_to_str
from hotweights.core.names import to_checkpoint
from hotweights.integrations.verl_params import NextParams
from hotweights.vllm.worker.session import SessionOptions, session_of

__all__ = [
    "REUSE_BUDGET",
    "TRANSPORT",
    "AdapterUpdate",
    "Update",
    "borrowed",
    "descriptor",
    "pack",
    "settle",
    "verl_adapter",
    "views",
]

#: The transport whose descriptors carry these buckets (its engine side: ``hotweights.integrations.verl``).
TRANSPORT = "verl"
#: Bytes of packing buffers a CPU worker keeps between syncs, the first buckets' (as hotweights' shm transport keeps
#: its first buckets' files: ``hotweights.transports.shm.REUSE_BUDGET``).
REUSE_BUDGET = 1 << 30


@dataclass
class Update:
    """One verl sync into the worker's install session: opened at the first bucket where the engine knows its
    checkpoint (each bucket then staged as it arrives), else at the last one, on what arrived."""

    worker: Any
    version: int
    expected: ExpectedWeights | None
    dtype: torch.dtype | None
    update_id: str | None = None
    index: int = 0
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    pending: list[tuple[Bucket, torch.Tensor]] = field(default_factory=list)
    borrows: bool = False
    """Some tensors were staged where they lie in verl's buffer: its sender must keep it until the commit."""
    next: NextParams | None = None
    """The parameters' next storage, where this update is copied straight into it (None: packed)."""

    @property
    def session(self) -> Any:
        return session_of(self.worker)

    def stage(
        self, buffer: torch.Tensor, entries: list[tuple[str, torch.Size, torch.dtype, int]], borrow: bool = False
    ) -> None:
        """Check one verl bucket, copy it (cast to what the engine serves) and stage it. ``borrow``: verl's last
        bucket, which its sender keeps until its last answer: when packed, its tensors are staged where they lie
        when none needs a cast (:func:`borrowed`; :attr:`borrows` then tells to answer after the commit)."""
        index, self.index = self.index, self.index + 1
        items, problems = views(buffer, entries)
        if not problems and self.expected is not None:  # transformers 5's in-memory names (fused experts), mapped
            e = self.expected
            items, _ = to_checkpoint(items, e.tensors, e.model_type, architectures=e.architectures)
        ignored = self.expected.ignored if self.expected is not None else {}
        specs: dict[str, TensorSpec] = {}
        wanted: list[tuple[str, torch.Tensor]] = []
        for name, tensor in items:
            if name in ignored:
                continue
            sent, dtype = tuple(tensor.shape), tensor.dtype
            spec = self._spec(name, sent, dtype)
            if spec is None:
                problems.append(Mismatch("unexpected", name, actual=f"{list(sent)} {dtype_to_str(dtype)}"))
            elif tuple(spec.shape) != sent:
                problems.append(Mismatch("shape", name, expected=str(list(spec.shape)), actual=str(list(sent))))
            elif spec.torch_dtype.is_floating_point != dtype.is_floating_point or (
                not dtype.is_floating_point and spec.torch_dtype != dtype
            ):
                problems.append(Mismatch("dtype", name, expected=spec.dtype, actual=dtype_to_str(dtype)))
            elif name in self.specs or name in specs:
                problems.append(Mismatch("manifest", name, actual="sent twice in one update"))
            else:
                specs[name] = spec
                wanted.append((name, tensor))
        if problems:
            raise WeightManifestValidationError(
                problems, context=f"verl's bucket {index} (checked by the engine's worker)"
            )
        if not specs:
            return
        self.specs.update(specs)
        if self.update_id is None and self.expected is not None:
            self._begin(self.expected.tensors)
            current = self.session.staging.current(self.update_id)
            self.next = NextParams.of(self.worker, current, self.expected.tensors)
        staged: Iterable[tuple[Bucket, torch.Tensor]]
        if self.next is not None:  # each parameter's rows staged once copied: checked while the next are copied
            staged = self._placed(index, wanted, specs, self.next, buffer.device)
        else:
            in_buffer = borrowed(index, wanted, specs, buffer) if borrow else None
            self.borrows = self.borrows or in_buffer is not None
            staged = in_buffer or [pack(index, wanted, specs, buffer.device, self.worker)]
        for bucket, packed in staged:
            self.index = bucket.index + 1
            if self.update_id is None:
                self.pending.append((bucket, packed))
            else:
                self.session.stage(self.update_id, bucket, descriptor(packed), defer_check=True)
        settle(buffer.device)  # before the answer lets verl's sender rewrite its buffer, and before the check
        if self.update_id is not None:  # the bucket checked for NaN and Inf in one go, while verl's sender fills
            self.session.flush_checks(self.update_id)  # its next one (a check beside the copies slows both)

    def commit(self) -> dict[str, int | str | float]:
        """Validate (every tensor arrived) and install atomically; returns the session's summary (with
        ``parameters_swapped`` where the parameters took their next storage)."""
        if not self.specs:  # an empty update (a checkpoint engine's rollout side, when the trainer installed)
            return {}
        if self.update_id is None:
            self._begin(self.specs)
            assert self.update_id is not None
            for bucket, packed in self.pending:
                self.session.stage(self.update_id, bucket, descriptor(packed))
            self.pending.clear()
        missing = [n for n in self.session.staging.current(self.update_id).missing()]
        if missing:
            assert self.expected is not None
            spec = self.expected.tensors
            raise WeightManifestValidationError(
                [Mismatch("missing", n, expected=f"{list(spec[n].shape)} {spec[n].dtype}") for n in missing],
                context="verl's update (checked by the engine's worker)",
            )
        if self.next is not None:
            self.session.prepare(self.update_id)  # every check joined: a refusal raises here, nothing swapped
        update_id, self.update_id = self.update_id, None
        following, self.next = self.next, None
        if following is None:
            summary: dict[str, int | str | float] = self.session.commit(update_id)
            return summary
        undo = following.swap()  # the direct setter's copies below then find every tensor in place
        try:
            summary = self.session.commit(update_id)
        except BaseException:
            undo()  # the parameters back on their previous storage
            following.release(REUSE_BUDGET)
            raise
        following.keep(REUSE_BUDGET)
        return {**summary, "parameters_swapped": len(following.params)}

    def abort(self) -> None:
        self.pending.clear()
        if self.next is not None:
            self.next.release(REUSE_BUDGET)
            self.next = None
        if self.update_id is not None:
            update_id, self.update_id = self.update_id, None
            self.session.abort(update_id)

    def _placed(
        self,
        index: int,
        items: list[tuple[str, torch.Tensor]],
        specs: dict[str, TensorSpec],
        next_params: NextParams,
        device: torch.device,
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Each tensor copied into its parameter's next storage; a parameter's rows are staged (as buckets of its
        storage) once the tensors that follow go to another parameter. The tensors of parameters copied at the
        commit (:meth:`NextParams.of`) are packed, last."""
        param: Any = None
        run: list[tuple[str, torch.Tensor]] = []
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in items:
            if name not in next_params.rows:
                rest.append((name, tensor))
                continue
            placed, rows = next_params.place(name, tensor)
            if run and placed is not param:
                index = yield from _rows(index, run, specs, param)
                run = []
            param = placed
            run.append((name, rows))
        if run:
            index = yield from _rows(index, run, specs, param)
        if rest:
            yield pack(index, rest, specs, device, self.worker)

    def _spec(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec | None:
        if self.expected is not None:
            return self.expected.tensors.get(name)
        cast = self.dtype is not None and dtype.is_floating_point
        return TensorSpec(shape=shape, dtype=dtype_to_str(self.dtype if cast and self.dtype else dtype))

    def _begin(self, specs: Any) -> None:
        manifest = WeightUpdateManifest.from_specs(specs, weight_version=self.version, metadata={"sender": "verl"})
        opened = self.session.begin(SessionOptions(), manifest)
        self.update_id = str(opened["update_id"])


def settle(device: torch.device) -> None:
    """Wait for the copies this thread issued on ``device``: an accelerator runs them asynchronously, and verl's
    sender rewrites its buffer (CUDA IPC) as soon as it is answered, while the NaN/Inf check reads the copies from
    another thread (verl's own receiver synchronizes the device after each bucket too). Nothing to wait for on a
    CPU."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.current_stream(device).synchronize()


def views(
    buffer: torch.Tensor, entries: list[tuple[str, torch.Size, torch.dtype, int]]
) -> tuple[list[tuple[str, torch.Tensor]], list[Mismatch]]:
    """The tensors a verl bucket places in ``buffer`` (views, no copy), and a mismatch for each one outside it."""
    problems: list[Mismatch] = []
    items: list[tuple[str, torch.Tensor]] = []
    for name, shape, dtype, offset in entries:
        nbytes = shape.numel() * dtype.itemsize
        if offset < 0 or offset + nbytes > buffer.numel():
            problems.append(Mismatch("manifest", name, actual=f"outside verl's {buffer.numel()}-byte buffer"))
        else:
            items.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape)))
    return items, problems


def pack(
    index: int, items: list[tuple[str, torch.Tensor]], specs: dict[str, TensorSpec], device: torch.device, worker: Any
) -> tuple[Bucket, torch.Tensor]:
    """verl's tensors (views of its buffer) copied into one hotweights bucket, each at an aligned offset,
    floating-point ones cast to the spec's dtype on the way (the copy verl's buffer needs anyway: the sender
    overwrites it with the next bucket)."""
    placed: list[BucketEntry] = []
    end = 0
    for name, _ in items:
        offset = (end + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        placed.append(BucketEntry(name=name, offset=offset, nbytes=specs[name].expected_nbytes))
        end = offset + specs[name].expected_nbytes
    packed = _buffer(worker, index, end, device)
    for entry, (name, tensor) in zip(placed, items, strict=True):
        dst = packed[entry.offset : entry.offset + entry.nbytes].view(specs[name].torch_dtype).view(tensor.shape)
        dst.copy_(tensor)
    return Bucket(index=index, nbytes=end, entries=tuple(placed)), packed


def _buffer(worker: Any, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Where bucket ``index`` is packed: on a CPU worker, the buffer it kept from the last sync for that index, up
    to :data:`REUSE_BUDGET` in all (rewriting kept pages skips the page faults of fresh memory: 512 MB took 210 ms
    fresh, about 80 ms kept, on 2 cores); else fresh memory (a GPU's allocator reuses its blocks itself)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    kept: dict[int, torch.Tensor] = attach.value(worker, "verl_buffers", dict)
    found = kept.get(index)
    if found is not None and found.numel() >= nbytes:
        return found[:nbytes]
    fresh = torch.empty(nbytes, dtype=torch.uint8)
    if sum(t.numel() for i, t in kept.items() if i != index) + nbytes <= REUSE_BUDGET:
        kept[index] = fresh
    return fresh


def borrowed(
    index: int, items: list[tuple[str, torch.Tensor]], specs: dict[str, TensorSpec], buffer: torch.Tensor
) -> list[tuple[Bucket, torch.Tensor]] | None:
    """verl's tensors staged where they lie in its buffer, no copy: each run of tensors at 64-byte multiples from
    the run's first (hotweights' bucket layout) becomes one bucket, a slice of the buffer. None when a tensor must
    be cast to the engine's dtype or is not a plain slice of the buffer (then the bucket is packed)."""
    base, placed = buffer.data_ptr(), []
    for name, tensor in items:
        offset = tensor.data_ptr() - base
        if tensor.dtype != specs[name].torch_dtype or not tensor.is_contiguous():
            return None
        if offset < 0 or offset + tensor.nbytes > buffer.numel():
            return None
        placed.append((offset, name, tensor.nbytes))
    runs: list[list[tuple[int, str, int]]] = []
    for entry in sorted(placed):
        run = runs[-1] if runs else None
        if run and (entry[0] - run[0][0]) % ALIGNMENT == 0 and 0 <= entry[0] - (run[-1][0] + run[-1][2]) < ALIGNMENT:
            run.append(entry)
        else:
            runs.append([entry])
    out = []
    for i, run in enumerate(runs):
        start, end = run[0][0], run[-1][0] + run[-1][2]
        entries = tuple(BucketEntry(name=n, offset=o - start, nbytes=b) for o, n, b in run)
        out.append((Bucket(index=index + i, nbytes=end - start, entries=entries), buffer[start:end]))
    return out


def _rows(
    index: int, run: list[tuple[str, torch.Tensor]], specs: dict[str, TensorSpec], param: Any
) -> Generator[tuple[Bucket, torch.Tensor], None, int]:
    """One parameter's rows, just written, as buckets of its next storage; returns the next bucket index."""
    found = borrowed(index, run, specs, param.flat())
    assert found is not None, "a parameter's rows are a plain slice of its storage, in its dtype"
    yield from found
    return index + len(found)


def descriptor(packed: torch.Tensor) -> dict[str, Any]:
    return {"transport": TRANSPORT, "nbytes": packed.numel(), "buffer": packed}


# ------------------------------------------------------------------------------------ LoRA syncs
def verl_adapter() -> tuple[int, str]:
    """The id and name of the adapter verl's rollout asks for in its requests (``vllm_async_server.py``)."""
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME

    return int(VLLM_LORA_INT_ID), str(VLLM_LORA_NAME)


@dataclass
class AdapterUpdate:
    """One LoRA adapter sync from verl: the same calls as :class:`~hotweights.integrations.verl_update.Update`
    (``stage`` each bucket, ``commit`` at the last, ``abort``), so the receiver's loop is the same."""

    worker: Any
    version: int
    expected: ExpectedWeights | None
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    borrows: bool = False
    """Never: each tensor is copied out of verl's buffer as it arrives, so the last answer goes before the install."""

    def stage(
        self, buffer: torch.Tensor, entries: list[tuple[str, torch.Size, torch.dtype, int]], borrow: bool = False
    ) -> None:
        """Copy one bucket's tensors out of verl's buffer (its sender overwrites it with the next bucket)."""
        items, problems = views(buffer, entries)
        problems += [Mismatch("manifest", n, actual="sent twice in one update") for n, _ in items if n in self.tensors]
        if problems:
            raise WeightManifestValidationError(
                problems, context="verl's LoRA adapter (checked by the engine's worker)"
            )
        self.tensors.update((name, tensor.to("cpu", copy=True)) for name, tensor in items)

    def commit(self) -> dict[str, int | str | float]:
        """Check the whole adapter and install it as verl's; returns the install's summary ({} for no tensors)."""
        if not self.tensors:
            return {}
        from hotweights._lora import install_lora_in_worker

        lora_id, name = verl_adapter()
        tensors, self.tensors = self.tensors, {}
        return install_lora_in_worker(
            self.worker,
            tensors,
            name=name,
            lora_id=lora_id,
            weight_version=self.version,
            config=self.config,
            expected=self.expected,
        )

    def abort(self) -> None:
        self.tensors.clear()
