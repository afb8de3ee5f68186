"""The envelope errors cross processes in (``hotweights.core.envelope``): every public error class round-trips as
a dict, as text inside a longer vLLM or HTTP message, and as the object an in-process worker raised; an error that
is not hotweights' own becomes an InstallError naming it; garbage decodes to None. Then the wires, over engines that
hand back what vLLM (in-process, multiprocess) and a remote server hand back."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hotweights.adapters.wires import ExtensionWire, TransferAPIWire
from hotweights.core import envelope
from hotweights.core import errors as errors_module
from hotweights.core.delta import DeltaBase
from hotweights.core.envelope import engine_refusal
from hotweights.core.errors import (
    DeltaBaseMismatchError,
    FleetPartialCommitError,
    HotWeightsError,
    HotWeightsTimeoutError,
    InstallError,
    Mismatch,
    NonFiniteWeightsError,
    StaleWeightVersionError,
    WeightManifestValidationError,
    WeightVersionUnknownError,
)
from hotweights.core.facts import EngineFacts
from hotweights.handles.workers import Workers
from hotweights.vllm.worker.extension import HotWeightsWorkerExtension
from hotweights.vllm.worker.session import SessionOptions

#: A message that the string parsing this envelope replaced misread: a ": " and a "serving " in odd places.
ODD = "serving v3: the engine's worker said: 'serving ' is not a version; DeltaBaseMismatchError: serving v1"


def _sample(cls: type[HotWeightsError]) -> HotWeightsError:
    """One instance of ``cls`` with every typed field set (and an odd message where the message is free)."""
    if cls is DeltaBaseMismatchError:
        return DeltaBaseMismatchError(11, 9, "v10: serving v9")
    if cls is StaleWeightVersionError:
        return StaleWeightVersionError(3, 7)
    if cls is WeightVersionUnknownError:
        return WeightVersionUnknownError(4, RuntimeError(ODD))
    if cls is WeightManifestValidationError:
        found = [
            Mismatch("missing", "model.norm.weight", expected="[128] torch.float32"),
            Mismatch("shape", "a: b", expected="[2, 3]", actual="[3, 2]"),
            Mismatch("manifest", "weight_version", actual=ODD),
        ]
        return WeightManifestValidationError(found, context="delta update (checked by the engine's worker)")
    if cls is NonFiniteWeightsError:
        return NonFiniteWeightsError([Mismatch("nonfinite", "w", "finite values", "1 NaN and 0 Inf among 4 values")])
    if cls is FleetPartialCommitError:
        return FleetPartialCommitError(ODD, report=object())
    return cls(ODD)


ERROR_CLASSES = [
    getattr(errors_module, name)
    for name in errors_module.__all__
    if isinstance(getattr(errors_module, name), type) and issubclass(getattr(errors_module, name), HotWeightsError)
]


def _fields(error: BaseException) -> dict[str, Any]:
    return {k: v for k, v in vars(error).items() if not k.startswith("_")}


def _assert_same(got: HotWeightsError | None, want: HotWeightsError) -> None:
    """The same class, message and typed fields (a field that is not plain data crosses as None)."""
    assert got is not None
    assert type(got) is type(want)
    assert str(got) == str(want)
    plain = {k: (v if k == "mismatches" or envelope._field(v) is not None else None) for k, v in _fields(want).items()}
    assert _fields(got) == plain


def test_every_error_class_has_a_sample() -> None:
    assert {c.__name__ for c in ERROR_CLASSES} >= {"DeltaBaseMismatchError", "InstallError", "HotWeightsError"}
    for cls in ERROR_CLASSES:
        assert type(_sample(cls)) is cls


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_round_trip_as_a_dict(cls: type[HotWeightsError]) -> None:
    error = _sample(cls)
    sent = envelope.encode(error)
    assert set(sent) == {"type", "message", "mismatches", "fields"}
    assert sent["type"] == cls.__name__ and sent["message"] == str(error)
    _assert_same(envelope.decode(sent), error)
    _assert_same(envelope.decode(json.loads(json.dumps(sent))), error)  # as msgpack / HTTP JSON carry it


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_round_trip_as_text_inside_vllm_and_http_messages(cls: type[HotWeightsError]) -> None:
    error = _sample(cls)
    want = _sample(cls)
    leaving = envelope.attach(error)
    assert leaving is error  # the object itself leaves: an in-process caller catches this very class
    rpc = RuntimeError(f"Worker failed with error '{leaving}', please check the stack trace above for the root cause")
    core = Exception(f"Call to collective_rpc method failed: {rpc}")  # vLLM's engine core adds its own words
    http = InstallError(f"the server at http://127.0.0.1:8000 failed worker call 'hotweights_begin' (HTTP 500): {core}")
    for carrier in (leaving, str(leaving), rpc, core, http, str(http) + "\nTraceback (most recent call last): ..."):
        _assert_same(envelope.decode(carrier), want)


def test_the_typed_fields_are_the_real_ones() -> None:
    got = envelope.decode(f"boom: {envelope.to_text(DeltaBaseMismatchError(11, 9, 'v10'))} trailing: serving v1")
    assert isinstance(got, DeltaBaseMismatchError)
    assert (got.requested, got.base, got.serving) == (11, 9, "v10")
    got = envelope.decode(envelope.to_text(StaleWeightVersionError(3, 7)))
    assert isinstance(got, StaleWeightVersionError) and (got.requested, got.active) == (3, 7)
    got = envelope.decode(envelope.to_text(HotWeightsTimeoutError("waited 5 s for 'hotweights_stage'")))
    assert isinstance(got, HotWeightsTimeoutError) and isinstance(got, TimeoutError)
    refused = _sample(WeightManifestValidationError)
    again = engine_refusal(f"Worker failed with error '{envelope.attach(refused)}'")  # the wrapper others call
    assert again is not None and again.mismatches == refused.mismatches and str(again) == str(_sample(type(refused)))
    assert engine_refusal(envelope.to_text(StaleWeightVersionError(3, 7))) is None  # another class: not a refusal


def test_attaching_twice_adds_one_envelope() -> None:
    error = DeltaBaseMismatchError(2, 1, "v9")
    assert envelope.attach(envelope.attach(error)) is error
    assert str(error).count(envelope.MARKER) == 1
    assert envelope.encode(error)["message"] == str(DeltaBaseMismatchError(2, 1, "v9"))  # the marker is not in it


@pytest.mark.parametrize(
    ("raised", "origin", "message"),
    [
        (ValueError("bucket 4 refused before receiving: payload has 40000 bytes"), "ValueError", None),
        (RuntimeError("no open install session 'u1' on this worker (open: None)"), "RuntimeError", None),
        (KeyError("data"), "KeyError", "KeyError: 'data'"),
        (FileNotFoundError(2, "No such file or directory", "/dev/shm/x"), "FileNotFoundError", None),
        (ValueError(), "ValueError", "ValueError: "),  # no message to carry text: carried by an InstallError
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "UnicodeDecodeError", None),
    ],
)
def test_an_error_that_is_not_hotweights_own_becomes_an_install_error(
    raised: BaseException, origin: str, message: str | None
) -> None:
    want = message or f"{origin}: {raised}"
    leaving = envelope.attach(raised)
    got = envelope.decode(f"Worker failed with error '{leaving}', please check the stack trace above")
    assert type(got) is InstallError and got.origin == origin and str(got) == want
    again = envelope.decode(envelope.encode(got))  # and it stays what it is on a second hop (e.g. through Ray)
    assert type(again) is InstallError and again.origin == origin and str(again) == want
    if leaving is not raised:  # the carrier is already the typed error an in-process caller sees
        assert type(leaving) is InstallError and leaving.origin == origin


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        42,
        "",
        "CUDA out of memory",
        RuntimeError("CUDA out of memory"),
        InstallError("a typed error without an envelope is not decoded: it is raised as it is"),
        "[hotweights-error:!!notbase64]",
        "[hotweights-error:bm90IGpzb24]",  # "not json"
        f"[hotweights-error:{_b64(b'[1, 2]')}]",  # JSON, not an object
        f"[hotweights-error:{_b64(b'{}')}]",  # no type, no message
        f"[hotweights-error:{_b64(json.dumps({'type': 3, 'message': 'x'}).encode())}]",
        f"[hotweights-error:{_b64(json.dumps({'type': 'InstallError', 'message': 'x', 'fields': []}).encode())}]",
        f"[hotweights-error:{_b64(b'[' * 100_000)}]",  # too deep for json
        "[hotweights-mismatches:W10=]",  # the marker this envelope replaced
        {"type": "InstallError"},
    ],
)
def test_garbage_decodes_to_none(garbage: object) -> None:
    assert envelope.decode(garbage) is None


def test_a_hostile_envelope_sets_no_machinery() -> None:
    sent = {
        "type": "DeltaBaseMismatchError",
        "message": "m",
        "mismatches": [{"kind": "evil", "name": "x"}, "row"],
        "fields": {"args": ["x", "y"], "__class__": "InstallError", "with_traceback": 1, "requested": {"a": 1}},
    }
    got = envelope.decode(sent)
    assert type(got) is DeltaBaseMismatchError and got.args == ("m",) and str(got) == "m"
    assert got.requested is None  # not plain data: None, never the object sent
    refused = envelope.decode({"type": "WeightManifestValidationError", "message": "m", "mismatches": [{"kind": "x"}]})
    assert isinstance(refused, WeightManifestValidationError) and refused.mismatches == ()


def test_the_last_envelope_wins() -> None:
    inner, outer = InstallError("inner"), StaleWeightVersionError(1, 2)
    text = f"{envelope.to_text(inner)} then {envelope.to_text(outer)}"
    assert type(envelope.decode(text)) is StaleWeightVersionError


# ============================================================================================ across the wires
def _vllm_multiprocess(exc: Exception) -> Exception:
    """What vLLM's multiprocess executor and engine core make of a worker's exception: text."""
    worker = RuntimeError(f"Worker failed with error '{exc}', please check the stack trace above for the root cause")
    return Exception(f"Call to collective_rpc method failed: {worker}")


def _remote(exc: Exception) -> Exception:
    """What ``RemoteHandle`` raises for the server's HTTP 500 on the same failure."""
    return InstallError(f"the server at http://127.0.0.1:8000 failed worker call (HTTP 500): {_vllm_multiprocess(exc)}")


def _in_process(exc: Exception) -> Exception:
    return exc  # the object itself


ENGINE_KINDS: dict[str, Callable[[Exception], Exception]] = {
    "in-process": _in_process,
    "multiprocess": _vllm_multiprocess,
    "remote": _remote,
}


class TextWorkers(Workers):
    """One worker in this process whose failures come back as ``kind`` makes them (the exception object, vLLM's RPC
    text, a server's HTTP 500)."""

    def __init__(self, worker: Any, kind: Callable[[Exception], Exception]) -> None:
        super().__init__()
        self.worker, self.kind = worker, kind

    def call(self, method: str, *args: Any, timeout: float | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        try:
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        except Exception as exc:
            raise self.kind(exc) from None


class TextEngine:
    """An engine handle whose one worker is a :class:`TextWorkers`."""

    facts = EngineFacts(num_workers=1)

    def __init__(self, worker: Any, kind: Callable[[Exception], Exception]) -> None:
        self.workers = TextWorkers(worker, kind)


def _delta_options(requested: int = 11, base: int = 9) -> SessionOptions:
    tensors = {"w": torch.zeros(4)}
    encoded = DeltaBase.capture(list(tensors.items()), base).encode({"w": torch.ones(4)}, weight_version=requested)
    wire = encoded.manifest.wire_manifest()
    return SessionOptions(
        manifest=wire.to_json() if wire is not None else "", delta=encoded.manifest.to_json(), method="reload"
    )


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_a_delta_refused_by_the_extension_arrives_with_its_versions(kind: str) -> None:
    """Before: the begin answer ``{"ok": False, "serving": ...}`` became ``DeltaBaseMismatchError(-1, -1, ...)``."""
    wire = ExtensionWire(TextEngine(HotWeightsWorkerExtension(), ENGINE_KINDS[kind]), timeout=None)  # type: ignore[arg-type]
    with pytest.raises(DeltaBaseMismatchError) as info:
        wire.begin(_delta_options())
    got = info.value
    assert (got.requested, got.base, got.serving) == (11, 9, "a version it keeps no copy of")
    assert str(got) == str(DeltaBaseMismatchError(11, 9, "a version it keeps no copy of"))


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_a_worker_error_that_is_not_hotweights_own_arrives_as_an_install_error_naming_it(kind: str) -> None:
    wire = ExtensionWire(TextEngine(HotWeightsWorkerExtension(), ENGINE_KINDS[kind]), timeout=None)  # type: ignore[arg-type]
    with pytest.raises(InstallError) as info:
        wire.prepare("u1")
    assert info.value.origin == "RuntimeError"
    assert str(info.value) == "RuntimeError: no open install session 'u1' on this worker (open: None)"


class VLLMWorker:
    """vLLM's worker methods of the weight-transfer API, over hotweights' backend."""

    def __init__(self) -> None:
        from hotweights.vllm.worker.transfer_backend import HotWeightsTransferEngine

        config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
        self.engine = HotWeightsTransferEngine(None, config, torch.device("cpu"), None)

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.update_weights(update_info)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_a_delta_refused_by_the_transfer_backend_arrives_with_its_versions(kind: str) -> None:
    """Failed with the string parsing this replaced: the trainer split vLLM's message after a marker, so over a
    multiprocess engine ``serving`` read "a version it keeps no copy of', please check the stack trace above for the
    root cause", and the versions were -1 for every engine kind."""
    wire = TransferAPIWire(TextEngine(VLLMWorker(), ENGINE_KINDS[kind]), timeout=None)  # type: ignore[arg-type]
    with pytest.raises(DeltaBaseMismatchError) as info:
        wire.begin(_delta_options(requested=7, base=5))
    got = info.value
    assert (got.requested, got.base, got.serving) == (7, 5, "a version it keeps no copy of")
    assert str(got) == str(DeltaBaseMismatchError(7, 5, "a version it keeps no copy of"))
