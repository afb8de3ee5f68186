"""Delta installs without an engine: encoding and applying (fuzzed), every refusal, and the adapter flow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hotweights import (
    DeltaBaseMismatchError,
    EngineNotSupportedError,
    HotWeightsError,
    InstallError,
    WeightManifestValidationError,
    WeightUpdateManifest,
)
from hotweights.adapters import WeightInstallAdapter
from hotweights.adapters.options import PathAbilities
from hotweights.core.delta import DeltaBase, EncodedDelta, StagedDelta, reinstall_names
from hotweights.core.delta_wire import DeltaManifest, delta_problems, sparse_is_smaller
from hotweights.core.report import PhaseTimer

FUZZ = settings(deadline=None)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _changed_copy(t: torch.Tensor, fraction: float, g: torch.Generator) -> torch.Tensor:
    """``t`` with about ``fraction`` of its elements given fresh random bits."""
    out = t.clone()
    flat = out.view(-1)
    mask = torch.rand(flat.numel(), generator=g) < fraction
    fresh = _random((flat.numel(),), t.dtype, g)
    flat[mask] = fresh[mask]
    return out


@st.composite
def updates(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A base state dict and a new one where a random fraction of each tensor's elements changed."""
    n = draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    base, new = {}, {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        t = _random(shape, dtype, g)
        base[f"layers.{i % 3}.w{i}"] = t
        new[f"layers.{i % 3}.w{i}"] = _changed_copy(t, draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0])), g)
    return base, new


# ============================================================================================ encode / apply
@FUZZ
@given(updates())
def test_apply_rebuilds_the_new_tensors_bit_for_bit(update: tuple[dict[str, Any], dict[str, Any]]) -> None:
    old, new = update
    base = DeltaBase.capture(old, version=3)
    before = {n: _raw(t) for n, t in base.tensors.items()}
    delta = base.encode(new, weight_version=4)
    assert delta.manifest.base_version == 3 and delta.manifest.weight_version == 4
    changed = {n for n in new if _raw(new[n]) != _raw(old[n])}
    assert set(delta.manifest.entries) == changed
    assert delta.manifest.unchanged == len(new) - len(changed)
    assert delta.bytes_sent == delta.manifest.bytes_sent == sum(t.nbytes for t in delta.wire.values())
    for name, e in delta.manifest.entries.items():
        t, k = new[name], _raw_diff(old[name], new[name])
        event(e.encoding)
        assert (e.encoding == "sparse") == sparse_is_smaller(k, t.numel(), t.dtype.itemsize)
        assert e.count == (k if e.encoding == "sparse" else t.numel())
    assert delta_problems(delta.manifest, base.specs(), delta.wire) == []
    # the manifest travels as JSON
    again = DeltaManifest.from_json(delta.manifest.to_json())
    assert again == delta.manifest
    staged = base.apply(again, delta.wire)
    assert {n: _raw(t) for n, t in base.tensors.items()} == before  # applied aside
    sender = base.staged(delta)  # the sender's shortcut: same result from the copies encode kept
    assert [n for n, _ in sender.items] == [n for n, _ in staged.items]
    assert all(_raw(sender.changed[n]) == _raw(staged.changed[n]) for n in changed)
    assert all(sender.changed[n].data_ptr() != new[n].data_ptr() for n in changed if new[n].numel())
    for name in changed:
        assert _raw(staged.changed[name]) == _raw(new[name])
    assert [n for n, _ in staged.items] == reinstall_names(changed, list(new))
    base.commit(staged)
    assert base.version == 4
    assert {n: _raw(t) for n, t in base.tensors.items()} == {n: _raw(t) for n, t in new.items()}
    assert base.encode(new, weight_version=5).manifest.entries == {}  # nothing changed since


def _raw_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bytes differ."""
    if a.numel() == 0:
        return 0
    x = a.contiguous().view(-1).view(torch.uint8).view(a.numel(), a.dtype.itemsize)
    y = b.contiguous().view(-1).view(torch.uint8).view(b.numel(), b.dtype.itemsize)
    return int((x != y).any(dim=1).sum())


def test_threshold_is_where_indices_plus_values_outgrow_the_tensor() -> None:
    assert sparse_is_smaller(333, 1000, 2) and not sparse_is_smaller(334, 1000, 2)  # bf16: 1/3
    assert sparse_is_smaller(499, 1000, 4) and not sparse_is_smaller(500, 1000, 4)  # fp32: 1/2
    assert sparse_is_smaller(199, 1000, 2, index_itemsize=8) and not sparse_is_smaller(200, 1000, 2, 8)
    w = torch.zeros(1000, dtype=torch.bfloat16)
    base = DeltaBase.capture({"w": w}, version=1)
    for k, encoding in ((333, "sparse"), (334, "full")):
        new = w.clone()
        new[:k] = 1.0
        e = base.encode({"w": new}, weight_version=2).manifest.entries["w"]
        assert (e.encoding, e.count) == (encoding, k if encoding == "sparse" else 1000)


def test_changes_are_found_bit_by_bit() -> None:
    w = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    base = DeltaBase.capture({"w": w}, version=1)
    new = torch.tensor([-0.0, float("nan"), 1.0, 2.0])  # -0.0 == 0.0 but its bits differ; NaN stays NaN
    delta = base.encode({"w": new}, weight_version=2)
    assert delta.wire["w:indices"].tolist() == [0]
    rebuilt = base.apply(delta.manifest, delta.wire).changed["w"]
    assert _raw(rebuilt) == _raw(new)


def test_sparse_wire_layout() -> None:
    base = DeltaBase.capture({"a": torch.zeros(4, 5), "b": torch.ones(3)}, version=7)
    new_a = torch.zeros(4, 5)
    new_a[1, 2] = 5.0
    new_a[3, 4] = -1.0
    delta = base.encode({"a": new_a, "b": torch.ones(3)}, weight_version=8, update_id="u8", digests=True)
    assert list(delta.wire) == ["a:indices", "a:values"]
    assert delta.wire["a:indices"].dtype == torch.int32
    assert delta.wire["a:indices"].tolist() == [7, 19]
    assert delta.wire["a:values"].tolist() == [5.0, -1.0]
    assert delta.bytes_sent == 16
    m = delta.manifest.wire_manifest(delta.wire)
    assert m is not None and m.update_id == "u8" and m.weight_version == 8
    assert list(m.tensors) == ["a:indices", "a:values"] and m.has_digests
    assert delta.manifest.entries["a"].digest is not None
    assert DeltaManifest(weight_version=2, base_version=1).wire_manifest() is None  # nothing changed


def test_reinstall_names_takes_whole_blocks() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    assert reinstall_names(["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"], names) == [
        names[1],
        names[2],
        names[3],
        names[5],
    ]
    assert reinstall_names([], names) == []


# ============================================================================================ refusals
def _valid() -> tuple[DeltaBase, EncodedDelta]:
    g = torch.Generator().manual_seed(0)
    old = {"layers.0.w": _random((8, 8), torch.bfloat16, g), "layers.1.w": _random((6,), torch.float32, g)}
    new = {"layers.0.w": old["layers.0.w"].clone(), "layers.1.w": _random((6,), torch.float32, g)}
    new["layers.0.w"].view(-1)[[3, 10, 40]] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    base = DeltaBase.capture(old, version=1)
    delta = base.encode(new, weight_version=2)
    assert delta.manifest.entries["layers.0.w"].encoding == "sparse"
    assert delta.manifest.entries["layers.1.w"].encoding == "full"
    return base, delta


IDX, VAL, FULL = "layers.0.w:indices", "layers.0.w:values", "layers.1.w:full"


def _set(wire: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**wire, key: value}


def _entry(delta: EncodedDelta, name: str, **changes: Any) -> DeltaManifest:
    entries = dict(delta.manifest.entries)
    entries[name] = entries[name].model_copy(update=changes)
    return delta.manifest.model_copy(update={"entries": entries})


MUTATIONS: dict[str, Callable[[EncodedDelta], tuple[DeltaManifest, dict[str, Any]]]] = {
    "index out of range": lambda d: (d.manifest, _set(d.wire, IDX, torch.tensor([3, 10, 64], dtype=torch.int32))),
    "negative index": lambda d: (d.manifest, _set(d.wire, IDX, torch.tensor([-1, 10, 40], dtype=torch.int32))),
    "duplicate index": lambda d: (d.manifest, _set(d.wire, IDX, torch.tensor([3, 10, 10], dtype=torch.int32))),
    "unsorted indices": lambda d: (d.manifest, _set(d.wire, IDX, torch.tensor([10, 3, 40], dtype=torch.int32))),
    "index dtype": lambda d: (d.manifest, _set(d.wire, IDX, d.wire[IDX].to(torch.int64))),
    "float indices": lambda d: (d.manifest, _set(d.wire, IDX, d.wire[IDX].to(torch.float32))),
    "values dtype": lambda d: (d.manifest, _set(d.wire, VAL, d.wire[VAL].to(torch.float32))),
    "values count": lambda d: (d.manifest, _set(d.wire, VAL, d.wire[VAL][:2])),
    "indices count": lambda d: (d.manifest, _set(d.wire, IDX, d.wire[IDX][:2])),
    "2-D values": lambda d: (d.manifest, _set(d.wire, VAL, d.wire[VAL].view(1, 3))),
    "missing values": lambda d: (d.manifest, {k: v for k, v in d.wire.items() if k != VAL}),
    "missing full": lambda d: (d.manifest, {k: v for k, v in d.wire.items() if k != FULL}),
    "full shape": lambda d: (d.manifest, _set(d.wire, FULL, torch.zeros(5))),
    "full dtype": lambda d: (d.manifest, _set(d.wire, FULL, d.wire[FULL].double())),
    "extra wire tensor": lambda d: (d.manifest, _set(d.wire, "layers.9.w:full", torch.zeros(2))),
    "not a tensor": lambda d: (d.manifest, _set(d.wire, VAL, [1.0, 2.0, 3.0])),
    "entry count": lambda d: (_entry(d, "layers.0.w", count=4), d.wire),
    "zero count": lambda d: (_entry(d, "layers.0.w", count=0), d.wire),
    "count beyond numel": lambda d: (_entry(d, "layers.0.w", count=65), d.wire),
    "entry shape": lambda d: (_entry(d, "layers.0.w", shape=(64,)), d.wire),
    "entry dtype": lambda d: (_entry(d, "layers.0.w", dtype="torch.float16"), d.wire),
    "unknown tensor": lambda d: (
        d.manifest.model_copy(update={"entries": {**d.manifest.entries, "nope": d.manifest.entries["layers.1.w"]}}),
        d.wire,
    ),
    "full with index dtype": lambda d: (_entry(d, "layers.1.w", index_dtype="torch.int32"), d.wire),
    "sparse without index dtype": lambda d: (_entry(d, "layers.0.w", index_dtype=None), d.wire),
    "wrong digest": lambda d: (_entry(d, "layers.0.w", digest="blake2b:" + "0" * 32), d.wire),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_bad_delta_refused_naming_the_problem_and_base_untouched(mutation: str) -> None:
    base, delta = _valid()
    before = {n: _raw(t) for n, t in base.tensors.items()}
    manifest, wire = MUTATIONS[mutation](delta)
    with pytest.raises(WeightManifestValidationError) as info:
        base.apply(manifest, wire)
    msg = str(info.value)
    assert msg.startswith("delta update") and "nothing was written" in msg
    assert info.value.mismatches
    assert {n: _raw(t) for n, t in base.tensors.items()} == before and base.version == 1
    expected_words = {
        "index out of range": "outside",
        "negative index": "outside",
        "duplicate index": "duplicate",
        "unsorted indices": "sorted ascending",
        "values count": "count",
        "indices count": "count",
        "extra wire tensor": "no delta entry describes",
        "wrong digest": "digest",
    }
    if mutation in expected_words:
        assert expected_words[mutation] in msg


def test_delta_against_another_base_refused() -> None:
    base, delta = _valid()
    wrong = delta.manifest.model_copy(update={"base_version": 5})
    with pytest.raises(DeltaBaseMismatchError, match=r"computed against v5, but the engine serves v1") as info:
        base.apply(wrong, delta.wire)
    assert "delta=False" in str(info.value) and "nothing was written" in str(info.value)
    assert (info.value.requested, info.value.base) == (2, 5)
    assert isinstance(info.value, HotWeightsError)


def test_encode_refuses_tensors_that_do_not_match_the_base() -> None:
    base = DeltaBase.capture({"a": torch.zeros(3), "b": torch.zeros(2)}, version=1)
    with pytest.raises(WeightManifestValidationError) as info:
        base.encode({"a": torch.zeros(4), "c": torch.zeros(2)}, weight_version=2)
    assert {(m.kind, m.name) for m in info.value.mismatches} == {("shape", "a"), ("unexpected", "c"), ("missing", "b")}
    with pytest.raises(WeightManifestValidationError, match="dtype"):
        base.encode({"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(2)}, weight_version=2)


def test_malformed_delta_json_refused() -> None:
    for text in ("{", '{"weight_version": 1}', '{"weight_version": 2, "base_version": 1, "entries": {"w": {}}}'):
        with pytest.raises(WeightManifestValidationError, match="delta update refused"):
            DeltaManifest.from_json(text)


@st.composite
def corruptions(draw: st.DrawFn) -> tuple[str, int, int]:
    return draw(st.sampled_from(["set", "swap", "drop", "dup"])), draw(st.integers(0, 2)), draw(st.integers(-70, 70))


@FUZZ
@given(corruptions())
def test_fuzzed_indices_either_rebuild_exactly_or_are_refused(corruption: tuple[str, int, int]) -> None:
    """Whatever is done to the indices, apply either refuses (typed, base untouched) or the indices were still
    valid (sorted, unique, in range) and the rebuilt tensor has the values at exactly those positions."""
    how, i, value = corruption
    base, delta = _valid()
    idx = delta.wire[IDX].clone()
    vals = delta.wire[VAL]
    if how == "set":
        idx[i] = value
    elif how == "swap":
        idx[[i, (i + 1) % 3]] = idx[[(i + 1) % 3, i]]
    elif how == "drop":
        idx = torch.cat([idx[:i], idx[i + 1 :]])
    else:
        idx[(i + 1) % 3] = idx[i]
    before = {n: _raw(t) for n, t in base.tensors.items()}
    wire = {**delta.wire, IDX: idx}
    try:
        staged = base.apply(delta.manifest, wire)
    except WeightManifestValidationError as exc:
        event(f"refused: {sorted({m.kind for m in exc.mismatches})}")
        assert {n: _raw(t) for n, t in base.tensors.items()} == before
        return
    event("accepted")
    positions = idx.tolist()
    assert positions == sorted(set(positions)) and all(0 <= p < 64 for p in positions)
    flat = staged.changed["layers.0.w"].view(-1)
    assert torch.equal(flat[idx.long()], vals)


# ============================================================================================ adapter flow
class DictDeltaAdapter(WeightInstallAdapter):
    """An adapter whose 'engine' is a dict; it records what each install sent."""

    name = "dict"

    def __init__(self, fail_delta: bool = False) -> None:
        super().__init__()
        self.weights: dict[str, torch.Tensor] = {}
        self.sent: list[list[str]] = []
        self.fail_delta = fail_delta
        self.engine_version: str | None = None

    def _install(self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: Any) -> None:
        self._begin_writing(timer)
        self.weights.update((n, t.clone()) for n, t in items)
        self.sent.append([n for n, _ in items])

    @property
    def abilities(self) -> PathAbilities:
        return PathAbilities(self.label, deltas=True)

    def _install_delta(
        self, manifest: WeightUpdateManifest, delta: EncodedDelta, staged: StagedDelta, timer: PhaseTimer
    ) -> None:
        self._begin_writing(timer)
        if self.fail_delta:
            raise ConnectionError("sender died mid-delta")
        self.weights.update((n, t.clone()) for n, t in staged.items)
        self.sent.append(list(delta.wire))

    def _engine_version_now(self) -> str | None:
        return self.engine_version

    def _record_engine_version(self, version: str) -> str | None:
        self.engine_version = version
        return version


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(100, 32, generator=g),
        "layers.0.q.weight": torch.randn(32, 32, generator=g),
        "layers.0.k.weight": torch.randn(16, 32, generator=g),
        "layers.1.q.weight": torch.randn(32, 32, generator=g),
        "norm.weight": torch.randn(32, generator=g),
    }


def _nudged(sd: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[n] = t + mask * 1e-3
    return out


def _install(adapter: WeightInstallAdapter, sd: dict[str, torch.Tensor], v: int, **kw: Any) -> Any:
    return adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=v), sd, **kw)


def test_first_delta_install_is_full_then_deltas_follow() -> None:
    adapter = DictDeltaAdapter()
    a = _model(0)
    full = _install(adapter, a, 1, delta=True)
    assert (full.delta, full.bytes_sent, full.delta_changed) == ("full", full.num_bytes, 0)
    assert "sent in full" in str(full)
    a2 = _nudged(a, 0.01, 1)
    report = _install(adapter, a2, 2, delta=True)
    assert report.delta == "applied" and report.num_bytes == full.num_bytes
    assert 0 < report.bytes_sent < 0.1 * report.num_bytes
    assert report.delta_changed == sum(not torch.equal(a[n], a2[n]) for n in a)
    assert "delta_encode" in report.phases and "of a full install" in str(report)
    d = report.to_dict()
    assert d["hotweights/bytes_sent"] == report.bytes_sent and d["hotweights/delta"] == "applied"
    assert all(torch.equal(adapter.weights[n], a2[n]) for n in a)
    # only the touched layer is reinstalled: layers.1 and the norm unchanged here
    a3 = dict(a2)
    a3["layers.0.k.weight"] = a2["layers.0.k.weight"].clone()
    a3["layers.0.k.weight"][0, 0] += 1
    report = _install(adapter, a3, 3, delta=True)
    assert adapter.sent[-1] == ["layers.0.k.weight:indices", "layers.0.k.weight:values"]
    assert report.bytes_sent == 8 and report.delta_changed == 1
    # a plain full install keeps the copy current; the next delta diffs against it
    b = _model(5)
    assert _install(adapter, b, 4).delta == "off"
    report = _install(adapter, b, 5, delta=True)
    assert (report.delta, report.bytes_sent, report.delta_changed) == ("applied", 0, 0)
    assert "bytes_sent" not in _install(adapter, b, 6).to_dict()  # plain installs keep their keys


def test_delta_refused_when_someone_else_installed() -> None:
    adapter = DictDeltaAdapter()
    a = _model(0)
    _install(adapter, a, 1, delta=True)
    adapter.engine_version = "9"  # another adapter installed v9
    before = {n: t.clone() for n, t in adapter.weights.items()}
    with pytest.raises(DeltaBaseMismatchError, match="delta=False"):
        _install(adapter, _nudged(a, 0.01, 2), 10, delta=True)
    assert all(torch.equal(adapter.weights[n], before[n]) for n in a) and adapter.active_weight_version == 1
    assert _install(adapter, a, 11, delta=True).delta == "full"  # the next one sends everything


def test_failed_delta_drops_the_copy_and_the_next_delta_is_full() -> None:
    adapter = DictDeltaAdapter()
    a = _model(0)
    _install(adapter, a, 1, delta=True)
    adapter.fail_delta = True
    with pytest.raises(InstallError, match="sender died"):
        _install(adapter, _nudged(a, 0.01, 3), 2, delta=True)
    assert adapter.active_weight_version == 1
    adapter.fail_delta = False
    adapter.reopen_serving()
    assert _install(adapter, a, 2, delta=True).delta == "full"
    assert _install(adapter, _nudged(a, 0.01, 4), 3, delta=True).delta == "applied"


def test_forget_delta_base_and_unsupported_adapters() -> None:
    adapter = DictDeltaAdapter()
    a = _model(0)
    _install(adapter, a, 1, delta=True)
    adapter.forget_delta_base()
    assert _install(adapter, a, 2).delta == "off"  # no copy kept any more
    assert adapter._delta.base is None

    class Plain(WeightInstallAdapter):
        def _install(self, manifest: Any, items: Any, timer: Any) -> None:
            raise AssertionError("never reached")

    with pytest.raises(EngineNotSupportedError, match="does not install deltas; nothing was written"):
        _install(Plain(), a, 1, delta=True)


def test_a_layer_outside_the_numbered_blocks_is_reinstalled_whole() -> None:
    """GPT-2's final LayerNorm: only its bias changed, yet its weight goes too (vLLM's layerwise reload rebuilds a
    layer whole; the weight alone left out was uninitialised memory: wrong tokens, measured in the matrix)."""
    from hotweights.core.delta import reinstall_names

    names = ["transformer.wte.weight", "transformer.h.0.ln_1.weight", "transformer.ln_f.weight"]
    names.append("transformer.ln_f.bias")
    assert reinstall_names(["transformer.ln_f.bias"], names) == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
