"""What a running engine expects to receive: the checkpoint-format tensor specs it was started from."""

from __future__ import annotations

from typing import Any

from hotweights.core.manifest import ExpectedWeights, TensorSpec, WeightUpdateManifest, dtype_to_str
from hotweights.engine import compat

__all__ = ["expected_weights"]

TIED_LM_HEAD = "lm_head.weight"


def expected_weights(llm: Any) -> ExpectedWeights | None:
    """Specs from the safetensors headers of the engine's model directory, in the engine's dtype.

    Floating-point tensors are expected in the dtype the engine runs in (a bf16 engine takes bf16 tensors);
    others keep their checkpoint dtype. None when the engine was not loaded from a local directory.
    """
    model_dir = compat.engine_model_dir(llm)
    if model_dir is None or not any(model_dir.glob("*.safetensors")):
        return None
    ckpt = WeightUpdateManifest.from_safetensors(model_dir, weight_version=0)
    dtype = dtype_to_str(compat.engine_dtype(llm))
    specs = {
        name: TensorSpec(shape=s.shape, dtype=dtype) if s.torch_dtype.is_floating_point else s
        for name, s in ckpt.tensors.items()
    }
    ignored: dict[str, str] = {}
    if compat.tie_word_embeddings(llm) and TIED_LM_HEAD not in specs:
        ignored[TIED_LM_HEAD] = "tied to the input embedding; the engine reads the embedding"
    return ExpectedWeights(specs, ignored)
