"""hotweights' state on objects it does not own (a vLLM engine, its client, a worker), under one attribute, and the
patches it makes to them, recorded so that :func:`detach` puts every one back.

Every object hotweights keeps state on carries one attribute, ``_hotweights`` (an :class:`Attachment`): named values
(an engine's handle and gate, a worker's install session, ...) and the patches recorded against it. A patch is
recorded on the object that owns it (the engine, for a patch of its core client), so detaching the engine undoes
every patch hotweights made for it, in reverse order, and drops the values. Nothing here knows vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["ATTR", "Attachment", "attachment", "detach", "get", "patch", "patched", "put", "value"]

T = TypeVar("T")

#: The one attribute hotweights sets on an object it does not own.
ATTR = "_hotweights"
_MISSING = object()
_LOCK = threading.RLock()  # held to create state or apply a patch, never across I/O


@dataclass
class Attachment:
    """What hotweights keeps on one object: named values, and the patches to undo (object, name, what was there)."""

    values: dict[str, Any] = field(default_factory=dict)
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    keys: set[tuple[int, str]] = field(default_factory=set)


def attachment(obj: Any) -> Attachment:
    """``obj``'s attachment, created on first use."""
    found = obj.__dict__.get(ATTR)
    if isinstance(found, Attachment):
        return found
    with _LOCK:
        found = obj.__dict__.get(ATTR)
        if not isinstance(found, Attachment):
            found = Attachment()
            setattr(obj, ATTR, found)
        return found


def get(obj: Any, name: str, default: Any = None) -> Any:
    """The value ``name`` kept on ``obj`` (``default`` where there is none); creates nothing."""
    found = getattr(obj, "__dict__", {}).get(ATTR)
    return found.values.get(name, default) if isinstance(found, Attachment) else default


def put(obj: Any, name: str, item: Any) -> None:
    """Keep ``item`` on ``obj`` as ``name``."""
    attachment(obj).values[name] = item


def value(obj: Any, name: str, make: Callable[[], T]) -> T:
    """The value ``name`` kept on ``obj``, made by ``make()`` once (also when two threads ask first together)."""
    values = attachment(obj).values
    if name in values:
        return values[name]  # type: ignore[no-any-return]
    with _LOCK:
        if name not in values:
            values[name] = make()
        return values[name]  # type: ignore[no-any-return]


def patched(owner: Any, target: Any, name: str) -> bool:
    """Whether ``target.name`` carries a patch recorded on ``owner``."""
    found = getattr(owner, "__dict__", {}).get(ATTR)
    return isinstance(found, Attachment) and (id(target), name) in found.keys


def patch(owner: Any, target: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace ``target.name`` with ``wrap(target.name)``, recorded on ``owner`` (once per target and name: a second
    call changes nothing). False where ``target`` has no callable ``name`` to wrap."""
    with _LOCK:
        if patched(owner, target, name):
            return True
        current = getattr(target, name, None)
        if not callable(current):
            return False
        record = attachment(owner)
        record.patches.append((target, name, target.__dict__.get(name, _MISSING)))
        record.keys.add((id(target), name))
        setattr(target, name, wrap(current))
        return True


def detach(obj: Any) -> int:
    """Undo every patch recorded on ``obj`` (latest first) and drop what hotweights kept on it; the number of
    patches undone. An object hotweights never touched: 0."""
    with _LOCK:
        found = obj.__dict__.pop(ATTR, None)
        if not isinstance(found, Attachment):
            return 0
        for target, name, original in reversed(found.patches):
            if original is _MISSING:
                target.__dict__.pop(name, None)  # the class's own shows through again
            else:
                setattr(target, name, original)
        return len(found.patches)
