"""The proven-family table and the probe's reference (transformers only, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hotweights.core.families import PROVEN, is_proven, release_line
from hotweights.core.gate import ServingGate
from hotweights.core.probe import ProbeReference, probe_tokens, reference
from hotweights.testing import ARCHS, build_tiny_model, tiny_config


def _architecture(arch: str) -> str:
    from transformers import AutoModelForCausalLM

    return str(AutoModelForCausalLM._model_mapping[type(tiny_config(arch))].__name__)  # type: ignore[arg-type]


#: Each vLLM line's matrix cells: written by `make test-matrix` (0.32) and `make test-matrix031`.
MATRICES = {("0.32", "cpu"): "architectures.json", ("0.31", "cpu"): "architectures-0.31.json"}


@pytest.mark.parametrize("line", sorted(MATRICES), ids="-".join)
def test_the_proven_table_is_what_the_matrix_recorded_exact_on_every_path(line: tuple[str, str]) -> None:
    """docs/architectures*.json and PROVEN say the same: a family is proven on a vLLM line when every one of its
    variants was exact on every path (a refusal before writing is not wrong)."""
    cells = json.loads((Path(__file__).parents[2] / "docs" / MATRICES[line]).read_text())
    exact: dict[str, bool] = {}
    for variant, paths in cells.items():
        arch = next(a for a in ARCHS if variant.startswith(f"{a}-"))
        ok = all(
            v.startswith(("exact", "refused before writing")) or path == "verify reads back"
            for path, v in paths.items()
        )
        exact[_architecture(arch)] = exact.get(_architecture(arch), True) and ok
    assert {a for a, ok in exact.items() if ok} == set(PROVEN[line])


def test_proven_needs_the_same_release_line_and_device() -> None:
    assert release_line("0.32.1+cpu") == "0.32"
    assert is_proven("Qwen2ForCausalLM", vllm="0.32.1", device="cpu")
    assert not is_proven("Qwen2ForCausalLM", vllm="0.33.0", device="cpu")
    assert not is_proven("Qwen2ForCausalLM", vllm="0.32.0", device="cuda")
    assert (
        not is_proven("GptOssForCausalLM", vllm="0.32.0", device="cpu")
        or "GptOssForCausalLM" in PROVEN[("0.32", "cpu")]
    )
    assert not is_proven(None, vllm="0.32.0", device="cpu")


def test_the_reference_is_the_models_own_log_probabilities_from_either_name_format(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = build_tiny_model("qwen3_moe", 1)
    ids = probe_tokens(model.config.vocab_size)
    logits = model(torch.tensor([ids])).logits[0]
    want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    in_memory = reference(model.config, model.state_dict(), torch.float32)  # fused experts
    model.save_pretrained(tmp_path)
    on_disk = reference(model.config, load_file(str(tmp_path / "model.safetensors")), torch.float32)  # per expert
    assert in_memory.logprobs == pytest.approx(want, abs=1e-5)
    assert on_disk.logprobs == pytest.approx(want, abs=1e-5)
    assert in_memory.judge(want)[0]


def test_a_tiny_model_is_a_function_of_its_seed() -> None:
    """Two builds of one seed hold the same tensors, also those transformers' own init draws: Qwen3-Next's A_log
    differed between builds, so a trainer's fp32 master built again was not the checkpoint it should have been
    (its bf16 conformance check failed on the test, not on hotweights)."""
    for arch in ARCHS:
        one, two = build_tiny_model(arch, 2).state_dict(), build_tiny_model(arch, 2).state_dict()
        assert [n for n in one if not torch.equal(one[n], two[n])] == [], arch


def test_a_window_vllm_cleared_is_full_attention_in_the_reference() -> None:
    """vLLM sets ``sliding_window = None`` on the config it serves from where every layer gets full attention (a
    checkpoint's 0: Qwen2-MoE's default); transformers' Qwen2-MoE then refused to build its masks, so no reference
    could be computed and the default guard refused Qwen2-MoE wherever it is unproven (every GPU, vLLM 0.31, 0.33,
    0.34). The reference now reads None as a window longer than the probe: the same scores, the config untouched."""
    import copy

    model = build_tiny_model("qwen2_moe", 1)
    assert model.config.sliding_window == 0 and not model.config.use_sliding_window
    served = copy.deepcopy(model.config)
    served.sliding_window = None  # vllm/config/model.py: "Some checkpoints set sliding_window to 0 ..."
    want = reference(model.config, model.state_dict(), torch.float32)
    assert reference(served, model.state_dict(), torch.float32).logprobs == want.logprobs
    assert served.sliding_window is None


def test_the_judge_refuses_a_stale_layer_and_missing_answers() -> None:
    a, b = build_tiny_model("qwen2", 1), build_tiny_model("qwen2", 2)
    ref = reference(b.config, b.state_dict(), torch.float32)
    stale = {
        **b.state_dict(),
        "model.layers.1.mlp.down_proj.weight": a.state_dict()["model.layers.1.mlp.down_proj.weight"],
    }
    ok, worst = ref.judge(list(reference(b.config, stale, torch.float32).logprobs))
    assert not ok and worst > ref.tolerance
    assert ref.judge([None] * len(ref.logprobs)) == (False, float("inf"))
    assert not ProbeReference((1, 2), (0.0,), 0.1).judge([])[0]


def test_tensors_that_do_not_fill_the_model_are_named() -> None:
    model = build_tiny_model("qwen2", 1)
    sd = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing"):
        reference(model.config, sd, torch.float32)


def test_a_half_precision_tolerance_follows_the_models_own_rounding_and_still_catches_a_stale_layer() -> None:
    """A fixed bf16 tolerance let a stale layer of a small-weights model through (Gemma's, 0.38 away) and could
    refuse a large model's rounding noise; the bar is now this model's own rounding noise, times NOISE_FACTOR."""
    from hotweights.core.probe import FLOOR_MAX

    for arch in ("qwen2", "gemma2"):
        a, b = build_tiny_model(arch, 1), build_tiny_model(arch, 2)  # type: ignore[arg-type]
        ref = reference(b.config, b.state_dict(), torch.bfloat16)
        assert ref.tolerance >= FLOOR_MAX
        rounded = {k: v.to(torch.bfloat16) for k, v in b.state_dict().items()}
        assert ref.judge(list(reference(b.config, rounded, torch.bfloat16).logprobs))[0], arch  # rounding passes
        stale = {**b.state_dict()}
        for k in stale:
            if "layers.1.mlp" in k:
                stale[k] = a.state_dict()[k]
        assert not ref.judge(list(reference(b.config, stale, torch.float32).logprobs))[0], arch  # a stale layer fails


def test_bf16_tensors_into_a_bf16_engine_are_judged_by_their_own_rounding() -> None:
    """Tensors already in the engine's half precision got the fp32 floor (0.02) as their tolerance while the engine's
    kernels round differently from transformers' bf16 ones (seen: a Qwen3-Next probe refused, 0.155 away). The
    reference now computes in fp32 and the bar is the model's own bf16 rounding, which still catches a stale layer."""
    from hotweights.core.probe import FLOOR_MAX, _model, _scores

    for arch in ("qwen2", "gemma2"):
        a, b = build_tiny_model(arch, 1), build_tiny_model(arch, 2)  # type: ignore[arg-type]
        sent = {k: v.to(torch.bfloat16) for k, v in b.state_dict().items()}
        ref = reference(b.config, sent, torch.bfloat16)
        assert ref.tolerance > FLOOR_MAX, (arch, ref.tolerance)
        fp32 = _model(b.config, {k: v.float() for k, v in sent.items()})
        fp32_compute = [float(x) for x in _scores(fp32, ref.token_ids, torch.float32)]
        bf16_compute = _scores(_model(b.config, sent), ref.token_ids, torch.bfloat16)
        assert ref.judge(fp32_compute)[0] and ref.judge(bf16_compute)[0], arch  # either kernel's rounding passes
        stale = {k: a.state_dict()[k].to(torch.bfloat16) if "layers.1.mlp" in k else v for k, v in sent.items()}
        assert not ref.judge(_scores(_model(b.config, stale), ref.token_ids, torch.bfloat16))[0], (
            arch
        )  # a stale layer fails


def test_an_unproven_family_on_a_paused_scheduler_is_refused_not_probed() -> None:
    """The probe generates, and a generate on a paused scheduler never returns (vLLM keeps it paused after
    ``wake_up(tags=["weights"])`` until the KV cache wakes too; seen: an install that hung): refused before writing.
    Where the weights themselves sleep, the adapter's sleep refusal (the actionable one) comes first."""
    from hotweights import UnprovenFamilyError
    from hotweights._family import check_family
    from hotweights.handles.parts import Pausing, ServedModel

    class Model(ServedModel):
        probes = True

        def config(self) -> object:
            return tiny_config("qwen2")

        def vllm_fixes(self) -> tuple[str, ...] | None:
            return None

        def family(self) -> tuple[str, str, str]:
            return "Qwen2ForCausalLM", "0.34.0", "cuda"

        def dtype(self) -> torch.dtype:
            return torch.float32

    class Paused(Pausing):
        def __init__(self, paused: bool, asleep: bool) -> None:
            super().__init__()
            self.paused, self.asleep = paused, asleep

        def scheduler_paused(self) -> bool | None:
            return self.paused

        def weights_asleep(self) -> bool:
            return self.asleep

    class Handle:
        guards_family = True
        gate = ServingGate()  # no install failed here
        model = Model()

        def __init__(self, paused: bool, asleep: bool) -> None:
            self.pausing = Paused(paused, asleep)

        def describe(self) -> str:
            return "vllm.LLM (in-process)"

    with pytest.raises(UnprovenFamilyError, match=r"scheduler of vllm\.LLM \(in-process\) is paused.*wake the engine"):
        check_family(Handle(paused=True, asleep=False), [], "probe")  # type: ignore[arg-type]
    assert check_family(Handle(paused=False, asleep=False), [], "probe").probe is not None  # type: ignore[arg-type]
    assert check_family(Handle(paused=True, asleep=True), [], "probe").probe is not None  # type: ignore[arg-type]
    trusted = check_family(Handle(paused=True, asleep=False), [], "trust")  # type: ignore[arg-type]
    assert trusted.probe is None and "trusted" in trusted.verdict
