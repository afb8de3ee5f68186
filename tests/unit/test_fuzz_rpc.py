"""Property-based fuzzing of the HTTP entry: hostile ``POST /collective_rpc`` bodies, decoded the way a ``vllm serve``
process decodes them, against the worker extension's RPC handlers (issue #18; ``test_fuzz.py`` fuzzes the Python
entry).

A body takes the path a real one takes: hotweights' guard reads it (:func:`hotweights.serve_guard.check_body`; a
server without the guard hands it on as it is), vLLM's dev route parses it (``json.loads``: ``method``, ``args``,
``kwargs``), the engine-core client sends the call to the engine as msgpack (``msgspec``: tuples arrive as lists, an
int beyond 64 bits or nesting deeper than the encoder allows never leaves the API server), and the worker runs
``getattr(worker, method)(*args, **kwargs)`` (vLLM's ``run_method``). A trainer driving a multiprocess ``vllm.LLM``
from Python takes the same msgpack hop, with ``bytes`` allowed: both wires are fuzzed.

The worker is a :class:`~hotweights.vllm.worker.extension.HotWeightsWorkerExtension` whose ``vllm_config`` names a
tiny safetensors checkpoint (so ``check_manifest`` runs for real) and whose model, reload, rendezvous and transports
are watched. Invariants for every call:

- it returns, or raises a typed error (:data:`RPC_ERRORS`, never a raw pydantic error, ``RecursionError``,
  ``OverflowError``, ``MemoryError``, ``AssertionError``...) with a message;
- the model is read only for a manifest the worker accepts, and written only with a complete update shaped exactly
  like its checkpoint; a rendezvous is attempted only with checked arguments;
- a transport's ``open_bucket`` is reached only for a bucket that passed ``bucket_problems`` at its declared size;
- nothing appears in ``/dev/shm``, and nothing is opened but hotweights segment names in ``SHM_DIR``;
- a refused call leaves the open session (and the delta copy, the group and the pause record) as it was, where its
  contract says so;
- the worker keeps serving: ``hotweights_engine("status")`` and a well-formed ``begin``/``stage``/``abort`` work
  afterwards.

The six methods of protocol 2 are all fuzzed (:data:`CASES`, checked against the extension by
``test_the_cases_cover_every_method_and_operation``): ``begin`` with hostile :class:`~hotweights.vllm.worker.session.
SessionOptions` (a full update, a delta, and the one-call install with a bucket), ``stage``, ``prepare``, ``commit``,
``abort``, and ``hotweights_engine`` with every operation of ``ENGINE_OPS`` (and unknown ones), its arguments a
hostile JSON object string.

The tests at the end pin the four defects this fuzzing found (all fixed), as minimal reproducers: a bucket that
claimed bytes beyond its manifest (a gap before a tensor), a refused streaming ``begin`` that dropped the delta copy,
a ``cuda_ipc`` descriptor on a CPU build refused with a raw ``AssertionError``, and a rendezvous timeout beyond a
float that dropped the existing group before failing.
Example counts come from the active hypothesis profile (``tests/conftest.py``): 200 per test under ``ci``, 10,000
under ``HYPOTHESIS_PROFILE=slow``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pydantic
import pytest
import torch
from hypothesis import currently_in_test_context, given, settings
from hypothesis import event as _hypothesis_event
from hypothesis import strategies as st
from safetensors.torch import save_file

from hotweights import HotWeightsError, WeightManifestValidationError, WeightUpdateManifest
from hotweights.core.buckets import ALIGNMENT, Bucket, BucketEntry, bucket_problems, pack_into, plan_buckets
from hotweights.core.delta import DeltaBase
from hotweights.core.delta_wire import DeltaManifest
from hotweights.core.manifest import ExpectedWeights, TensorSpec
from hotweights.serve_guard import COLLECTIVE_RPC, GuardConfig, Refusal, check_body
from hotweights.transports import collective, shm, shm_files
from hotweights.vllm import compat
from hotweights.vllm.expected import expected_from_config
from hotweights.vllm.worker import ops as worker_ops
from hotweights.vllm.worker import staging as staging_mod
from hotweights.vllm.worker.extension import ENGINE_OPS, MAX_ARGS, HotWeightsWorkerExtension
from hotweights.vllm.worker.session import PROTOCOL, SessionOptions, session_of

try:
    import msgspec
except ImportError:  # vLLM brings it; without vLLM the msgpack hop is emulated (_emulated_msgpack)
    msgspec = None

#: Only the deadline is set here; max_examples and health checks come from the active profile.
FUZZ = settings(deadline=None)

#: The checkpoint the fake worker serves (float32 engine, tied embeddings: ``lm_head.weight`` is ignored).
CHECKPOINT: dict[str, torch.Tensor] = {
    "model.embed_tokens.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
    "model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4),
    "model.layers.0.mlp.up_proj.weight": torch.full((6, 4), 0.5),
    "model.layers.0.steps": torch.tensor([1, 2], dtype=torch.int64),
    "model.norm.weight": torch.ones(4),
}
OPEN_ID = "fuzz-open"  # the session a case may find open
NEW_ID = "fuzz-new"  # the update id of the well-formed manifests a case sends
AFTER_ID = "fuzz-after"  # the well-formed install after every case
DELTA_ID = "fuzz-delta"

#: What a worker may raise for a hostile call (vLLM sends its text back to the caller); anything else is a crash.
RPC_ERRORS = (ValueError, TypeError, KeyError, RuntimeError, OSError, NotImplementedError, HotWeightsError)
#: Subclasses of those that are no refusal: a raw library error, or the interpreter giving up.
NOT_TYPED = (pydantic.ValidationError, RecursionError, UnicodeError, MemoryError, OverflowError)
GUARD = GuardConfig(None)
HEX32 = "0123456789abcdef"


def event(value: str) -> None:
    """``hypothesis.event``, a no-op outside a hypothesis test (the helpers serve plain tests too)."""
    if currently_in_test_context():
        _hypothesis_event(value)


# ============================================================================================ the worker
class Reached(BaseException):
    """Raised by the watched model, reload, rendezvous and oversized transports: nothing may swallow it."""


class FakeGroup:
    """A collective group whose broadcasts deliver nothing (the buffer stays as allocated)."""

    def broadcast(self, buffer: torch.Tensor, root: int) -> Any:
        return SimpleNamespace(wait=lambda: None)


class FuzzWorker(HotWeightsWorkerExtension):
    """The extension on a worker that serves ``model_dir``; its model is never there (reaching it raises)."""

    rank = 0

    def __init__(self, model_dir: Path) -> None:
        model_config = SimpleNamespace(
            model=str(model_dir),
            dtype=torch.float32,
            revision=None,
            hf_text_config=SimpleNamespace(tie_word_embeddings=True),
        )
        self.vllm_config = SimpleNamespace(model_config=model_config, load_config=None)
        self.reached: list[tuple[str, Any]] = []

    @property
    def model_runner(self) -> Any:
        self.reached.append(("model", None))
        raise Reached("the worker's model was reached")


@dataclass(frozen=True)
class Fixture:
    """The checkpoint on disk and what is derived from it once per module."""

    model_dir: Path
    expected: ExpectedWeights
    manifest: WeightUpdateManifest  # the checkpoint's, update id NEW_ID
    delta_json: str  # a delta from the checkpoint at version 0 (``model.norm.weight`` changed), update id DELTA_ID
    wire_json: str  # the manifest of its wire tensors
    wire: dict[str, torch.Tensor] = field(default_factory=dict)  # its wire tensors

    @property
    def wire_bucket(self) -> Bucket:
        (bucket,) = plan_buckets(WeightUpdateManifest.from_json(self.wire_json), bucket_bytes=1 << 20)
        return bucket


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    model_dir = tmp_path_factory.mktemp("fuzz-rpc-model")
    save_file(CHECKPOINT, str(model_dir / "model.safetensors"))
    # what a worker did long before any call reaches it: vLLM resolved its platform and imported its request types
    # (both run `uname`/`file` in a subprocess on first use, which opens /dev/null: not the call's doing)
    compat.device_kind()
    importlib.import_module("vllm.sampling_params")
    model_config = FuzzWorker(model_dir).vllm_config.model_config
    expected = expected_from_config(model_config)
    assert expected is not None
    manifest = WeightUpdateManifest.from_state_dict(CHECKPOINT, weight_version=1, update_id=NEW_ID)
    assert expected.mismatches(manifest) == []
    changed = {**CHECKPOINT, "model.norm.weight": torch.full((4,), 2.0)}
    enc = DeltaBase.capture(CHECKPOINT, 0).encode(changed, weight_version=1, update_id=DELTA_ID)
    wire = enc.manifest.wire_manifest(enc.wire)
    assert wire is not None
    return Fixture(model_dir, expected, manifest, enc.manifest.to_json(), wire.to_json(), dict(enc.wire))


def _payload(bucket: Bucket, tensors: Mapping[str, torch.Tensor] = CHECKPOINT) -> bytes:
    data = bytearray(bucket.nbytes)
    if bucket.nbytes:
        pack_into(torch.frombuffer(data, dtype=torch.uint8), bucket, tensors)
    return bytes(data)


def _bytes_descriptor(bucket: Bucket, tensors: Mapping[str, torch.Tensor] = CHECKPOINT) -> dict[str, Any]:
    return {"transport": "bytes", "data": _payload(bucket, tensors), "nbytes": bucket.nbytes}


def _options(manifest: str, **options: Any) -> str:
    """``begin``'s options (JSON), ``method="reload"`` unless given (the fuzz worker has no model to plan on)."""
    return SessionOptions(manifest=manifest, **{"method": "reload", **options}).model_dump_json()


@dataclass(frozen=True)
class PreState:
    """What the worker holds when the hostile call comes."""

    session: bool  # an atomic session OPEN_ID with ``staged`` of its buckets
    bucket_bytes: int
    staged: int
    delta_base: bool  # a delta copy of the checkpoint at version 0 (tracking)
    group: bool  # a collective group (FakeGroup)
    delta_session: bool = False  # (with delta_base, without session) the delta DELTA_ID open, ``staged`` of 1 bucket

    @property
    def open_id(self) -> str | None:
        return OPEN_ID if self.session else DELTA_ID if self.delta_session else None


def _worker(fx: Fixture, pre: PreState) -> tuple[FuzzWorker, list[Bucket]]:
    worker = FuzzWorker(fx.model_dir)
    manifest = fx.manifest.model_copy(update={"update_id": OPEN_ID})
    buckets = plan_buckets(manifest, bucket_bytes=pre.bucket_bytes)
    if pre.delta_base:
        base = session_of(worker).base
        base.tracking = True
        base.remember(fx.manifest.model_copy(update={"weight_version": 0}), list(CHECKPOINT.items()))
    if pre.session:
        assert worker.hotweights_begin(_options(manifest.to_json()))["update_id"] == OPEN_ID
        for bucket in buckets[: pre.staged]:
            assert (
                worker.hotweights_stage(OPEN_ID, bucket.model_dump_json(), _bytes_descriptor(bucket)) == bucket.nbytes
            )
    if pre.delta_session:
        assert pre.delta_base and not pre.session
        opened = worker.hotweights_begin(_options(fx.wire_json, delta=fx.delta_json))
        assert opened["ok"] is True and opened["update_id"] == DELTA_ID, opened
        if pre.staged:
            wire = fx.wire_bucket
            assert (
                worker.hotweights_stage(DELTA_ID, wire.model_dump_json(), _bytes_descriptor(wire, fx.wire))
                == wire.nbytes
            )
    if pre.group:
        worker._hotweights_group = (FakeGroup(), "gloo")  # type: ignore[attr-defined]
    return worker, buckets


def _state(worker: FuzzWorker) -> tuple[Any, ...]:
    """What a refused call must leave as it was: the open session (staging, options, delta, what was prepared), the
    delta copy, the collective group and the pause record."""
    ws = session_of(worker)
    session = ws.staging.session
    group = getattr(worker, "_hotweights_group", None)
    held = [getattr(ws, name, None) for name in ("update_id", "options", "delta", "prepared")]
    return (
        id(session) if session else None,
        tuple(session.staged) if session else (),
        session.nbytes if session else 0,
        *(v if v is None or isinstance(v, str) else id(v) for v in held),
        id(ws.base.copy) if ws.base.copy is not None else None,
        id(group) if group is not None else None,
        str(getattr(worker, "_hotweights_pause_owner", "")),
    )


# ============================================================================================ the watch
@dataclass
class Checked:
    bucket: Bucket
    manifest: WeightUpdateManifest
    size: int
    problems: list[str]


@dataclass
class Watch:
    opened: list[str] = field(default_factory=list)
    checked: list[Checked] = field(default_factory=list)
    transports: list[tuple[dict[str, Any], Checked | None]] = field(default_factory=list)
    writes: list[dict[str, TensorSpec]] = field(default_factory=list)
    rendezvous: list[tuple[Any, ...]] = field(default_factory=list)
    oversized: list[tuple[int, int]] = field(default_factory=list)


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _bound(manifest: WeightUpdateManifest) -> int:
    """The most bytes a bucket of ``manifest`` needs: every tensor, each padded to the alignment."""
    return sum(_aligned(s.expected_nbytes) for s in manifest.tensors.values())


@contextlib.contextmanager
def _watched(worker: FuzzWorker) -> Iterator[Watch]:
    """Record what a call opens, checks, hands to a transport, writes into the model and rendezvous with."""
    watch = Watch()
    real_open = os.open
    real_problems = staging_mod.bucket_problems
    real_receiver = staging_mod.receiver_for

    def recording_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        watch.opened.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else repr(path))
        return real_open(path, flags, *args, **kwargs)

    def recording_problems(bucket: Bucket, manifest: WeightUpdateManifest, size: int) -> list[str]:
        problems = real_problems(bucket, manifest, size)
        watch.checked.append(Checked(bucket, manifest, size, list(problems)))
        return problems

    def recording_receiver(name: str) -> Any:
        receiver = real_receiver(name)

        class Recording(receiver):  # type: ignore[valid-type,misc]
            @classmethod
            def open(cls, typed: Any, owner: Any = None, bucket: Any = None, manifest: Any = None) -> Any:
                desc = typed.to_wire()
                last = watch.checked[-1] if watch.checked else None
                watch.transports.append((dict(desc), last))
                nbytes = desc.get("nbytes")
                if last is not None and isinstance(nbytes, int) and nbytes > _bound(last.manifest):
                    watch.oversized.append((nbytes, _bound(last.manifest)))
                    raise Reached("a bucket larger than its manifest reached the transport")  # not allocated here
                return receiver.open(typed, owner, bucket, manifest)

        return Recording

    def write(worker_: Any, items: Any) -> int:
        watch.writes.append({n: TensorSpec.of(t) for n, t in items})
        raise Reached("the model was written")

    def rendezvous(*args: Any) -> Any:
        watch.rendezvous.append(args)
        raise Reached("a rendezvous was attempted")

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("os.open", recording_open))
        stack.enter_context(mock.patch.object(staging_mod, "bucket_problems", recording_problems))
        stack.enter_context(mock.patch.object(staging_mod, "receiver_for", recording_receiver))
        stack.enter_context(mock.patch.object(worker_ops, "reload_checkpoint_tensors", write))  # full and delta
        stack.enter_context(mock.patch.object(collective, "create_group", rendezvous))
        yield watch


def _ours_in_shm() -> set[str]:
    """This process's files in SHM_DIR (the worker side must never create one)."""
    return {p.name for p in shm_files.SHM_DIR.glob(f"hotweights-{os.getpid()}-*")}


# ============================================================================================ the wire
class WireRefusal(Exception):
    """The call never reaches the engine: vLLM's API server (or msgpack encoder) refuses it first."""


def _jsonable(value: Any) -> Any:
    """What a caller that only has JSON sends instead of bytes: a list of ints."""
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _over_http(body: dict[str, Any]) -> tuple[str, list[Any], dict[str, Any]]:
    """``body`` through the guard (if it passes), vLLM's dev route and the engine-core client's msgpack hop."""
    raw = json.dumps(_jsonable(body)).encode()
    try:
        checked = check_body(COLLECTIVE_RPC, raw, "127.0.0.1", GUARD)
    except Refusal as refusal:
        assert refusal.status in (400, 403) and str(refusal), refusal
        event(f"guard: {refusal.status}")  # an unguarded server hands it on: the worker is fuzzed anyway
    else:
        event("guard: rewritten" if checked is not None else "guard: passed")
        raw = checked if checked is not None else raw
    request = json.loads(raw)  # Starlette's Request.json()
    args, kwargs = tuple(request.get("args", [])), request.get("kwargs", {})
    return _over_msgpack(request["method"], request.get("timeout"), args, kwargs)


def _over_msgpack(method: str, timeout: Any, args: Any, kwargs: Any) -> tuple[str, list[Any], dict[str, Any]]:
    """The engine-core client's utility call ``collective_rpc(method, timeout, args, kwargs)`` as msgpack."""
    call = (0, 1, "collective_rpc", (method, timeout, args, kwargs))
    try:
        decoded = _emulated_msgpack(call) if msgspec is None else msgspec.msgpack.decode(msgspec.msgpack.encode(call))
    except (OverflowError, RecursionError, UnicodeError, TypeError, ValueError) as exc:
        raise WireRefusal(f"{type(exc).__name__}: {exc}") from None
    _, _, _, (method, _, args, kwargs) = decoded
    return method, args, kwargs or {}


def _emulated_msgpack(value: Any, depth: int = 0) -> Any:
    """What a msgpack round trip makes of JSON-like values: tuples become lists; ints beyond 64 bits, strings that are
    not UTF-8 and very deep nesting are refused."""
    if depth > 500:
        raise RecursionError("maximum recursion depth exceeded while serializing an object")
    if isinstance(value, bool) or value is None or isinstance(value, (float, bytes)):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise OverflowError("can't serialize ints < -2**63 or > 2**64 - 1")
        return value
    if isinstance(value, str):
        value.encode()
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [_emulated_msgpack(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {_emulated_msgpack(k, depth + 1): _emulated_msgpack(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


def _deliver(wire: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: Any = None) -> Any:
    if wire == "http":
        body: dict[str, Any] = {"method": method, "args": args, "kwargs": kwargs}
        if timeout is not None:
            body["timeout"] = timeout
        return _over_http(body)
    return _over_msgpack(method, timeout, tuple(args), kwargs)


# ============================================================================================ hostile values
PID_SEGMENT = f"hotweights-{os.getpid()}-" + "0" * 32  # well formed, never created
hostile_text = st.sampled_from(
    [
        "",
        " ",
        ".",
        "..",
        "../x",
        "../../etc/passwd",
        "/",
        "/etc/passwd",
        "a/b",
        "a\\b",
        "..\\..\\x",
        "\x00",
        "w\x00",
        "model.norm.weight\x00",
        "model.norm.weight/..",
        "model/norm/weight",
        "./model.norm.weight",
        "model.norm.weight ",
        "\u202emodel.norm.weight",
        "%2e%2e%2f",
        "~",
        "$HOME",
        "*",
        "\ud800",
        "hotweights-1-" + "f" * 32,
        f"{shm_files.SHM_DIR}/{PID_SEGMENT}",
        "x" * 300,
    ]
) | st.text(max_size=16)
big_ints = (
    st.sampled_from(
        [-1, 0, 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, 2**100, 10**30, -(10**30)]
    )
    | st.integers()
)
json_scalars = st.none() | st.booleans() | big_ints | st.floats() | hostile_text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=20,
)


def _nest(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


deep = st.builds(_nest, st.integers(2, 300), json_scalars)
huge_containers = st.one_of(
    st.integers(1_000, 50_000).map(lambda n: [0] * n),
    st.integers(500, 3_000).map(lambda n: {f"k{i}": i for i in range(n)}),
)
huge = huge_containers | st.integers(10_000, 1_000_000).map(lambda n: "a" * n)
garbage = json_values | deep | huge
not_text = (
    st.none() | st.booleans() | big_ints | st.floats() | st.lists(json_values, max_size=4) | deep | huge_containers
)


def _label(value: Any) -> str:
    """A short name for a value in the statistics."""
    return repr(value[:24]) if isinstance(value, str) else type(value).__name__


hostile_ids = (
    st.sampled_from(
        [OPEN_ID, f" {OPEN_ID}", OPEN_ID.upper(), [OPEN_ID], {"update_id": OPEN_ID}, DELTA_ID, f"{DELTA_ID}\x00"]
    )
    | garbage
)
install_methods = st.sampled_from(["auto", "direct", "reload", "Reload", "", "../reload", "streaming"]) | garbage
hostile_transports = (
    st.sampled_from(
        ["", "BYTES", "shm ", "../shm", "shm/", "shm\x00", "hotweights.transports.shm", "os", "__init__", "base"]
    )
    | garbage
)


def _wrong_dtype(spec: TensorSpec) -> st.SearchStrategy[Any]:
    return st.sampled_from(["torch.float16", "torch.int8", "torch.bool", "../float32", "float33", "", 5, None]).filter(
        lambda d: d != spec.dtype
    )


MUST_REFUSE = ("rename", "shape", "dtype", "nbytes", "drop", "extra", "many", "not-a-string", "text")
MAYBE = ("none", "update_id", "version", "metadata", "nest")


@st.composite
def manifests(draw: st.DrawFn, base: WeightUpdateManifest) -> tuple[Any, str]:
    """A manifest argument derived from the checkpoint's, and the mutation made (``MUST_REFUSE`` ones are wrong
    for this worker whatever else holds)."""
    doc = json.loads(base.to_json())
    tensors: dict[str, Any] = doc["tensors"]
    how = draw(st.sampled_from(MUST_REFUSE + MAYBE))
    name = draw(st.sampled_from(sorted(tensors)))
    spec = base.tensors[name]
    if how == "rename":
        new = draw(
            st.sampled_from(
                [f"{name}/../x", f"../{name}", name.replace(".", "/"), f"{name}\x00", f"/{name}", name + "."]
            )
            | hostile_text.filter(lambda s: s not in tensors and s != "lm_head.weight")
        )
        doc["tensors"] = {(new if n == name else n): s for n, s in tensors.items()}
    elif how == "shape":
        tensors[name]["shape"] = draw(
            st.sampled_from([[10**30], [-1], [2**63], [[1]], "4", [4, 4, 4, 4], [], [0]]).filter(
                lambda s: s != list(spec.shape)
            )
            | deep
            | st.integers(1_000, 5_000).map(lambda n: [1] * n)
        )
    elif how == "dtype":
        tensors[name]["dtype"] = draw(_wrong_dtype(spec))
    elif how == "nbytes":
        tensors[name]["nbytes"] = draw(big_ints.filter(lambda n: n != spec.expected_nbytes) | st.booleans())
    elif how == "drop":
        del tensors[name]
    elif how == "extra":
        extra = draw(hostile_text.filter(lambda s: s not in tensors and s != "lm_head.weight"))
        tensors[extra] = {"shape": [1], "dtype": "torch.float32"}
    elif how == "many":
        n = draw(st.integers(100, 5_000))
        tensors.update({f"model.layers.{i}.extra.weight": {"shape": [1], "dtype": "torch.float32"} for i in range(n)})
    elif how == "update_id":
        doc["update_id"] = draw(hostile_text | big_ints | st.just("a" * 129))
    elif how == "version":
        doc["weight_version"] = draw(big_ints | st.floats() | hostile_text)
    elif how == "metadata":
        doc["metadata"] = draw(st.dictionaries(hostile_text, json_scalars, max_size=8) | huge | json_values)
    elif how == "nest":
        doc[draw(st.sampled_from(["tensors", "metadata", "layout", "update_id"]))] = draw(deep)
    if how == "not-a-string":
        return draw(st.sampled_from([doc, [doc], None, 1, True]) | not_text), how
    if how == "text":
        text = json.dumps(doc)
        cut = draw(st.integers(0, len(text) - 1))
        return draw(st.sampled_from([text[:cut], text[:cut] + "\x00" + text[cut + 1 :], "{" * 5000, "", "null"])), how
    try:
        return json.dumps(doc), how
    except (RecursionError, ValueError):  # too deep for this process's json: what such a caller sends is garbage
        return "{" * 5000, "text"


BUCKET_MUTATIONS = ("none", "rename", "offset", "gap", "nbytes", "index", "entries", "extra", "not-a-string", "text")


@st.composite
def buckets(draw: st.DrawFn, bucket: Bucket) -> tuple[Any, int]:
    """A bucket argument derived from ``bucket``, and the byte count a matching descriptor declares."""
    doc = json.loads(bucket.model_dump_json())
    entries: list[dict[str, Any]] = doc["entries"]
    how = draw(st.sampled_from(BUCKET_MUTATIONS))
    at = draw(st.integers(0, len(entries) - 1))
    if how == "rename":
        entries[at]["name"] = draw(
            st.sampled_from([entries[at]["name"] + "/..", "../" + entries[at]["name"], entries[at]["name"] + "\x00"])
            | hostile_text
        )
    elif how == "offset":
        entries[at]["offset"] = draw(big_ints | st.floats() | hostile_text)
    elif how == "gap":  # padding the manifest does not account for, before the last tensor
        k = draw(st.sampled_from([1, 2, 1 << 10, 1 << 24, 1 << 34, 1 << 50]))
        entries[-1]["offset"] += k * ALIGNMENT
        doc["nbytes"] += k * ALIGNMENT
    elif how == "nbytes":
        target = draw(st.sampled_from(["bucket", "entry"]))
        value = draw(big_ints | st.floats() | hostile_text | st.booleans())
        if target == "bucket":
            doc["nbytes"] = value
        else:
            entries[at]["nbytes"] = value
    elif how == "index":
        doc["index"] = draw(big_ints | hostile_text | st.booleans() | st.none())
    elif how == "entries":
        doc["entries"] = draw(
            st.sampled_from([[], [entries[0]] * 2, None, "entries"])
            | st.integers(1_000, 20_000).map(lambda n, e=entries[0]: [e] * n)
            | deep
        )
    elif how == "extra":
        doc[draw(hostile_text.filter(lambda k: k not in doc))] = draw(json_scalars)
    nbytes = doc["nbytes"] if isinstance(doc.get("nbytes"), int) else bucket.nbytes
    if how == "not-a-string":
        return draw(st.sampled_from([doc, [doc], None, 0]) | not_text), nbytes
    if how == "text":
        text = bucket.model_dump_json()
        return draw(st.sampled_from([text[: len(text) // 2], "[]", "{}", "null", "[" * 5000]) | hostile_text), nbytes
    try:
        return json.dumps(doc), nbytes
    except (RecursionError, ValueError):
        return "[" * 5000, nbytes


SHM_PATHS = (
    f"{shm_files.SHM_DIR}/{PID_SEGMENT}",
    f"{shm_files.SHM_DIR}/../{shm_files.SHM_DIR.name}/{PID_SEGMENT}",
    f"{shm_files.SHM_DIR}/./{PID_SEGMENT}",
    f"/{shm_files.SHM_DIR}/{PID_SEGMENT}",
    f"{shm_files.SHM_DIR}/sub/{PID_SEGMENT}",
    f"{shm_files.SHM_DIR}/{PID_SEGMENT}/",
    f"{shm_files.SHM_DIR}/{PID_SEGMENT}\x00",
    f"{shm_files.SHM_DIR}/{PID_SEGMENT}x",
    PID_SEGMENT,
    f"./{PID_SEGMENT}",
    f"../{PID_SEGMENT}",
    str(shm_files.SHM_DIR),
    f"{shm_files.SHM_DIR}/",
    f"{shm_files.SHM_DIR}/..",
    "/etc/passwd",
    "/proc/self/mem",
    "/dev/zero",
    "/tmp",
    f"/tmp/{PID_SEGMENT}",
    "",
    ".",
    "..",
    "~/x",
    f"{shm_files.SHM_DIR}/hotweights-1-" + "0" * 31,
    f"{shm_files.SHM_DIR}/hotweights--" + "0" * 32,
    f"{shm_files.SHM_DIR}/hotweights-1-" + "A" * 32,
)


@st.composite
def descriptors(
    draw: st.DrawFn, bucket: Bucket | None, nbytes: int, tensors: Mapping[str, torch.Tensor] = CHECKPOINT
) -> dict[str, Any] | Any:
    """A descriptor for a bucket of ``nbytes`` bytes (of ``tensors``), with one or more hostile fields."""
    transport = draw(st.sampled_from(["bytes", "bytes", "shm", "shm", "collective", "cuda_ipc", "hostile"]))
    desc: dict[str, Any] = {"nbytes": nbytes}
    if transport == "hostile":
        desc["transport"] = draw(hostile_transports)
    else:
        desc["transport"] = transport
    if transport == "bytes":
        good = (
            _payload(bucket, tensors)
            if bucket is not None and bucket.nbytes == nbytes
            else bytes(max(0, min(nbytes, 4096)))
        )
        desc["data"] = draw(
            st.sampled_from([good, good[:-1], good + b"\0", bytearray(good)])
            | st.binary(max_size=300)
            | garbage
            | st.just(list(good))
        )
    elif transport == "shm":
        desc["path"] = draw(st.sampled_from(SHM_PATHS) | hostile_text | garbage)
        if draw(st.booleans()):
            desc["segment"] = draw(st.sampled_from(["0" * 32, "0" * 31, "../" + "0" * 29, "F" * 32]) | garbage)
    elif transport == "cuda_ipc":
        desc.update({"gpu_uuid": draw(garbage), "share": draw(garbage), "tensor_offset": draw(big_ints)})
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["nbytes", "extra", "drop"]))
        if how == "nbytes":
            desc["nbytes"] = draw(big_ints | st.floats() | st.booleans() | hostile_text | st.none())
        elif how == "extra":
            desc[draw(hostile_text)] = draw(garbage)
        elif desc:
            del desc[draw(st.sampled_from(sorted(desc)))]
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([[desc], None, "bytes", 0]) | st.just(list(desc.items())))
    return desc


# ============================================================================================ hostile options
commits = st.sampled_from(["atomic", "streaming", "Atomic", "atomic "]) | garbage
OPTIONS_MUTATIONS = ("none",) * 6 + ("extra", "drop", "not-a-string", "text")


@st.composite
def session_options(
    draw: st.DrawFn, manifest: st.SearchStrategy[Any], delta: st.SearchStrategy[Any] | None = None
) -> tuple[Any, str]:
    """``begin``'s options (:class:`SessionOptions` JSON) around a manifest drawn from ``manifest`` (and a delta),
    every other field hostile at times; and the mutation made to the options themselves."""
    doc: dict[str, Any] = {"manifest": draw(manifest), "commit": draw(commits), "method": draw(install_methods)}
    if delta is not None:
        doc["delta"] = draw(delta)
    for key in ("keep_base", "verify"):
        if draw(st.integers(0, 2)) == 0:
            doc[key] = draw(st.booleans() | garbage)
    how = draw(st.sampled_from(OPTIONS_MUTATIONS))
    if how == "extra":
        doc[draw(st.sampled_from(["update_id", "bucket", "Manifest", "manifest "]) | hostile_text)] = draw(garbage)
    elif how == "drop":
        del doc[draw(st.sampled_from(sorted(doc)))]
    if how == "not-a-string":
        return draw(st.sampled_from([doc, [doc], None, 1, True]) | not_text), how
    try:
        text = json.dumps(doc)
    except (RecursionError, ValueError):  # too deep for this process's json: what such a caller sends is garbage
        return "{" * 5000, "text"
    if how == "text":
        cut = draw(st.integers(0, len(text) - 1))
        cuts = [text[:cut], text[:cut] + "\x00" + text[cut + 1 :], "{" * 5000, "", "null", "[]", '"atomic"']
        return draw(st.sampled_from(cuts) | hostile_text), how
    return text, how


# ============================================================================================ hostile engine ops
ENGINE_ARGS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "status": st.just({}),
    "pause": st.fixed_dictionaries(
        {
            "action": st.sampled_from(["claim", "release", "read", "", "Claim", "release "]) | garbage,
            "owner": st.sampled_from(["", '{"owner": "trainer"}', "x" * 1024, "x" * 1025]) | hostile_text | garbage,
        }
    ),
    "clear_kv_cache": st.just({}),
    "join_group": st.fixed_dictionaries(
        {
            "host": st.sampled_from(["127.0.0.1", "localhost", "::1", "10.0.0.1"]) | hostile_text | garbage,
            "port": st.integers(1, 65535) | big_ints | garbage,
            "world_size": st.sampled_from([2, 1, 0, 4097, 4098]) | big_ints | garbage,
            "backend": st.sampled_from(["gloo", "nccl", "GLOO", "mpi"]) | garbage,
            "timeout": st.sampled_from([1, 60.0, 0, -1, math.inf, math.nan, 1e308, 600.000001]) | big_ints | garbage,
        }
    ),
    "leave_group": st.just({}),
    "release_segments": st.fixed_dictionaries(
        {"ids": st.none() | st.lists(st.sampled_from(["0" * 32, "../x"]) | hostile_text, max_size=5) | garbage}
    ),
    "forget_base": st.just({}),
    "sees_shm": st.fixed_dictionaries(
        {"name": st.sampled_from(["hotweights-proof-" + "0" * 32, "../../etc/passwd", "hotweights-proof-"]) | garbage}
    ),
    "eager_ranks": st.fixed_dictionaries({"on": st.booleans() | garbage}),
}
hostile_ops = (
    st.sampled_from(
        [
            *("", "Status", "status ", "_status", "__class__", "get", "ENGINE_OPS", "join_group\x00", "../status"),
            *("ping", "hotweights_begin", "init_communicator", "delta_track", "pause_owner"),
        ]
    )
    | garbage
)
ENGINE_ARGS_MUTATIONS = ("none",) * 5 + ("extra", "drop", "not-an-object", "text")
#: Argument strings that are no JSON object a worker should read (deep nesting fits well within MAX_ARGS).
BAD_ARGS_JSON = (
    "{",
    "{}}",
    "{'a': 1}",
    "[" * 5000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "{" + " " * MAX_ARGS + "}",
    json.dumps({"k": "x" * MAX_ARGS}),
    "\x00",
    '{"host": NaN, "port": Infinity}',
    '{"ids": ' + "9" * 5000 + "}",
)


@st.composite
def engine_args(draw: st.DrawFn, op: Any) -> tuple[Any, str]:
    """``hotweights_engine``'s ``args_json`` for ``op``: its arguments as a JSON object, hostile at times."""
    args = dict(draw(ENGINE_ARGS[op])) if isinstance(op, str) and op in ENGINE_ARGS else {}
    how = draw(st.sampled_from(ENGINE_ARGS_MUTATIONS))
    if how == "extra":
        keys = st.sampled_from(["worker", "self", "op", "args_json", "ids", "host", "owner", "action"])
        args[draw(keys | hostile_text)] = draw(json_scalars)
    elif how == "drop" and args:
        del args[draw(st.sampled_from(sorted(args)))]
    if how == "not-an-object":
        return draw(st.sampled_from(["[]", "null", "1", '"x"', "true", "[{}]", ""]) | not_text | hostile_text), how
    if how == "text":
        return draw(st.sampled_from(BAD_ARGS_JSON)), how
    try:
        return json.dumps(args), how
    except (RecursionError, ValueError):
        return "[" * 5000, "text"


# ============================================================================================ the cases
#: (method, what the case exercises): the six methods of protocol 2, weighted as the calls they replaced were
#: (stage 8, begin 3, the one-call install 2, then one each), and ``hotweights_engine`` with every operation.
CASES: list[tuple[str, str]] = (
    [("hotweights_stage", "stage")] * 8
    + [("hotweights_begin", "begin")] * 3
    + [("hotweights_begin", "install")] * 2
    + [
        ("hotweights_commit", "commit"),  # was hotweights_finish
        ("hotweights_abort", "abort"),
        ("hotweights_begin", "delta begin"),  # was hotweights_delta_begin (and hotweights_delta_track(True))
        ("hotweights_prepare", "prepare"),  # was hotweights_delta_prepare
        ("hotweights_commit", "delta commit"),  # was hotweights_delta_commit
        ("hotweights_abort", "delta abort"),  # was hotweights_delta_abort
    ]
    + [("hotweights_engine", op) for op in ENGINE_OPS]  # status was ping, join_group init_communicator, ...
    + [("hotweights_engine", "unknown op")]
)
DELTA_KINDS = ("delta begin", "prepare", "delta commit", "delta abort", "forget_base")


@dataclass
class Case:
    pre: PreState
    wire: str
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    timeout: Any
    focus: str  # what was mutated, for the statistics
    kind: str = ""  # which of CASES


def _begin_case(
    draw: st.DrawFn, manifest: st.SearchStrategy[tuple[Any, str]], delta: st.SearchStrategy[Any] | None
) -> tuple[Any, str]:
    """Options around a manifest drawn with its mutation; the focus names the mutation that counts."""
    manifest_value, focus = draw(manifest)
    options, how = draw(session_options(st.just(manifest_value), delta))
    return options, focus if how == "none" else f"options {how}"


@st.composite
def rpc_cases(draw: st.DrawFn, fx: Fixture) -> Case:
    method, kind = draw(st.sampled_from(CASES))
    params = [p for p in inspect.signature(getattr(HotWeightsWorkerExtension, method)).parameters if p != "self"]
    session = draw(st.integers(0, 4)) > 0 if kind in ("stage", "commit") else draw(st.booleans())
    delta_base = draw(st.integers(0, 3)) > 0 if kind in DELTA_KINDS else draw(st.booleans())
    delta_session = not session and delta_base and draw(st.booleans())
    bucket_bytes = draw(st.sampled_from([64, 128, 256, 1 << 20]))
    n_buckets = len(plan_buckets(fx.manifest, bucket_bytes=bucket_bytes))
    pre = PreState(
        session=session,
        bucket_bytes=bucket_bytes,
        staged=draw(st.integers(0, n_buckets - 1)) if session else draw(st.integers(0, 1)) if delta_session else 0,
        delta_base=delta_base,
        group=draw(st.booleans()),
        delta_session=delta_session,
    )
    open_id = pre.open_id or OPEN_ID
    open_buckets = plan_buckets(fx.manifest.model_copy(update={"update_id": OPEN_ID}), bucket_bytes=bucket_bytes)
    checkpoint_manifests = manifests(fx.manifest)
    wire_manifests = st.just((fx.wire_json, "wire")) | checkpoint_manifests
    deltas = st.just(fx.delta_json) | checkpoint_manifests.map(lambda x: x[0])
    focus = "args"
    args: list[Any]
    if kind == "begin":
        options, focus = _begin_case(draw, checkpoint_manifests, None)
        args = [options]
    elif kind == "delta begin":  # as hotweights_delta_begin(delta_json, wire_json) was fuzzed
        wires = st.just((fx.wire_json, "wire")) | garbage.map(lambda g: (g, "garbage wire"))
        options, focus = _begin_case(draw, wires, deltas)
        args = [options]
    elif kind == "install":
        if draw(st.integers(0, 2)) == 0:  # a delta in one call
            whole, tensors = fx.wire_bucket, fx.wire
            options, focus = _begin_case(draw, wire_manifests, deltas)
            focus = f"delta {focus}"
        else:
            whole, tensors = plan_buckets(fx.manifest, bucket_bytes=1 << 20)[0], CHECKPOINT
            options, focus = _begin_case(draw, checkpoint_manifests, None)
        bucket_json, nbytes = draw(buckets(whole)) if draw(st.booleans()) else (whole.model_dump_json(), whole.nbytes)
        args = [options, bucket_json, draw(descriptors(whole, nbytes, tensors))]
    elif method == "hotweights_stage":
        if pre.delta_session and draw(st.booleans()):
            target, tensors = fx.wire_bucket, fx.wire
        else:
            next_bucket = open_buckets[pre.staged if pre.session else 0]
            target = next_bucket if draw(st.integers(0, 4)) else draw(st.sampled_from(open_buckets))
            tensors = CHECKPOINT
        bucket_json, nbytes = (
            draw(buckets(target)) if draw(st.booleans()) else (target.model_dump_json(), target.nbytes)
        )
        desc = draw(descriptors(target, nbytes, tensors))
        args = [open_id if draw(st.integers(0, 3)) else draw(hostile_ids), bucket_json, desc]
        focus = f"stage {_label(desc.get('transport')) if isinstance(desc, dict) else 'not-a-dict'}"
    elif method in ("hotweights_commit", "hotweights_prepare", "hotweights_abort"):
        args = [open_id if draw(st.booleans()) else draw(hostile_ids | garbage)]
    else:  # hotweights_engine
        op = draw(hostile_ops) if kind == "unknown op" else kind
        args_json, focus = draw(engine_args(op))
        args = [op, args_json]
        focus = f"{_label(op)} {focus}"
    # vLLM takes any arity and any keyword: sometimes too few or too many, sometimes the last ones by name
    if draw(st.integers(0, 4)) == 0:
        args = args[: draw(st.integers(0, len(args)))] + draw(st.lists(garbage, max_size=2))
    kwargs: dict[str, Any] = {}
    if args and len(args) <= len(params) and draw(st.integers(0, 3)) == 0:
        take = draw(st.integers(1, len(args)))
        kwargs = dict(zip(params[len(args) - take : len(args)], args[len(args) - take :], strict=True))
        args = args[: len(args) - take]
    if draw(st.integers(0, 9)) == 0:
        kwargs[draw(hostile_text)] = draw(json_scalars)
    timeout = draw(st.none() | st.sampled_from([1, 600, 601, -1, math.inf, math.nan, "1"]))
    return Case(pre, draw(st.sampled_from(["http", "msgpack"])), method, args, kwargs, timeout, focus, kind)


# ============================================================================================ the checks
@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    reached: str | None = None
    watch: Watch = field(default_factory=Watch)
    left: set[str] = field(default_factory=set)


def _run(worker: FuzzWorker, method: str, args: list[Any], kwargs: dict[str, Any]) -> Outcome:
    """vLLM's ``run_method`` on the worker, watched."""
    out = Outcome()
    before = _ours_in_shm()
    with _watched(worker) as out.watch:
        try:
            func = getattr(worker, method)
            out.value = func(*args, **kwargs)
        except Reached as reached:
            out.reached = str(reached)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            out.error = exc
    out.left = _ours_in_shm() - before
    return out


def _bound_args(method: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by parameter name (defaults applied); None when they do not bind."""
    sig = inspect.signature(getattr(HotWeightsWorkerExtension, method))
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _accepted(fx: Fixture, manifest_json: Any) -> bool:
    """Whether the worker must accept this manifest: it parses and matches the checkpoint it serves."""
    try:
        manifest = WeightUpdateManifest.from_json(manifest_json)
    except (HotWeightsError, TypeError, ValueError):
        return False
    return not fx.expected.mismatches(manifest)


def _options_of(options_json: Any) -> SessionOptions | None:
    """The session options a worker reads from ``options_json``; None when they are malformed."""
    if not isinstance(options_json, str):
        return None
    try:
        return SessionOptions.parse(options_json)
    except ValueError:
        return None


def _delta_accepted(fx: Fixture, options: SessionOptions | None) -> bool:
    """Whether ``options`` open the fixture's delta with its own wire manifest (what a worker holding its base
    installs)."""
    if options is None or options.delta is None:
        return False
    try:
        delta, wire = DeltaManifest.from_json(options.delta), WeightUpdateManifest.from_json(options.manifest)
    except (HotWeightsError, TypeError, ValueError):
        return False
    return delta == DeltaManifest.from_json(fx.delta_json) and wire == WeightUpdateManifest.from_json(fx.wire_json)


def _engine_call(bound: dict[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """The ``hotweights_engine`` operation a call runs, with its arguments; None when the worker must refuse it."""
    if bound is None:
        return None
    op, raw = bound.get("op"), bound.get("args_json")
    if not isinstance(op, str) or op not in ENGINE_OPS or not isinstance(raw, str) or len(raw) > MAX_ARGS:
        return None
    try:
        args = json.loads(raw or "{}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(args, dict):
        return None
    try:
        inspect.signature(ENGINE_OPS[op]).bind(None, **args)
    except TypeError:
        return None
    return op, args


def _rendezvous_args_ok(args: tuple[Any, ...]) -> bool:
    host, port, rank, world, backend, timeout = args
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (port, rank, world))
    return (
        isinstance(host, str)
        and bool(host)
        and ints
        and 1 <= port <= 65535
        and 1 <= rank < world <= 1 + collective.MAX_WORKERS
        and backend in ("gloo", "nccl")
        and isinstance(timeout, float)
        and 0 < timeout <= collective.max_timeout()
    )


def _check_outcome(fx: Fixture, case: Case, out: Outcome, before: tuple[Any, ...], worker: FuzzWorker) -> None:
    bound = _bound_args(case.method, case.args, case.kwargs)
    begin = case.method == "hotweights_begin" and bound is not None
    options = _options_of(bound.get("options_json")) if begin and bound is not None else None
    manifest_ok = options is not None and options.delta is None and _accepted(fx, options.manifest)
    uid = bound.get("update_id") if bound is not None else None
    install = begin and bound is not None and bool(bound.get("bucket_json"))
    # a delta that may be written: the fixture's, in one call to a worker that holds its base, or the one left open
    delta_ok = (install and case.pre.delta_base and _delta_accepted(fx, options)) or (
        case.method == "hotweights_commit" and case.pre.delta_session and isinstance(uid, str) and uid == DELTA_ID
    )
    engine = _engine_call(bound) if case.method == "hotweights_engine" else None
    watch = out.watch

    # 1. a typed error, with a message
    if out.error is not None:
        err = out.error
        assert isinstance(err, RPC_ERRORS) and not isinstance(err, NOT_TYPED), f"{type(err).__name__}: {err}"
        assert str(err).strip(), f"an empty {type(err).__name__}"
        event(f"{case.kind}: {type(err).__name__}")
    elif out.reached is not None:
        event(f"{case.kind}: reached ({out.reached})")
    else:
        event(f"{case.kind}: returned")

    # 2. the model: read for an accepted manifest (or delta) only, written only with a complete, checkpoint-shaped
    #    update (a delta: the blocks it touched, each tensor shaped as in the checkpoint)
    read = [w for w, _ in worker.reached if w == "model"]
    if read:
        by_design = engine is not None and engine[0] == "clear_kv_cache"
        assert by_design or (begin and manifest_ok) or delta_ok, (
            f"{case.kind} reached the model with a manifest the worker does not accept"
        )
    want = {n: (s.shape, s.dtype) for n, s in fx.expected.tensors.items()}
    changed = set(DeltaManifest.from_json(fx.delta_json).entries)
    for written in watch.writes:
        got = {n: (s.shape, s.dtype) for n, s in written.items()}
        if got != want:
            assert delta_ok, f"the model was written with {sorted(written)}"
            assert changed <= set(got) and all(want.get(n) == spec for n, spec in got.items()), (
                f"a delta wrote {sorted(written)}"
            )

    # 3. a rendezvous only with checked arguments
    for rendezvous in watch.rendezvous:
        assert _rendezvous_args_ok(rendezvous), f"a rendezvous with {rendezvous!r:.300}"

    # 4. a transport only for a checked bucket, at its declared size (and, once bounded, within the manifest)
    for desc, checked in watch.transports:
        assert checked is not None and not checked.problems, f"unchecked bucket reached {desc.get('transport')!r}"
        assert not bucket_problems(checked.bucket, checked.manifest, checked.size)  # the library's own, unpatched
        assert desc.get("nbytes") == checked.size == checked.bucket.nbytes
        event(f"transport reached: {desc.get('transport')}")
    assert not watch.oversized, f"an oversized bucket reached the transport: {watch.oversized}"

    # 5. /dev/shm: nothing created, nothing opened but segment names there
    assert not out.left, f"left in {shm_files.SHM_DIR}: {sorted(out.left)}"
    for path in watch.opened:
        p = Path(path)
        assert p.parent == shm_files.SHM_DIR and shm_files.SEGMENT_NAME.fullmatch(p.name), f"opened {path!r}"

    # 6. a refused call keeps the worker's state, where its contract says so: a begin may drop the open session
    #    once its options and manifest are accepted (a delta's: once its options are), a prepare or commit of the
    #    open session may end it; nothing else that is refused changes anything
    if out.error is not None and out.reached is None and bound is not None:
        after = _state(worker)
        may_change = (begin and (manifest_ok or (options is not None and options.delta is not None))) or (
            case.method in ("hotweights_commit", "hotweights_prepare")
            and case.pre.open_id is not None
            and isinstance(uid, str)
            and uid == case.pre.open_id
        )
        if not may_change:
            assert after == before, f"a refused {case.kind} ({case.method}) changed the worker: {before} -> {after}"


def _still_serving(fx: Fixture, worker: FuzzWorker) -> None:
    status = worker.hotweights_engine("status")
    assert status["hotweights"] == "hotweights" and status["protocol"] == PROTOCOL, status
    manifest = fx.manifest.model_copy(update={"update_id": AFTER_ID})
    opened = worker.hotweights_begin(_options(manifest.to_json()))
    assert opened["ok"] is True and opened["update_id"] == AFTER_ID, opened
    for bucket in plan_buckets(manifest, bucket_bytes=128):
        assert worker.hotweights_stage(AFTER_ID, bucket.model_dump_json(), _bytes_descriptor(bucket)) == bucket.nbytes
    assert worker.hotweights_abort(AFTER_ID) is True
    assert worker.reached == []


def test_the_cases_cover_every_method_and_operation() -> None:
    """The fuzzing follows the extension: every ``hotweights_*`` method and every engine operation has its case."""
    methods = {name for name in dir(HotWeightsWorkerExtension) if name.startswith("hotweights_")}
    assert {m for m, _ in CASES} == methods
    assert len(methods) == 6
    assert {kind for m, kind in CASES if m == "hotweights_engine"} == {*ENGINE_OPS, "unknown op"}
    assert set(ENGINE_ARGS) == set(ENGINE_OPS)


# ============================================================================================ 1. every RPC handler
@FUZZ
@given(st.data())
def test_hostile_collective_rpc_calls_end_typed_and_the_worker_keeps_serving(fx: Fixture, data: st.DataObject) -> None:
    case = data.draw(rpc_cases(fx))
    worker, _ = _worker(fx, case.pre)
    try:
        method, args, kwargs = _deliver(case.wire, case.method, case.args, case.kwargs, case.timeout)
    except WireRefusal as refusal:
        event(f"refused on the wire: {str(refusal).split(':')[0]}")
        _still_serving(fx, worker)
        return
    before = _state(worker)
    out = _run(worker, method, args, kwargs)
    _check_outcome(fx, dataclasses.replace(case, method=method, args=args, kwargs=kwargs), out, before, worker)
    event(f"{case.kind} focus: {case.focus}")
    worker.reached.clear()
    _still_serving(fx, worker)


# ============================================================================================ 2. manifests at begin
@FUZZ
@given(st.data())
def test_hostile_manifests_are_refused_at_begin_before_anything_is_kept(fx: Fixture, data: st.DataObject) -> None:
    manifest, how = data.draw(manifests(fx.manifest))
    wire = data.draw(st.sampled_from(["http", "msgpack"]))
    commit = data.draw(st.sampled_from(["atomic", "streaming"]))
    worker, _ = _worker(fx, PreState(session=True, bucket_bytes=128, staged=1, delta_base=False, group=False))
    try:  # the options as a caller writes them, whatever its manifest is (a JSON value that is no string, too)
        options_json = json.dumps({"manifest": manifest, "commit": commit, "method": "reload"})
    except (RecursionError, ValueError):  # too deep for this process's json: what such a caller sends is garbage
        manifest, how = "{" * 5000, "text"
        options_json = json.dumps({"manifest": manifest, "commit": commit, "method": "reload"})
    try:
        method, args, kwargs = _deliver(wire, "hotweights_begin", [options_json], {})
    except WireRefusal:
        event("refused on the wire")
        return
    before = _state(worker)
    out = _run(worker, method, args, kwargs)
    options = _options_of(args[0])
    assert (options is None) == (not isinstance(manifest, str)), "only a manifest that is no string spoils the options"
    accepted = options is not None and _accepted(fx, options.manifest)
    if how in MUST_REFUSE:
        assert not accepted
    if accepted:
        # atomic: the new session is open; streaming: the stream was about to read the model
        assert options is not None
        uid = WeightUpdateManifest.from_json(options.manifest).update_id
        if commit == "atomic":
            assert isinstance(out.value, dict) and out.value["ok"] is True, (out.value, out.error)
            assert out.value["update_id"] == uid and out.value["method"] == "reload"
        else:
            assert out.reached is not None, out.error
        event(f"{how}: accepted")
        return
    if options is None:  # a manifest that is no string: the options it came in are refused as such
        assert isinstance(out.error, ValueError) and not isinstance(out.error, NOT_TYPED), (
            f"{how}: {type(out.error).__name__}: {out.error}"
        )
        assert "malformed session options" in str(out.error) and "manifest" in str(out.error)
        event(f"{how}: refused as malformed options")
    else:
        assert isinstance(out.error, WeightManifestValidationError), f"{how}: {type(out.error).__name__}: {out.error}"
        assert out.error.mismatches and "nothing was written" in str(out.error)
        with contextlib.suppress(HotWeightsError):  # one the worker parsed: the refusal names each made-up tensor
            made_up = set(WeightUpdateManifest.from_json(options.manifest).tensors) - set(fx.expected.tensors)
            assert made_up <= {m.name for m in out.error.mismatches}
            event(f"{how}: refused by the checkpoint check")
    assert worker.reached == [] and not out.watch.writes and not out.left and not out.watch.opened
    assert _state(worker) == before, "a refused begin dropped the open session"
    event(f"{how}: refused")
    _still_serving(fx, worker)


# ============================================================================================ 3. descriptors at stage
#: What a descriptor's refusal names (the field, the transport, or the check).
DESCRIPTOR_WORDS = ("descriptor", "nbytes", "payload", "transport", "refusing", "segment", "bucket", "communicator")


@FUZZ
@given(st.data())
def test_hostile_descriptors_never_map_outside_shm_nor_allocate_unchecked(fx: Fixture, data: st.DataObject) -> None:
    """A bucket that fits the manifest, with a hostile descriptor: only the transport's own checks stand between the
    caller's fields and a mapping or an allocation."""
    pre = PreState(
        session=True,
        bucket_bytes=data.draw(st.sampled_from([64, 1 << 20])),
        staged=0,
        delta_base=False,
        group=data.draw(st.booleans()),
    )
    worker, open_buckets = _worker(fx, pre)
    bucket = open_buckets[0]
    desc = data.draw(descriptors(bucket, bucket.nbytes))
    wire = data.draw(st.sampled_from(["http", "msgpack"]))
    try:
        method, args, kwargs = _deliver(wire, "hotweights_stage", [OPEN_ID, bucket.model_dump_json(), desc], {})
    except WireRefusal:
        event("refused on the wire")
        return
    before = _state(worker)
    out = _run(worker, method, args, kwargs)
    case = Case(pre, wire, method, args, kwargs, None, "descriptor", "stage")
    _check_outcome(fx, case, out, before, worker)
    sent = args[2]
    transport = sent.get("transport") if isinstance(sent, dict) else None
    if out.error is None:  # accepted: only a bytes payload that is exactly the bucket, or a broadcast into it
        assert transport in ("bytes", "collective"), f"accepted a {transport!r} descriptor"
        assert out.value == bucket.nbytes
        if transport == "bytes":
            assert bytes(sent["data"]) == _payload(bucket)
    elif out.reached is None and not isinstance(out.error, (OSError, AssertionError)):  # it says what was wrong
        assert any(word in str(out.error) for word in DESCRIPTOR_WORDS), f"{type(out.error).__name__}: {out.error}"
    event(f"{_label(transport)}: {type(out.error).__name__ if out.error else 'ok'}")
    _still_serving(fx, worker)


# ============================================================================================ the watch itself
@pytest.mark.parametrize("wire", ["http", "msgpack"])
def test_the_watch_sees_what_a_well_formed_call_reaches(fx: Fixture, wire: str) -> None:
    """The properties above are not vacuous: a well-formed install reaches the (watched) model write with exactly the
    checkpoint, a well-formed delta (in one call, or the open one committed) with the blocks it touched; an ``auto``
    begin reads the model; a well-formed shm stage maps the trainer's segment, and nothing of it is left once the
    trainer's transport is done."""
    whole = plan_buckets(fx.manifest, bucket_bytes=1 << 20)[0]
    worker, _ = _worker(fx, PreState(session=False, bucket_bytes=128, staged=0, delta_base=False, group=False))
    call = [_options(fx.manifest.to_json()), whole.model_dump_json(), _bytes_descriptor(whole)]
    out = _run(worker, *_deliver(wire, "hotweights_begin", call, {}))
    if wire == "http":  # JSON carries no bytes: the bytes transport is refused, before the model
        assert out.value is not None and "refused" in out.value and out.reached is None
    else:
        assert out.reached == "the model was written" and len(out.watch.writes) == 1
        assert {n: (s.shape, s.dtype) for n, s in out.watch.writes[0].items()} == {
            n: (s.shape, s.dtype) for n, s in fx.expected.tensors.items()
        }
        assert [(d["transport"], d["nbytes"]) for d, _ in out.watch.transports] == [("bytes", whole.nbytes)]

    changed = set(DeltaManifest.from_json(fx.delta_json).entries)
    wire_bucket = fx.wire_bucket
    delta_call = [
        _options(fx.wire_json, delta=fx.delta_json),
        wire_bucket.model_dump_json(),
        _bytes_descriptor(wire_bucket, fx.wire),
    ]
    pre = PreState(session=False, bucket_bytes=128, staged=0, delta_base=True, group=False)
    worker, _ = _worker(fx, pre)
    method, args, kwargs = _deliver(wire, "hotweights_begin", delta_call, {})
    before = _state(worker)
    out = _run(worker, method, args, kwargs)
    _check_outcome(fx, Case(pre, wire, method, args, kwargs, None, "well-formed", "install"), out, before, worker)
    if wire == "http":
        assert out.value is not None and "refused" in out.value and out.reached is None
    else:
        assert out.reached == "the model was written" and len(out.watch.writes) == 1
        assert changed <= set(out.watch.writes[0]) <= set(fx.expected.tensors)

    pre = PreState(session=False, bucket_bytes=128, staged=1, delta_base=True, group=False, delta_session=True)
    worker, _ = _worker(fx, pre)
    method, args, kwargs = _deliver(wire, "hotweights_commit", [DELTA_ID], {})
    before = _state(worker)
    out = _run(worker, method, args, kwargs)
    _check_outcome(fx, Case(pre, wire, method, args, kwargs, None, "well-formed", "delta commit"), out, before, worker)
    assert out.reached == "the model was written" and len(out.watch.writes) == 1
    assert changed <= set(out.watch.writes[0]) <= set(fx.expected.tensors)

    worker, _ = _worker(fx, PreState(session=False, bucket_bytes=128, staged=0, delta_base=False, group=False))
    out = _run(worker, *_deliver(wire, "hotweights_begin", [_options(fx.manifest.to_json(), method="auto")], {}))
    assert out.reached == "the worker's model was reached" and worker.reached == [("model", None)]

    worker, open_buckets = _worker(
        fx, PreState(session=True, bucket_bytes=128, staged=0, delta_base=False, group=False)
    )
    seen: list[Outcome] = []

    def stage(typed: Any) -> None:
        desc = typed.to_wire()  # as it crosses the RPC
        seen.append(
            _run(worker, *_deliver(wire, "hotweights_stage", [OPEN_ID, open_buckets[0].model_dump_json(), desc], {}))
        )

    with shm.Transport(keep_segments=False) as transport:
        transport.send(open_buckets[0], CHECKPOINT, stage)
    (out,) = seen
    assert out.error is None and out.value == open_buckets[0].nbytes
    (opened,) = out.watch.opened
    assert Path(opened).parent == shm_files.SHM_DIR and shm_files.SEGMENT_NAME.fullmatch(Path(opened).name)
    assert not Path(opened).exists() and opened.rsplit("/", 1)[1] not in _ours_in_shm()
    assert worker.hotweights_abort(OPEN_ID) is True


# ============================================================================================ 4. the guard's bodies
def _join_json(value: Any) -> Any:
    """A ``join_group`` argument string when ``value`` is a dict (JSON-encodable), else ``value`` as it is."""
    if not isinstance(value, dict):
        return value
    try:
        return json.dumps(value)
    except (RecursionError, ValueError):
        return "[" * 5000


#: A rendezvous' arguments as the guard reads them: a JSON object string (hostile host and timeout), or not one.
join_objects = st.fixed_dictionaries(
    {"host": st.sampled_from(["127.0.0.1", "localhost", "::1", "10.0.0.1", "0.0.0.0", "::ffff:10.0.0.1"]) | garbage},
    optional={
        "timeout": st.sampled_from([1, 600, 601, -1, math.inf, math.nan, 1e308, True, None, "60"]) | json_scalars,
        "port": st.integers(1, 65535) | json_scalars,
    },
).map(_join_json)
join_args = join_objects | st.sampled_from(BAD_ARGS_JSON) | garbage
engine_ops = st.sampled_from(["join_group", "join_group", "status", "release_segments", "pause"]) | hostile_ops
guard_bodies = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    st.integers(2, 5_000).map(
        lambda d: ('{"method": "hotweights_engine", "args": ' + "[" * d + "]" * d + "}").encode()
    ),
    st.integers(2, 5_000).map(lambda d: ('{"method": "x", "kwargs": ' + '{"a":' * d + "1" + "}" * d + "}").encode()),
    st.fixed_dictionaries(
        {"method": st.sampled_from(["hotweights_engine", "init_weight_transfer_engine", "hotweights_begin"])},
        optional={
            "args": st.lists(garbage, max_size=6)
            | garbage
            | st.tuples(engine_ops, join_args).map(list)
            | st.tuples(engine_ops, join_args, garbage).map(list)
            | st.tuples(engine_ops).map(list),
            "kwargs": st.dictionaries(
                st.sampled_from(["host", "timeout", "init_info", "x", "op", "args_json"]),
                garbage | engine_ops | join_args,
            )
            | garbage,
            "timeout": json_scalars,
        },
    ).map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    # a rendezvous, its arguments positional or by name, the call's own timeout well-formed or not
    st.fixed_dictionaries(
        {
            "method": st.just("hotweights_engine"),
            "args": st.tuples(st.just("join_group"), join_objects | join_args).map(list),
        },
        optional={"timeout": st.none() | st.sampled_from([1, 600, 601, -1]) | json_scalars},
    ).map(lambda b: json.dumps(b).encode()),
    st.fixed_dictionaries(
        {
            "method": st.just("hotweights_engine"),
            "args": st.sampled_from([[], ["join_group"]]),
            "kwargs": st.fixed_dictionaries(
                {"op": st.just("join_group")}, optional={"args_json": join_objects | join_args}
            ),
        },
        optional={"timeout": st.none() | st.sampled_from([1, 600, 601, -1])},
    ).map(lambda b: json.dumps(b).encode()),
)


def _guarded_join(request: dict[str, Any]) -> Any:
    """The ``join_group`` arguments a worker would read from a ``hotweights_engine`` body (None: no rendezvous)."""
    args, kwargs = request.get("args", []), request.get("kwargs", {})
    op = args[0] if args else kwargs.get("op")
    if request.get("method") != "hotweights_engine" or op != "join_group":
        return None
    return args[1] if len(args) > 1 else kwargs.get("args_json", "{}")


@FUZZ
@given(guard_bodies, st.sampled_from([COLLECTIVE_RPC, "/init_weight_transfer_engine"]))
def test_the_guard_answers_any_body_with_a_refusal_or_a_json_object(body: bytes, path: str) -> None:
    try:
        checked = check_body(path, body, "127.0.0.1", GUARD)
    except Refusal as refusal:
        assert refusal.status in (400, 403) and str(refusal).startswith("hotweights guard:")
        event(f"refused {refusal.status}")
        return
    request = json.loads(checked if checked is not None else body)
    assert isinstance(request, dict)
    if path == COLLECTIVE_RPC:
        timeout = request["timeout"] if checked is not None else json.loads(body).get("timeout")
        assert isinstance(timeout, (int, float)) and 0 <= timeout <= GUARD.max_rpc_timeout
        original = json.loads(body)
        assert set(request) - {"timeout"} == set(original) - {"timeout"}
        assert request["method"] == original["method"] and isinstance(request["method"], str)
        raw = _guarded_join(request)
        if raw is not None:  # a rendezvous passed on: its host is allowed, its timeout (if any) a capped number
            join = json.loads(raw)
            assert isinstance(join, dict)
            assert GUARD.host_allowed(join.get("host"), "127.0.0.1"), join.get("host")
            if "timeout" in join:
                t = join["timeout"]
                assert isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= GUARD.max_rpc_timeout, t
            event("rendezvous passed")
    event("rewritten" if checked is not None else "passed")


# ============================================================================================ pinned defects
def test_a_bucket_cannot_claim_more_bytes_than_its_manifest(fx: Fixture) -> None:
    """``bucket_problems`` bounds every tensor by the manifest but not the padding between them: a bucket that puts
    a manifest's 16-byte tensor at byte 2**40 passes, and the collective transport then allocates 2**40 + 16 bytes
    (``torch.empty`` in ``collective.open_bucket``) on the caller's word."""
    m = fx.manifest
    name = "model.norm.weight"
    huge = 1 << 40
    gap = Bucket(index=0, nbytes=huge + 16, entries=(BucketEntry(name=name, offset=huge, nbytes=16),))
    assert bucket_problems(gap, m, gap.nbytes)


def test_a_refused_streaming_begin_keeps_the_delta_copy(fx: Fixture) -> None:
    worker, _ = _worker(fx, PreState(session=False, bucket_bytes=128, staged=0, delta_base=True, group=False))
    assert session_of(worker).base.copy is not None
    with pytest.raises(WeightManifestValidationError):
        worker.hotweights_begin(_options("not a manifest", commit="streaming"))
    assert session_of(worker).base.copy is not None, "a refused begin dropped the delta copy"


def test_a_cuda_ipc_descriptor_on_a_cpu_build_is_refused_typed(fx: Fixture) -> None:
    worker, open_buckets = _worker(
        fx, PreState(session=True, bucket_bytes=1 << 20, staged=0, delta_base=False, group=False)
    )
    bucket = open_buckets[0]
    desc = {"transport": "cuda_ipc", "nbytes": bucket.nbytes, "gpu_uuid": "x", "share": [], "tensor_offset": 0}
    try:
        worker.hotweights_stage(OPEN_ID, bucket.model_dump_json(), desc)
    except RPC_ERRORS as exc:
        assert not isinstance(exc, NOT_TYPED)


def test_a_rendezvous_timeout_beyond_float_is_refused_and_keeps_the_group(fx: Fixture) -> None:
    """Unreachable over HTTP (msgpack refuses ints beyond 64 bits; the guard caps them), reachable in process: the
    stale group is closed first, then ``float(timeout)`` overflows."""
    worker, _ = _worker(fx, PreState(session=False, bucket_bytes=128, staged=0, delta_base=False, group=True))
    no_rendezvous = mock.patch.object(collective, "create_group", side_effect=AssertionError("no rendezvous expected"))
    join = {"host": "127.0.0.1", "port": 1234, "world_size": 2, "backend": "gloo", "timeout": 10**400}
    with no_rendezvous, contextlib.suppress(ValueError):
        worker.hotweights_engine("join_group", json.dumps(join))
    assert getattr(worker, "_hotweights_group", None) is not None


def test_a_delta_cannot_claim_more_wire_bytes_than_the_model_holds() -> None:
    """A delta's wire tensors are bounded by the worker's copy before anything is staged: a hostile count is refused
    (the collective transport would otherwise allocate it)."""
    from hotweights.core.delta_wire import DeltaEntry

    worker = HotWeightsWorkerExtension()
    base = WeightUpdateManifest.from_state_dict({"w": torch.zeros(4)}, weight_version=0)
    kept = session_of(worker).base
    kept.tracking = True
    kept.remember(base, [("w", torch.zeros(4))])
    huge = DeltaEntry(encoding="sparse", shape=(4,), dtype="torch.float32", count=1 << 40, index_dtype="torch.int32")
    delta = DeltaManifest(weight_version=1, base_version=0, entries={"w": huge})
    wire = WeightUpdateManifest(update_id=delta.update_id, weight_version=1, tensors=delta.wire_specs())
    with pytest.raises(ValueError, match="more than a delta of this model can hold"):
        worker.hotweights_begin(SessionOptions(manifest=wire.to_json(), delta=delta.to_json()).model_dump_json())
    assert session_of(worker).staging.session is None  # nothing staged
