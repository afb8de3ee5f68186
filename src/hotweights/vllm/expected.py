"""What a running engine expects to receive: the checkpoint-format tensor specs it was started from.

Read on the trainer's side (:func:`expected_weights`, before anything moves) and again by every worker that runs
the install session (in-process, with hotweights' worker extension or with its backend: :func:`check_manifest`, at
``begin``; the worker holds the facts, so an engine started from a Hub id, or one a remote caller reaches, is
validated too). Both read the same
files: the model directory, or for a Hub id the snapshot vLLM downloaded into the local Hugging Face cache (looked
up offline, never downloaded).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hotweights.core import attach
from hotweights.core.errors import WeightManifestValidationError
from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest, dtype_to_str
from hotweights.vllm import introspect

__all__ = ["check_manifest", "checkpoint_dir", "checkpoint_expected", "expected_from_config", "expected_weights"]

log = logging.getLogger("hotweights")

TIED_LM_HEAD = "lm_head.weight"


def checkpoint_dir(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """The local directory holding ``model``'s safetensors: ``model`` itself when it is one, else the snapshot of
    Hub id ``model`` at ``revision`` in the local Hugging Face cache (``cache_dir``: vLLM's ``--download-dir``).
    None when neither holds any."""
    path = Path(model)
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True))
        except Exception:  # not a Hub id, or not in the cache: nothing to read here
            return None
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


def expected_from_config(model_config: Any, load_config: Any = None) -> ExpectedWeights | None:
    """Specs from the safetensors headers of the checkpoint a vLLM ``ModelConfig`` names, in the engine's dtype.

    Floating-point tensors are expected in the dtype the engine runs in (a bf16 engine takes bf16 tensors);
    others keep their checkpoint dtype. A tied ``lm_head.weight`` is accepted and ignored. None when no local
    checkpoint can be found.
    """
    model_dir = checkpoint_dir(
        str(model_config.model), getattr(model_config, "revision", None), getattr(load_config, "download_dir", None)
    )
    if model_dir is None:
        return None
    tied = introspect.config_ties_embeddings(model_config)
    return checkpoint_expected(model_dir, dtype_to_str(model_config.dtype), tied=tied)


def checkpoint_expected(model_dir: Path, dtype: str | None, *, tied: bool) -> ExpectedWeights:
    """The specs of ``model_dir``'s safetensors, floating-point tensors in ``dtype`` (None or ``""``: as stored);
    ``tied``: a ``lm_head.weight`` the checkpoint lacks is accepted and ignored (the engine reads the embedding)."""
    ckpt = WeightUpdateManifest.from_safetensors(model_dir, weight_version=0)
    specs = {
        name: TensorSpec(shape=s.shape, dtype=dtype) if dtype and s.torch_dtype.is_floating_point else s
        for name, s in ckpt.tensors.items()
    }
    ignored: dict[str, str] = {}
    if tied and TIED_LM_HEAD not in specs:
        ignored[TIED_LM_HEAD] = "tied to the input embedding; the engine reads the embedding"
    model_type, architectures = _model_kind(model_dir)
    return ExpectedWeights(specs, ignored, model_type=model_type, architectures=architectures)


def _model_kind(model_dir: Path) -> tuple[str | None, tuple[str, ...]]:
    """``model_type`` and ``architectures`` of ``model_dir``'s ``config.json`` (None and () where it has none):
    they choose the rules that map a trainer's in-memory names onto the checkpoint's."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None, ()
    if not isinstance(config, dict):
        return None, ()
    model_type = config.get("model_type")
    architectures = config.get("architectures") or ()
    return (
        model_type if isinstance(model_type, str) else None,
        tuple(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else (),
    )


def expected_weights(llm: Any) -> ExpectedWeights | None:
    """What ``llm`` (a ``vllm.LLM`` or ``AsyncLLM``) accepts, read on the trainer's side."""
    return expected_from_config(introspect.engine_model_config(llm), introspect.engine_load_config(llm))


def check_manifest(owner: Any, manifest: WeightUpdateManifest) -> None:
    """Engine side, at ``begin``: refuse a manifest that differs from the checkpoint this worker serves (names,
    shapes, dtypes, hence total bytes), before anything is received or allocated.

    ``owner`` is the worker (or weight-transfer engine) with a ``vllm_config``; its expectation is read once.

    Raises:
        WeightManifestValidationError: every mismatch (it leaves the worker with its envelope, which
            :func:`~hotweights.core.envelope.decode` turns back into this error on the trainer's side).
    """
    config = getattr(owner, "vllm_config", None)
    if config is None:  # not a vLLM worker (a staging area driven by hand): no model to check against
        return

    def read() -> ExpectedWeights | None:
        found = expected_from_config(config.model_config, getattr(config, "load_config", None))
        if found is None:
            log.warning(
                "hotweights: this worker cannot read the checkpoint it serves (no local safetensors for %r), so "
                "updates are checked only on the trainer's side",
                getattr(getattr(config, "model_config", None), "model", None),
            )
        return found

    expected = attach.value(owner, "expected", read)
    if expected is None:
        return
    problems = expected.mismatches(manifest)
    if problems:
        raise WeightManifestValidationError(problems, context="weight update (checked by the engine's worker)")
