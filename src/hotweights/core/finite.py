"""NaN and Inf found in tensors where their bytes already are (a staged bucket, a file being written), before
anything is written into a model.

One pass per bucket, on the device that holds it: each floating-point tensor is summed in its own dtype (a sum is
non-finite whenever one of its terms is), the sums are stacked and checked with one synchronisation. Only a tensor
whose sum is not finite is counted element by element, so a sum that merely overflowed (a large fp16 tensor) is never
reported. Integer and boolean tensors hold no NaN and are skipped, and so are ``meta`` placeholders (a sharded
state dict's tensors before they are gathered: their bytes are checked where they arrive).

Example:
    >>> import torch
    >>> found = nonfinite([("w", torch.tensor([1.0, float("nan"), float("inf")])), ("b", torch.zeros(2))])
    >>> [str(m) for m in found]
    ["nonfinite mismatch for 'w': expected finite values, got 1 NaN and 1 Inf among 3 values"]
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from hotweights.core.errors import Mismatch, NonFiniteWeightsError

__all__ = ["check_finite", "nonfinite"]


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Mismatch]:
    """A ``nonfinite`` :class:`~hotweights.Mismatch` for each tensor holding NaN or Inf, naming how many of each."""
    floats = [(n, t.detach()) for n, t in tensors if t.is_floating_point() and t.numel() and not t.is_meta]
    if not floats:
        return []
    sums = torch.stack([_sum(t).to(floats[0][1].device) for _, t in floats])
    if bool(torch.isfinite(sums).all()):  # the one synchronisation of a clean bucket
        return []
    found = []
    for (name, t), total in zip(floats, sums.tolist(), strict=True):
        if math.isfinite(total):
            continue
        nan, inf = _count(t)
        if nan or inf:  # else the sum overflowed: every value is finite
            found.append(
                Mismatch("nonfinite", name, "finite values", f"{nan} NaN and {inf} Inf among {t.numel()} values")
            )
    return found


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], context: str = "weight update") -> None:
    """Raise :class:`~hotweights.NonFiniteWeightsError` naming every tensor of ``tensors`` that holds NaN or Inf."""
    found = nonfinite(tensors)
    if found:
        raise NonFiniteWeightsError(found, context)


def _sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` in its own dtype (no copy); in float32 for dtypes torch cannot sum (float8)."""
    try:
        return t.sum().float()
    except (RuntimeError, NotImplementedError):
        return t.float().sum()


def _count(t: torch.Tensor) -> tuple[int, int]:
    try:
        return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    except (RuntimeError, NotImplementedError):
        f = t.float()
        return int(torch.isnan(f).sum()), int(torch.isinf(f).sum())
