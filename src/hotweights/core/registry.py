"""A lazy registry: names mapped to ``"module:attr"`` (or a bare ``"module"``), imported on first use.

hotweights keeps three: transports by name (:mod:`hotweights.transports`), adapters by an engine's route
(:mod:`hotweights.adapters.registry`) and engine handles by engine kind (:mod:`hotweights.handles`). Registering
only records the dotted path, so importing hotweights imports no transport, adapter or vLLM module; the module is
imported when a name is first loaded. A name registered again with another target, or asked for and never
registered, raises an error that lists the names there are. Built-ins are registered at the bottom of the module
that owns the registry.

Example:
    >>> from hotweights.core.registry import LazyRegistry
    >>> codecs = LazyRegistry("codec")
    >>> codecs.register("json", "json:dumps")
    >>> codecs.load("json")([1, 2])
    '[1, 2]'
    >>> codecs.load("yaml")
    Traceback (most recent call last):
    ...
    hotweights.core.errors.HotWeightsError: unknown codec 'yaml'; available: ['json']
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from hotweights.core.errors import HotWeightsError

__all__ = ["LazyRegistry"]


class LazyRegistry(Mapping[str, str]):
    """Names -> dotted targets (``"module:attr"``, or ``"module"`` for the module itself), loaded on first use.

    A read-only mapping of what is registered (``name in registry``, ``registry[name]``, ``sorted(registry)``);
    :meth:`register` adds, :meth:`load` imports.

    Args:
        kind: what the names are, for messages (``"transport"``, ``"route"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._targets: dict[str, str] = {}

    def register(self, name: str, target: str) -> None:
        """Record ``target`` under ``name`` (nothing is imported). Registering the same target again is a no-op.

        Raises:
            ValueError: ``name`` is registered to another target, or ``target`` is not a dotted path.
        """
        module, _, attr = target.partition(":")
        if not module or (":" in target and not attr):
            raise ValueError(f"{self.kind} {name!r}: {target!r} is not 'package.module' or 'package.module:name'")
        taken = self._targets.get(name)
        if taken is not None and taken != target:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {taken}); pick another name "
                f"(registered: {self.names()})"
            )
        self._targets[name] = target

    def load(self, name: str) -> Any:
        """The object registered under ``name``: the module's attribute, or the module; imported on first use.

        Raises:
            HotWeightsError: ``name`` is not registered (the message lists what is).
        """
        target = self._targets.get(name)
        if target is None:
            raise HotWeightsError(f"unknown {self.kind} {name!r}; available: {self.names()}")
        module, _, attr = target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._targets)

    def copy(self) -> LazyRegistry:
        """A registry with the same entries (a test registers into it and throws it away)."""
        other = LazyRegistry(self.kind)
        other._targets = dict(self._targets)
        return other

    def __getitem__(self, name: str) -> str:
        return self._targets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"LazyRegistry({self.kind!r}, {self._targets!r})"
