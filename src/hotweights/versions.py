"""Which weight version produced an output: :func:`weight_version_of` and :func:`weight_versions_of`.

vLLM labels every output token with the weight version its engine held when the token was sampled (the label
:func:`hotweights.install` records after each install) and attaches contiguous spans of labels to the *final*
``CompletionOutput`` (``weight_versions: list[WeightVersionSpan]``). This module reads them back as hotweights
versions (ints), for a ``RequestOutput`` from ``LLM.generate`` or ``AsyncLLM.generate`` or one of its
``CompletionOutput``\\ s. It is pure: it never imports vLLM and reads only those attributes.

- One version produced every token (always, unless an install ran with ``pause="keep"`` or ``"recompute"`` while
  the request was in flight): :func:`weight_version_of` returns it, an ``int``.
- Tokens from the weights the engine started with, before any install: ``None`` (vLLM's initial label is
  ``"default"``), the same ``None`` as :attr:`InstallReport.previous_version` for those weights.
- Tokens from two or more versions (``pause="keep"`` or ``"recompute"``): :func:`weight_version_of` raises
  ``ValueError`` instead of picking one, so a mixed output is never taken for a single-version one;
  :func:`weight_versions_of` returns every span (:class:`WeightVersions`: ``first``, ``last``, ``mixed``, ``spans``)
  and what happened to the request's KV cache at each install it crossed (``kv``: ``"kept"`` or ``"recomputed"``).

Example:
    >>> outs = llm.generate(prompts, sampling_params)                      # doctest: +SKIP
    >>> [hotweights.weight_version_of(o) for o in outs]                    # doctest: +SKIP
    [7, 7]
    >>> hotweights.weight_versions_of(out).spans                           # doctest: +SKIP
    (VersionSpan(version=6, start=0, end=12), VersionSpan(version=7, start=12, end=80))
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

__all__ = [
    "INITIAL_LABEL",
    "KvCrossing",
    "VersionSpan",
    "WeightVersions",
    "lora_version_of",
    "weight_version_of",
    "weight_versions_of",
]

INITIAL_LABEL = "default"
"""The label vLLM 0.32's engine core gives its weights until a version is recorded (``EngineCore._weight_version``);
reported as ``None``."""

KvCrossing = Literal["kept", "recomputed", "mixed", "unknown"]
"""What happened to a request's KV cache at the installs it crossed (:attr:`WeightVersions.kv`)."""

#: The pause modes whose installs a request can cross, and what each did to its KV cache.
_KV_OF_MODE = {"keep": "kept", "recompute": "recomputed"}
#: Version -> what its install did to the KV cache of the requests in flight (``keep``/``recompute`` installs made
#: from this process; :func:`record_kv`).
_KV_OF_VERSION: dict[int, str] = {}


def record_kv(version: str, pause: str) -> None:
    """Note that the install of ``version`` ran with ``pause`` (the engine handles call it when they record the
    version): :attr:`WeightVersions.kv` reads it back for a request that crossed that install."""
    if not str(version).isdecimal():
        return
    kv = _KV_OF_MODE.get(pause)
    if kv is None:
        _KV_OF_VERSION.pop(int(version), None)  # nothing in flight crosses a "wait" or "abort" install
    else:
        _KV_OF_VERSION[int(version)] = kv


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of completion ``index`` were sampled by weights ``version`` (None: the
    engine's initial weights)."""

    version: int | None
    start: int
    end: int
    index: int = 0
    """Which completion of the request (``CompletionOutput.index``; 0 unless ``n > 1``)."""


@dataclass(frozen=True)
class WeightVersions:
    """Every weight version that produced an output, as spans over output-token indexes (in completion, then
    token order)."""

    spans: tuple[VersionSpan, ...]
    kv: KvCrossing | None = None
    """What happened to the request's KV cache at the installs it crossed: ``"kept"`` (``pause="keep"``: its tokens
    after the install attended to keys and values computed by the older weights), ``"recomputed"``
    (``pause="recompute"``: prompt and earlier tokens were prefilled again by the new weights), ``"mixed"`` (it
    crossed installs of both kinds), ``"unknown"`` (no install made from this process recorded how: e.g. the
    trainer installed from another process). None: it crossed no install (one version produced every token)."""

    @property
    def versions(self) -> tuple[int | None, ...]:
        """Distinct versions, in the order they first produced a token."""
        return tuple(dict.fromkeys(s.version for s in self.spans))

    @property
    def mixed(self) -> bool:
        """True when more than one version produced the tokens (only with ``pause="keep"`` or ``"recompute"``)."""
        return len(self.versions) > 1

    @property
    def first(self) -> int | None:
        """The version of the first token (None: the engine's initial weights)."""
        return self._only_spans()[0].version

    @property
    def last(self) -> int | None:
        """The version of the last token (None: the engine's initial weights)."""
        return self._only_spans()[-1].version

    def _only_spans(self) -> tuple[VersionSpan, ...]:
        if not self.spans:
            raise ValueError("the output has no tokens, so no weight version produced it")
        return self.spans


def weight_versions_of(output: Any) -> WeightVersions:
    """Every weight version that produced ``output``, span by span, and what happened to its KV cache at each
    install it crossed (:attr:`WeightVersions.kv`).

    Args:
        output: a finished ``RequestOutput`` (every completion's spans, ``n > 1`` included) or one
            ``CompletionOutput``; or a server's answer as JSON (a dict): the response of ``/inference/v1/generate``
            (vLLM's token-in/token-out route, on a server started with ``--enable-scale-out``) or one of its
            ``choices``.

    Raises:
        ValueError: the output is not finished (vLLM attaches the spans to the final output only: with
            ``AsyncLLM.generate`` keep the last one), carries no labels, or a label is not a hotweights version.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> done = NS(index=0, finish_reason="length", weight_versions=[NS(version="6", start=0, end=3),
        ...                                                             NS(version="7", start=3, end=8)])
        >>> v = weight_versions_of(NS(outputs=[done]))
        >>> v.mixed, v.first, v.last, v.versions
        (True, 6, 7, (6, 7))
        >>> record_kv("7", "keep")
        >>> weight_versions_of(NS(outputs=[done])).kv
        'kept'
    """
    completions: Sequence[Any] | None = _field(output, "outputs", None)
    if completions is None:
        completions = _field(output, "choices", None)
    if completions is None:
        completions = [output]
    spans: list[VersionSpan] = []
    for completion in completions:
        labels = _field(completion, "weight_versions", None)
        if labels is None:
            if _field(completion, "finish_reason", None) is None:
                raise ValueError(
                    "this output is not finished: vLLM attaches weight versions to a request's final output only "
                    "(with AsyncLLM.generate, pass the last output it yields)"
                )
            raise ValueError(
                "this output carries no weight versions: the engine reported no label for its tokens (a vLLM "
                "older than 0.32, or an output not produced by generation)"
            )
        index = int(_field(completion, "index", 0))
        spans += [
            VersionSpan(_version(_field(s, "version")), int(_field(s, "start")), int(_field(s, "end")), index)
            for s in labels
        ]
    return WeightVersions(tuple(spans), _crossed(spans))


def _crossed(spans: Sequence[VersionSpan]) -> KvCrossing | None:
    """How the installs between consecutive spans of one completion treated its KV cache (see
    :attr:`WeightVersions.kv`)."""
    seen: set[str] = set()
    for before, after in itertools.pairwise(spans):
        if before.index != after.index or before.version == after.version:
            continue
        kv = _KV_OF_VERSION.get(after.version) if after.version is not None else None
        seen.add(kv or "unknown")
    if not seen:
        return None
    if "unknown" in seen:
        return "unknown"
    return "mixed" if len(seen) > 1 else ("kept" if seen == {"kept"} else "recomputed")


def weight_version_of(output: Any) -> int | None:
    """The weight version that produced every token of ``output``.

    Args:
        output: a finished ``RequestOutput`` or ``CompletionOutput``.

    Returns:
        The ``weight_version`` of the install that produced it, or None for the weights the engine started with.

    Raises:
        ValueError: two or more versions produced its tokens (an install ran with ``pause="keep"`` or ``"recompute"``
            while it was in flight; the message lists the spans, :func:`weight_versions_of` returns them); it has no
            tokens; or see :func:`weight_versions_of`.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> done = NS(index=0, finish_reason="stop", weight_versions=[NS(version="7", start=0, end=5)])
        >>> weight_version_of(NS(outputs=[done]))
        7
        >>> initial = NS(index=0, finish_reason="stop", weight_versions=[NS(version="default", start=0, end=5)])
        >>> weight_version_of(initial) is None
        True
    """
    versions = weight_versions_of(output)
    if versions.mixed:
        spans = ", ".join(
            f"{'initial' if s.version is None else f'v{s.version}'} [{s.start}:{s.end}]" for s in versions.spans
        )
        raise ValueError(
            f"more than one weight version produced this output ({spans}): an install ran with pause='keep' or "
            "'recompute' while it was in flight. Use hotweights.weight_versions_of(output) to read every span."
        )
    return versions.first


#: The directory :func:`hotweights.install_lora` saves each version of an adapter in, which vLLM loads it from.
_LORA_DIR = re.compile(r"^hotweights-\d+-lora-v(\d+)-")


def lora_directory_prefix(weight_version: int) -> str:
    """The name prefix of the directory that version's adapter is saved in (what :func:`lora_version_of` reads)."""
    return f"hotweights-{os.getpid()}-lora-v{weight_version}-"


def lora_version_of(output: Any) -> int | None:
    """The version of the LoRA adapter that produced ``output`` (a ``RequestOutput``): the ``weight_version`` of the
    :func:`hotweights.install_lora` that loaded it; None for an output generated without an adapter, or with one
    hotweights did not install.

    Sound for a request made with any version's ``LoRARequest``, old or new: every version is loaded under an id of
    its own from a directory of its own, never in place, so the request names the weights that served it. The
    base model's version is :func:`weight_version_of`'s.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> lora_version_of(NS(lora_request=NS(lora_path="/dev/shm/hotweights-41-lora-v7-k2x9q")))
        7
        >>> lora_version_of(NS(lora_request=None)) is None
        True
    """
    request = getattr(output, "lora_request", None)
    path = getattr(request, "lora_path", None) or getattr(request, "path", None)
    found = _LORA_DIR.match(PurePath(str(path)).name) if path else None
    return int(found.group(1)) if found else None


def _field(obj: Any, name: str, *default: Any) -> Any:
    """``obj.name``, or ``obj[name]`` for a server's JSON answer (a dict)."""
    if isinstance(obj, Mapping):
        return obj.get(name, *default) if default else obj[name]
    return getattr(obj, name, *default)


def _version(label: object) -> int | None:
    if label == INITIAL_LABEL:
        return None
    try:
        return int(str(label))
    except ValueError:
        raise ValueError(
            f"weight version label {label!r} is not one hotweights records (hotweights records the integer "
            f"weight_version of each install; {INITIAL_LABEL!r} marks the engine's initial weights): it was set "
            "through vLLM's own API"
        ) from None
