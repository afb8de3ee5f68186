"""The family probe step of an install (:func:`check_family`): after the write, before generation is let back in,
the engine scores the probe of a family the conformance matrix has not proven (:mod:`hotweights._family`); a
difference fails closed."""

from __future__ import annotations

import logging
import time

from hotweights.adapters.failure import refuse_serving, serving
from hotweights.adapters.protocols import ProbedAdapter
from hotweights.core.errors import FamilyProbeError
from hotweights.core.families import FamilyCheck
from hotweights.core.manifest import WeightUpdateManifest
from hotweights.core.probe import ProbeReference
from hotweights.core.report import PhaseTimer
from hotweights.telemetry import best_effort

__all__ = ["check_family"]

logger = logging.getLogger("hotweights")


def check_family(
    adapter: ProbedAdapter,
    manifest: WeightUpdateManifest,
    family: FamilyCheck | None,
    ref: ProbeReference | None,
    timer: PhaseTimer,
) -> str | None:
    """Score the engine on ``ref``, ``family``'s probe (the write is done, generation still held off); on a
    difference, fail closed and raise :class:`FamilyProbeError`. Returns the report's ``family_check`` line."""
    if family is None or ref is None:
        return None if family is None else family.verdict
    start = time.perf_counter()
    with timer("family_probe"):
        adapter._reset_prefix_cache()  # the probe must not reuse blocks computed with the old weights
        got = adapter._probe_logprobs(ref.token_ids, str(manifest.weight_version))
    ok, worst = ref.judge(got) if got is not None else (False, float("inf"))
    logger.info(
        "hotweights: family probe of %s at v%s: the engine scored it in %.2f s, max |dlogprob| %g (tolerance %g): %s",
        family.architecture,
        manifest.weight_version,
        time.perf_counter() - start,
        worst,
        ref.tolerance,
        "passed" if ok else "it differs, failing closed",
    )
    if ok:
        verdict = f"{family.verdict} at v{manifest.weight_version}: max |dlogprob| {worst:g} <= {ref.tolerance:g}"
        if family.passed is not None:
            family.passed(verdict)
        return verdict
    adapter._delta.base = None
    with best_effort("recover after a failed family probe"):
        adapter._recover()
    reason = (
        f"generation refused: after update {manifest.update_id} (v{manifest.weight_version}) the engine's output "
        f"on the family probe differed from the reference computed from the sent tensors by {worst:g} (tolerance "
        f"{ref.tolerance:g}). A successful install lifts this (unproven='trust' installs without the probe, where "
        "a freshly started engine on the same weights differs as much); else restart the engine."
    )
    refuse_serving(adapter, manifest, reason)
    raise FamilyProbeError(
        f"{family.architecture}: after the write, the engine's output on the family probe differed from the "
        f"reference computed from the sent tensors (log-probabilities off by {worst:g}, tolerance "
        f"{ref.tolerance:g}); {family.verdict}. Generation now fails closed and the active version stays "
        f"{serving(adapter)}. If a freshly started engine on the same weights gives the same output, the reference "
        "is what differs (transformers computes this family otherwise than vLLM), not the install: install again "
        "with unproven='trust' (or HOTWEIGHTS_UNPROVEN=trust), which installs without the probe. If a fresh "
        "engine matches the reference, vLLM's reload of this family is wrong here: restart the engine from a "
        "checkpoint of the new weights, and report it (docs/architectures.md)."
    )
