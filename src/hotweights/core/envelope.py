"""One envelope for every hotweights error that crosses a process, and one place that decodes it.

An error raised in an engine's worker reaches the trainer in one of three forms: the exception object itself (an
in-process engine), the text vLLM's RPC makes of it (``str(exc)`` inside "Worker failed with error '...'"), or the
text of a remote server's HTTP 500. A refusal the session answers instead of raising (a one-call install's
``{"refused": ...}``) is a JSON value. The envelope carries the same content in every form::

    {"type": "DeltaBaseMismatchError",                       # the class name
     "message": "delta update to v11 was computed against v9, but the engine serves v10; ...",
     "mismatches": [],                                       # WeightManifestValidationError.mismatches, as dicts
     "fields": {"requested": 11, "base": 9, "serving": "v10"}}   # every other public attribute

- :func:`encode` makes it of an exception; :func:`to_text` writes it as ``[hotweights-error:<base64 JSON>]``, a
  marker that survives being embedded in a longer message;
- :func:`attach` appends that text to an exception's own message where the exception leaves the engine (the
  decorator :func:`enveloped` does it for every method that vLLM calls there), so the object an in-process caller
  catches keeps its class, and the text any other caller receives carries the envelope;
- :func:`decode` turns any of the forms back into the typed :class:`~hotweights.HotWeightsError`: the same class,
  message and typed fields. An error that is not hotweights' own (a ``ValueError`` in a worker) becomes an
  :class:`~hotweights.InstallError` whose ``origin`` names the original type. What carries no envelope decodes
  to None.

Nothing here imports vLLM or torch: both sides of every process boundary use this module.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

from hotweights.core import errors as _errors
from hotweights.core.errors import HotWeightsError, InstallError, Mismatch, MismatchKind

__all__ = ["MARKER", "MAX_MISMATCHES", "attach", "decode", "encode", "engine_refusal", "enveloped", "to_text"]

#: Opens the text form of an envelope: ``[hotweights-error:<urlsafe base64 of the JSON>]``.
MARKER = "hotweights-error:"
#: Most mismatches an envelope carries (the message still counts all of them).
MAX_MISMATCHES = 1000

_TEXT_RE = re.compile(r" ?\[" + re.escape(MARKER) + r"([A-Za-z0-9_=-]*)\]")
_KINDS = frozenset(MismatchKind.__args__)  # type: ignore[attr-defined]
_JSON_SCALARS = (str, int, float, bool, type(None))
#: Attribute names an envelope never sets on the error it rebuilds (they belong to the exception machinery).
_RESERVED = frozenset(dir(BaseException)) | {"mismatches"}

Envelope = dict[str, Any]


def _classes() -> dict[str, type[HotWeightsError]]:
    """hotweights' public error classes, by name: what an envelope's ``type`` may name."""
    found: dict[str, type[HotWeightsError]] = {"HotWeightsError": HotWeightsError}
    for name in _errors.__all__:
        value = getattr(_errors, name)
        if isinstance(value, type) and issubclass(value, HotWeightsError):
            found[name] = value
    return found


_CLASSES = _classes()


def _text_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not hide the error it belongs to
        return f"<{type(exc).__name__} whose message could not be read>"


def _message(exc: BaseException) -> str:
    """``str(exc)`` without an envelope :func:`attach` appended to it."""
    return _TEXT_RE.sub("", _text_of(exc))


def _field(value: Any) -> Any:
    """``value`` as JSON, when it is plain data (scalars, or lists of them); None otherwise."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _JSON_SCALARS) for v in value):
        return list(value)
    return None


def encode(exc: BaseException) -> Envelope:
    """The envelope of ``exc``: its class name, message, mismatches (at most :data:`MAX_MISMATCHES`) and every
    other public attribute as ``fields``. A field that is not plain data (``FleetPartialCommitError.report``)
    crosses as None. Never raises."""
    mismatches = getattr(exc, "mismatches", ()) if isinstance(exc, HotWeightsError) else ()
    rows = [dataclasses.asdict(m) for m in mismatches[:MAX_MISMATCHES] if isinstance(m, Mismatch)]
    attributes = getattr(exc, "__dict__", {})
    fields = {
        k: _field(v)
        for k, v in attributes.items()
        if isinstance(k, str) and k.isidentifier() and not k.startswith("_") and k not in _RESERVED
    }
    return {"type": type(exc).__name__, "message": _message(exc), "mismatches": rows, "fields": fields}


def to_text(error: BaseException | Envelope) -> str:
    """The text form of an exception's (or an envelope's) envelope: ``[hotweights-error:<base64 JSON>]``."""
    envelope = error if isinstance(error, dict) else encode(error)
    data = json.dumps(envelope, separators=(",", ":"), default=str).encode()
    return f"[{MARKER}{base64.urlsafe_b64encode(data).decode()}]"


def attach(exc: BaseException) -> BaseException:
    """What to raise for ``exc`` out of the engine's process: ``exc`` itself with its envelope's text appended to
    its message (``str(exc)`` carries it through vLLM's RPC or an HTTP 500; an in-process caller catches the same
    object, of the same class), or, where its message cannot carry text (no single string argument, no
    ``strerror``), an :class:`~hotweights.InstallError` that names it (``origin``) and carries its envelope (raise
    it ``from exc``)."""
    wire = to_text(exc)
    if wire in _text_of(exc):
        return exc  # attached already (it passed another exit on its way out)
    args = exc.args
    if len(args) == 1 and isinstance(args[0], str):
        exc.args = (f"{_TEXT_RE.sub('', args[0])} {wire}",)
        if wire in _text_of(exc):
            return exc
        exc.args = args
    if isinstance(exc, OSError) and isinstance(exc.strerror, str):  # "[Errno 2] No such file: 'path'"
        strerror = exc.strerror
        exc.strerror = f"{strerror} {wire}"
        if wire in _text_of(exc):
            return exc
        exc.strerror = strerror
    carrier = InstallError(f"{type(exc).__name__}: {_message(exc)} {wire}")
    carrier.origin = type(exc).__name__
    return carrier


F = TypeVar("F", bound=Callable[..., Any])


def enveloped(method: F) -> F:
    """Decorate a method that vLLM (or a server) calls in the engine's process: an exception it raises leaves with
    its envelope (:func:`attach`)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            leaving = attach(exc)
            if leaving is exc:
                raise
            raise leaving from exc

    return cast(F, run)


def decode(obj: object) -> HotWeightsError | None:
    """The typed error an envelope carries: ``obj`` is an envelope (dict), an exception whose message carries one
    (the object an in-process worker raised, or the exception vLLM's RPC or a remote handle made of its text), or
    that text itself, however much else surrounds it (the last envelope in it wins: the outermost error). None
    when ``obj`` carries no envelope, or a malformed one.

    The result has the class the envelope names, its message and its typed fields (``requested``, ``base``,
    ``serving``, ``active``, ``mismatches``, ...). A type that is not one of hotweights' public errors (a
    ``ValueError`` raised in a worker) becomes an :class:`~hotweights.InstallError` whose message starts with
    that type's name and whose ``origin`` holds it."""
    if isinstance(obj, dict):
        return _rebuild(obj)
    if isinstance(obj, BaseException):
        obj = _text_of(obj)
    if not isinstance(obj, str):
        return None
    found = list(_TEXT_RE.finditer(obj))
    if not found:
        return None
    try:
        envelope = json.loads(base64.urlsafe_b64decode(found[-1].group(1)))
    except (ValueError, binascii.Error, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return _rebuild(envelope) if isinstance(envelope, dict) else None


def _rebuild(envelope: dict[Any, Any]) -> HotWeightsError | None:
    kind, message = envelope.get("type"), envelope.get("message")
    rows, fields = envelope.get("mismatches", []), envelope.get("fields", {})
    if not (isinstance(kind, str) and isinstance(message, str) and isinstance(rows, list) and isinstance(fields, dict)):
        return None
    cls = _CLASSES.get(kind)
    if cls is None:  # not one of hotweights' errors: an InstallError that names it
        foreign = InstallError(f"{kind}: {message}")
        foreign.origin = kind
        return foreign
    error = cls.__new__(cls, message)  # not __init__: the message is the one the engine wrote, fields follow
    error.args = (message,)
    for name, value in fields.items():
        if isinstance(name, str) and name.isidentifier() and not name.startswith("_") and name not in _RESERVED:
            setattr(error, name, _field(value))
    if isinstance(error, _errors.WeightManifestValidationError):
        error.mismatches = tuple(
            Mismatch(cast(MismatchKind, r["kind"]), *(str(r.get(k, "")) for k in ("name", "expected", "actual")))
            for r in rows
            if isinstance(r, dict) and r.get("kind") in _KINDS
        )
    return error


def engine_refusal(error: BaseException | str) -> _errors.WeightManifestValidationError | None:
    """The :class:`WeightManifestValidationError` an engine's worker raised, rebuilt from what came back (the
    error vLLM's RPC or a remote server made of it, or its text); None when that carries no such error. A thin
    wrapper of :func:`decode`, which rebuilds every error class."""
    found = decode(error)
    return found if isinstance(found, _errors.WeightManifestValidationError) else None
