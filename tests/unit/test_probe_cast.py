"""The probe's reference computes in another dtype than the tensors it holds without a copy of the model: each
module's weights are cast while it runs (:func:`hotweights.core.probe.computing_in`), with the numbers of a model
cast whole."""

from __future__ import annotations

import weakref

import pytest
import torch

from hotweights.core import probe
from hotweights.core.cast import CastItems
from hotweights.core.probe import computing_in, probe_tokens
from hotweights.testing import build_tiny_model


@pytest.mark.parametrize(("held", "computed"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_computing_in_another_dtype_equals_the_model_cast_whole(
    held: torch.dtype, computed: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe, "CAST_SLICE_BYTES", 64 << 10)  # the output head and the MLPs in slices too
    built = build_tiny_model("qwen2", 1, dtype=held)
    model = probe._model(built.config, built.state_dict())  # as the reference holds the sent tensors
    ids = torch.tensor([probe_tokens(1000)])
    whole = probe._model(built.config, {k: v.to(computed) for k, v in built.state_dict().items()})  # a cast copy
    with torch.no_grad():
        with computing_in(whole, computed):  # the same slices of the output head (a bf16 product's rounding
            expected = whole(ids).logits  # depends on its shape), no cast
        with computing_in(model, computed):
            got = model(ids).logits
    assert got.dtype == computed
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert {p.dtype for p in model.parameters()} == {held}  # the weights are left as they were
    assert "forward" not in vars(model.lm_head) and not model.lm_head._forward_pre_hooks


def test_a_reference_from_bf16_tensors_holds_them_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_model("qwen2", 1, dtype=torch.bfloat16)
    sd = model.state_dict()
    held = probe._model(model.config, sd)
    sent = {t.data_ptr() for t in sd.values()}
    assert all(p.data_ptr() in sent for p in held.parameters())
    ref = probe.reference(model.config, sd, torch.bfloat16)
    fp32 = probe.reference(model.config, {k: v.float() for k, v in sd.items()}, torch.bfloat16)
    assert ref.logprobs == pytest.approx(fp32.logprobs, abs=1e-5)


def test_a_sharded_update_is_probed_one_module_at_a_time() -> None:
    """The tensors of a sharded state dict are gathered when read (``CastItems`` with a loader): the reference reads
    each module's while it runs and drops them after, never the whole model at once, with the numbers of the
    reference built from the whole tensors."""
    model = build_tiny_model("qwen2", 1)
    sd = model.state_dict()
    placeholders = [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in sd.items()]
    live: dict[int, int] = {}
    most = 0

    def load(name: str, _: torch.Tensor) -> torch.Tensor:
        nonlocal most
        tensor = sd[name].clone()  # "gathered": a new tensor, counted while it lives
        live[id(tensor)] = tensor.nbytes
        weakref.finalize(tensor, live.pop, id(tensor), None)
        most = max(most, sum(live.values()))
        return tensor

    lazy = probe.reference(model.config, CastItems(placeholders, {}, load), torch.bfloat16)
    whole = probe.reference(model.config, sd, torch.bfloat16)
    assert lazy.logprobs == pytest.approx(whole.logprobs, abs=1e-6) and lazy.tolerance == pytest.approx(whole.tolerance)
    total = sum(t.nbytes for t in sd.values())
    largest = max(t.nbytes for t in sd.values())
    assert 0 < most <= largest < total / 2, (most, largest, total)  # one module at a time, never the model
