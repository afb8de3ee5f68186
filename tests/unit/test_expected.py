"""Where the engine's expectation comes from: a model directory or a Hub id's cached snapshot, read on the trainer's
side and again by the worker at ``begin``; a worker's refusal crosses the RPC as text and comes back typed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from hotweights import Mismatch, WeightManifestValidationError, WeightUpdateManifest
from hotweights.core import envelope
from hotweights.core.envelope import engine_refusal
from hotweights.vllm.expected import check_manifest, checkpoint_dir, expected_from_config


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def _hub_cache(cache: Path, repo: str = "acme/tiny", revision: str = "main") -> dict[str, torch.Tensor]:
    """The layout huggingface_hub writes: models--org--name/{refs/<rev>, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / revision).write_text(commit)
    return _checkpoint(root / "snapshots" / commit)


def _config(model: str, dtype: torch.dtype = torch.float32, tie: bool = True, **extra: object) -> SimpleNamespace:
    return SimpleNamespace(
        model=model, dtype=dtype, revision=None, hf_text_config=SimpleNamespace(tie_word_embeddings=tie), **extra
    )


def test_a_hub_id_is_found_in_the_local_cache_offline(tmp_path: Path) -> None:
    _hub_cache(tmp_path)
    found = checkpoint_dir("acme/tiny", cache_dir=str(tmp_path))
    assert found is not None and (found / "model.safetensors").exists()
    assert checkpoint_dir("acme/absent", cache_dir=str(tmp_path)) is None  # never downloaded
    assert checkpoint_dir(str(tmp_path / "nowhere")) is None


def test_expected_from_a_hub_id_engine_in_its_dtype_with_the_tied_head(tmp_path: Path) -> None:
    _hub_cache(tmp_path)
    expected = expected_from_config(_config("acme/tiny", torch.bfloat16), SimpleNamespace(download_dir=str(tmp_path)))
    assert expected is not None
    assert {n: s.dtype for n, s in expected.tensors.items()} == {
        "model.embed_tokens.weight": "torch.bfloat16",
        "model.norm.weight": "torch.bfloat16",
    }
    assert "lm_head.weight" in expected.ignored


def test_the_worker_refuses_a_manifest_that_differs_from_its_checkpoint(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path / "model")
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=_config(str(tmp_path / "model")), load_config=None)
    )
    good = WeightUpdateManifest.from_state_dict(tensors, weight_version=1)
    check_manifest(worker, good)  # passes
    bad = WeightUpdateManifest.from_state_dict(
        {"model.embed_tokens.weight": torch.zeros(1 << 20, 4), "model.evil.weight": torch.zeros(1)}, weight_version=2
    )
    with pytest.raises(WeightManifestValidationError) as info:
        check_manifest(worker, bad)
    found = {(m.kind, m.name) for m in info.value.mismatches}
    assert found == {
        ("shape", "model.embed_tokens.weight"),
        ("unexpected", "model.evil.weight"),
        ("missing", "model.norm.weight"),
    }
    # it leaves the worker with its envelope, and what comes back through vLLM's RPC is text: the trainer rebuilds
    # the same typed error from it
    message = str(info.value)
    leaving = envelope.attach(info.value)
    wrapped = RuntimeError(f"Worker failed with error '{leaving}', please check the stack trace above")
    again = engine_refusal(wrapped)
    assert again is not None and set(again.mismatches) == set(info.value.mismatches)
    assert "checked by the engine's worker" in str(again) and str(again) == message


def test_a_worker_that_cannot_read_its_checkpoint_says_so(caplog: pytest.LogCaptureFixture) -> None:
    worker = SimpleNamespace(vllm_config=SimpleNamespace(model_config=_config("no/such-model"), load_config=None))
    manifest = WeightUpdateManifest.from_state_dict({"w": torch.zeros(1)}, weight_version=1)
    with caplog.at_level("WARNING", logger="hotweights"):
        check_manifest(worker, manifest)
    assert "checked only on the trainer's side" in caplog.text


def test_engine_refusal_ignores_other_errors_and_garbage() -> None:
    assert engine_refusal(RuntimeError("CUDA out of memory")) is None
    assert engine_refusal("[hotweights-mismatches:!!notbase64]") is None
    assert engine_refusal("[hotweights-mismatches:bm90IGpzb24]") is None  # "not json"
    plain = WeightManifestValidationError([Mismatch("missing", "w", expected="[1] torch.float32")])
    assert engine_refusal(plain) is None  # only errors raised for the wire carry the mismatches
