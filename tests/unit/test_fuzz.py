"""Property-based fuzzing of every input an update carries: manifest JSON, tensor sets, adapter installs, buckets.

The invariant throughout: a bad update is refused with a typed :class:`hotweights.HotWeightsError` (never a bare
``ValueError``/``KeyError``/``TypeError`` or a pydantic error) and nothing is written. Engine-side staging may also
refuse with ``ValueError``/``RuntimeError`` (the adapter maps those to :class:`InstallError`), but never with anything
else, and a refused bucket leaves the session as it was.

Example counts come from the active hypothesis profile (``tests/conftest.py``): 200 per test under ``ci``, 10,000
under ``HYPOTHESIS_PROFILE=slow`` (``make test-slow``).
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hotweights import (
    ExpectedWeights,
    HotWeightsError,
    InstallError,
    StaleWeightVersionError,
    TensorSpec,
    UnsupportedLayoutError,
    WeightLayout,
    WeightManifestValidationError,
    WeightUpdateManifest,
)
from hotweights.adapters import WeightInstallAdapter
from hotweights.core.buckets import ALIGNMENT, Bucket, pack_into, plan_buckets
from hotweights.core.report import PhaseTimer
from hotweights.transports import available_transports
from hotweights.vllm.worker.staging import StagingArea

#: Only the deadline is set here; max_examples and health checks come from the active profile.
FUZZ = settings(deadline=None)

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: Generated tensor names use this alphabet; names made up by a mutation contain "+" so they never collide.
NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789._"
ANCHOR = "anchor+weight"
IGNORED = "ignored+tied"

#: What engine-side staging may raise (the adapter maps them to InstallError); anything else is a crash.
STAGING_ERRORS = (ValueError, RuntimeError, HotWeightsError)

names = st.text(NAME_ALPHABET, min_size=1, max_size=12)
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
dtypes = st.sampled_from(DTYPES)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (bools kept 0/1)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (_numel(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def state_dicts(draw: st.DrawFn, max_size: int = 5, non_empty: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Small random state dicts; names in ``non_empty`` get a tensor of at least one element."""
    specs = draw(st.dictionaries(names, st.tuples(shapes, dtypes), min_size=0 if non_empty else 1, max_size=max_size))
    for name in non_empty:
        specs[name] = (draw(st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)), draw(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    return {n: _tensor(shape, dtype, seed + i) for i, (n, (shape, dtype)) in enumerate(specs.items())}


def _digested_manifest(tensors: Mapping[str, torch.Tensor], digests: bool, **fields: Any) -> WeightUpdateManifest:
    """A manifest whose specs carry digests when asked, built spec by spec (independent of from_state_dict)."""
    specs = {n: TensorSpec.of(t, digest=digests) for n, t in tensors.items()}
    return WeightUpdateManifest.parse({"weight_version": 1, **fields, "tensors": specs})


def _flip_one_byte(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.clone()
    flat = out.reshape(-1).view(torch.uint8)
    flat[index % flat.numel()] ^= 1
    return out


# ============================================================================================ 1. manifest JSON
def _parse_or_refuse(text: str | bytes) -> WeightUpdateManifest | None:
    """from_json either refuses with WeightManifestValidationError or returns a manifest that round-trips."""
    try:
        manifest = WeightUpdateManifest.from_json(text)
    except WeightManifestValidationError as exc:
        assert exc.mismatches, "a refusal names at least one mismatch"
        assert all(m.kind == "manifest" for m in exc.mismatches)
        assert "nothing was written" in str(exc)
        return None
    text_again = manifest.to_json()
    again = WeightUpdateManifest.from_json(text_again)
    assert again == manifest
    assert again.to_json() == text_again
    return manifest


json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


@st.composite
def corrupted_manifest_json(draw: st.DrawFn) -> str | bytes:
    """A real manifest's JSON, truncated or with one character (or byte) replaced."""
    text = _digested_manifest(draw(state_dicts(max_size=3)), draw(st.booleans()), weight_version=3).to_json()
    cut = draw(st.integers(0, len(text) - 1))
    how = draw(st.sampled_from(["truncate", "replace", "replace-byte"]))
    if how == "truncate":
        return text[:cut]
    if how == "replace":
        return text[:cut] + draw(st.characters(exclude_categories=())) + text[cut + 1 :]
    data = bytearray(text.encode())
    data[cut] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(
    st.one_of(
        st.text(st.characters(exclude_categories=())),  # lone surrogates included
        st.binary(),
        json_values.map(json.dumps),
        corrupted_manifest_json(),
    )
)
def test_from_json_on_arbitrary_text_refuses_or_round_trips(text: str | bytes) -> None:
    event("parsed" if _parse_or_refuse(text) is not None else "refused")


_NEST = "\x00nest\x00"


def _nest_text(depth: int) -> str:
    return "[" * depth + "]" * depth


not_an_int = st.one_of(
    st.booleans(),
    st.sampled_from([1.5, -0.25, 1.0, 0.0, 1e3]),
    st.text(max_size=4),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
bad_dtype_names = st.one_of(
    st.sampled_from(
        [
            "float33",
            "",
            "torch.",
            "Tensor",
            "torch.Tensor",
            "nn",
            "torch.torch.float32",
            "FLOAT32",
            " float32",
            "float32 ",
            "torch.float32\n",
            "cuda",
            "dtype",
            "torch.dtype",
        ]
    ),
    st.text(NAME_ALPHABET, max_size=10).filter(
        lambda s: not isinstance(getattr(torch, s.removeprefix("torch."), None), torch.dtype)
    ),
    st.integers(),
    st.none(),
    st.booleans(),
    st.lists(st.just("float32"), max_size=1),
)
hex32 = st.text("0123456789abcdef", min_size=32, max_size=32)
bad_digests = st.one_of(
    st.text("0123456789abcdef", max_size=40).filter(lambda s: len(s) != 32).map(lambda s: "blake2b:" + s),
    st.tuples(hex32, st.integers(0, 31), st.sampled_from("ABCDEF")).map(
        lambda x: "blake2b:" + x[0][: x[1]] + x[2] + x[0][x[1] + 1 :]
    ),
    hex32.map(lambda s: "sha256:" + s),
    hex32.map(lambda s: "blake2b:" + s + "\n"),
    hex32.map(lambda s: " blake2b:" + s),
    hex32,
    st.just(""),
    st.integers(),
    st.booleans(),
)
SPEC_FIELDS = ("shape", "dtype", "nbytes", "digest")


@st.composite
def plausible_manifest_json(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Manifest JSON mixing valid and invalid fields; returns the text and the invalid mutations made."""
    invalid: list[str] = []
    nests: list[int] = []

    def nest() -> str:
        nests.append(draw(st.integers(2, 600)))  # depth 1 would be "[]", a valid shape
        return _NEST + str(len(nests) - 1)

    tensors: dict[str, Any] = {}
    for name, (shape, dtype) in draw(st.dictionaries(names, st.tuples(shapes, dtypes), min_size=1, max_size=4)).items():
        spec: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype) if draw(st.booleans()) else str(dtype)[6:]}
        expected_nbytes = _numel(shape) * dtype.itemsize
        if draw(st.booleans()):
            spec["nbytes"] = draw(st.sampled_from([expected_nbytes, None]))
        if draw(st.booleans()):
            spec["digest"] = draw(st.one_of(st.none(), hex32.map(lambda s: "blake2b:" + s)))
        mutation = draw(
            st.sampled_from(
                ["none"] * 3 + ["dtype", "shape", "nbytes", "digest", "extra", "not-a-dict", "missing", "nest"]
            )
        )
        if mutation == "dtype":
            spec["dtype"] = draw(bad_dtype_names)
        elif mutation == "shape":
            spec["shape"] = draw(
                st.one_of(
                    st.tuples(st.lists(st.integers(0, 4), max_size=2), st.integers(max_value=-1)).map(
                        lambda x: [*x[0], x[1]]
                    ),
                    st.lists(not_an_int, min_size=1, max_size=2),
                    st.integers(),
                    st.text(max_size=3),
                    st.none(),
                )
            )
        elif mutation == "nbytes":
            spec["nbytes"] = draw(
                st.one_of(
                    st.integers().map(lambda n, want=expected_nbytes: n if n != want else want + 1),
                    st.booleans(),
                    st.sampled_from([1.5, "8", []]),
                )
            )
        elif mutation == "digest":
            spec["digest"] = draw(bad_digests)
        elif mutation == "extra":
            spec[draw(st.text(max_size=8).filter(lambda k: k not in SPEC_FIELDS))] = draw(json_scalars)
        elif mutation == "missing":
            del spec[draw(st.sampled_from(["shape", "dtype"]))]
        elif mutation == "nest":
            spec[draw(st.sampled_from(SPEC_FIELDS))] = nest()
        if mutation == "not-a-dict":
            tensors[name] = draw(st.one_of(st.lists(st.integers(0, 4), max_size=2), st.text(max_size=4), st.none()))
        else:
            tensors[name] = spec
        if mutation != "none":
            invalid.append(f"tensor {name!r}: {mutation}")

    doc: dict[str, Any] = {"weight_version": draw(st.integers(min_value=0)), "tensors": tensors}
    if draw(st.booleans()):
        doc["update_id"] = draw(st.text(min_size=1, max_size=128))
    if draw(st.booleans()):
        size = draw(st.integers(1, 8))
        doc["layout"] = {"format": draw(st.sampled_from(["checkpoint", "kernel"])), "tp_size": size}
        doc["layout"]["tp_rank"] = draw(st.integers(0, size - 1))
    if draw(st.booleans()):
        doc["metadata"] = draw(
            st.dictionaries(
                st.text(max_size=8),
                st.none()
                | st.booleans()
                | st.integers()
                | st.floats(allow_nan=False, allow_infinity=False)
                | st.text(max_size=8),
                max_size=4,
            )
        )

    for field in draw(
        st.sets(st.sampled_from(["weight_version", "update_id", "tensors", "layout", "metadata", "extra"]))
    ):
        kind = draw(st.sampled_from(["bad", "nest"])) if field != "extra" else "bad"
        invalid.append(f"{field}: {kind}")
        if kind == "nest":
            doc[field] = nest()
        elif field == "weight_version":
            how = draw(st.sampled_from(["negative", "not-an-int", "missing"]))
            if how == "missing":
                del doc["weight_version"]
            else:
                doc["weight_version"] = draw(st.integers(max_value=-1) if how == "negative" else not_an_int)
        elif field == "update_id":
            doc["update_id"] = draw(
                st.one_of(st.just(""), st.text(min_size=129, max_size=140), st.integers(), st.none(), st.booleans())
            )
        elif field == "tensors":
            how = draw(st.sampled_from(["empty", "not-a-dict", "missing", "bad-name"]))
            if how == "empty":
                doc["tensors"] = {}
            elif how == "not-a-dict":
                doc["tensors"] = draw(st.one_of(st.just(list(tensors.values())), st.text(max_size=4), st.none()))
            elif how == "missing":
                del doc["tensors"]
            else:
                old = draw(st.sampled_from(sorted(tensors)))
                new = draw(st.sampled_from(["", " ", f" {old}", f"{old}\t", f"{old}\n"]))
                doc["tensors"] = {(new if n == old else n): s for n, s in tensors.items()}
        elif field == "layout":
            how = draw(st.sampled_from(["rank>=size", "size<1", "rank<0", "bool", "format", "extra", "not-a-dict"]))
            size = draw(st.integers(1, 8))
            layout: Any = {"tp_size": size, "tp_rank": 0}
            if how == "rank>=size":
                layout["tp_rank"] = draw(st.integers(min_value=size))
            elif how == "size<1":
                layout["tp_size"] = draw(st.integers(max_value=0))
            elif how == "rank<0":
                layout["tp_rank"] = draw(st.integers(max_value=-1))
            elif how == "bool":
                layout[draw(st.sampled_from(["tp_rank", "tp_size"]))] = draw(st.booleans())
            elif how == "format":
                layout["format"] = draw(st.one_of(st.sampled_from(["", "Checkpoint", "kernels", "hf"]), st.integers()))
            elif how == "extra":
                layout[draw(st.text(max_size=8).filter(lambda k: k not in ("format", "tp_rank", "tp_size")))] = 0
            else:
                layout = draw(st.one_of(st.just("checkpoint"), st.lists(st.integers(), max_size=2), st.integers()))
            doc["layout"] = layout
        elif field == "metadata":
            doc["metadata"] = draw(
                st.one_of(
                    st.lists(st.integers(), max_size=2),
                    st.text(max_size=4),
                    st.integers(),
                    st.dictionaries(
                        st.text(max_size=4),
                        st.lists(json_scalars, max_size=2) | st.dictionaries(st.text(max_size=2), json_scalars),
                        min_size=1,
                        max_size=2,
                    ),
                )
            )
        else:
            doc[draw(st.text(max_size=10).filter(lambda k: k not in WeightUpdateManifest.model_fields))] = draw(
                json_values
            )

    text = json.dumps(doc)
    for i, depth in enumerate(nests):
        text = text.replace(json.dumps(_NEST + str(i)), _nest_text(depth))
    return text, invalid


@FUZZ
@given(plausible_manifest_json())
def test_from_json_refuses_exactly_the_invalid_manifests(case: tuple[str, list[str]]) -> None:
    text, invalid = case
    manifest = _parse_or_refuse(text)
    if invalid:
        assert manifest is None, f"accepted a manifest with invalid fields: {invalid}"
    else:
        assert manifest is not None, "refused a valid manifest"
    event("invalid" if invalid else "valid")


@FUZZ
@given(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999"]), st.text(max_size=8))
def test_from_json_non_finite_metadata_is_refused_or_round_trips(literal: str, key: str) -> None:
    text = (
        '{"weight_version": 1, "tensors": {"w": {"shape": [2], "dtype": "float32"}}, '
        f'"metadata": {{{json.dumps(key)}: {literal}}}}}'
    )
    _parse_or_refuse(text)


# ============================================================================================ 2. validate(tensors)
NOT_TENSORS = st.sampled_from([None, 1.0, 0, "tensor", b"\x00", [1, 2], {"data": [1]}])
TENSOR_MUTATIONS = ("keep", "drop", "reshape", "retype", "reshape+retype", "not_tensor", "duplicate")


@st.composite
def mutated_tensor_sets(
    draw: st.DrawFn, tensors: Mapping[str, torch.Tensor], protect: frozenset[str] = frozenset(), min_mutations: int = 0
) -> tuple[Any, set[tuple[str, str]]]:
    """``tensors`` with random mutations; returns the tensor set (dict or pairs) and the (kind, name) expected.

    Every name gets one mutation (``keep`` included), plus a few added names; names in ``protect`` are kept.
    """
    pairs: list[tuple[Any, Any]] = []
    expected: set[tuple[str, str]] = set()
    for name, t in tensors.items():
        mutation = "keep" if name in protect else draw(st.sampled_from(TENSOR_MUTATIONS))
        if mutation == "drop":
            expected.add(("missing", name))
            continue
        value: Any = t
        if "reshape" in mutation:
            shape = draw(shapes)
            value = torch.zeros(shape if shape != tuple(t.shape) else (*shape, 2), dtype=t.dtype)
            expected.add(("shape", name))
        if "retype" in mutation:
            value = value.to(draw(st.sampled_from([d for d in DTYPES if d != t.dtype])))
            expected.add(("dtype", name))
        if mutation == "not_tensor":
            value = draw(NOT_TENSORS | st.just(t.tolist()))
            expected.add(("not_tensor", name))
        pairs.append((name, value))
        if mutation == "duplicate":
            pairs.append((name, draw(st.sampled_from([t, t.clone()]))))
            expected.add(("manifest", name))
    added = draw(st.lists(st.integers(0, 99).map(lambda i: f"extra+{i}"), unique=True, min_size=0, max_size=3))
    if len(expected) + len(added) < min_mutations:
        added.append("extra+last")
    for name in added:
        pairs.append((name, torch.zeros(draw(shapes), dtype=draw(dtypes))))
        expected.add(("unexpected", name))
    pairs = draw(st.permutations(pairs))
    has_duplicates = len({n for n, _ in pairs}) < len(pairs)
    return (dict(pairs) if not has_duplicates and draw(st.booleans()) else pairs), expected


@FUZZ
@given(st.data())
def test_validate_names_every_mutation(data: st.DataObject) -> None:
    tensors = data.draw(state_dicts())
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=data.draw(st.integers(min_value=0)))
    mutated, expected = data.draw(mutated_tensor_sets(tensors))
    if not expected:
        event("no mutation")
        manifest.validate(mutated)
        return
    with pytest.raises(WeightManifestValidationError) as info:
        manifest.validate(mutated)
    found = {(m.kind, m.name) for m in info.value.mismatches}
    assert expected <= found, f"mutations not reported: {expected - found}"
    mutated_names = {name for _, name in expected}
    assert {name for _, name in found} <= mutated_names, f"mismatches for untouched names: {found}"
    event(f"{len(expected)} mutation(s)")


# ============================================================================================ 3. adapter contract
class RecordingAdapter(WeightInstallAdapter):
    """A fake engine: records every tensor ``_install`` is handed and every follow-up call."""

    name = "fuzz-recording"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.forget()

    def forget(self) -> None:
        self.writes: list[str] = []
        self.install_calls = 0
        self.reset_calls = 0
        self.recorded_versions: list[str] = []

    def _install(
        self, manifest: WeightUpdateManifest, items: Sequence[tuple[str, torch.Tensor]], timer: PhaseTimer
    ) -> None:
        self.install_calls += 1
        self.writes.extend(name for name, _ in items)

    def _reset_prefix_cache(self) -> bool:
        self.reset_calls += 1
        return True

    def _record_engine_version(self, version: str) -> str | None:
        self.recorded_versions.append(version)
        return version


def _engine_with_baseline(engine: dict[str, torch.Tensor], ignore: bool, base_version: int) -> RecordingAdapter:
    """An adapter that expects ``engine``'s tensors and already serves ``base_version`` (a checked good install)."""
    expected = ExpectedWeights(
        tensors={n: TensorSpec.of(t) for n, t in engine.items()},
        ignored={IGNORED: "tied to another tensor"} if ignore else {},
    )
    adapter = RecordingAdapter(expected=expected)
    report = adapter.install(
        WeightUpdateManifest.from_state_dict(engine, weight_version=base_version, update_id="baseline"), engine
    )
    assert report.num_tensors == len(engine)
    assert adapter.writes == list(engine)  # the fake does record writes
    adapter.forget()
    return adapter


def _assert_refused_untouched(adapter: RecordingAdapter, base_version: int) -> None:
    assert adapter.writes == []
    assert adapter.install_calls == 0
    assert adapter.reset_calls == 0
    assert adapter.recorded_versions == []
    assert adapter.active_weight_version == base_version
    assert adapter.active_update_id == "baseline"


ADAPTER_MUTATIONS = ("tensors", "manifest", "layout", "stale", "digest")


@st.composite
def bad_installs(draw: st.DrawFn) -> dict[str, Any]:
    """A good engine state plus an update with at least one of ``ADAPTER_MUTATIONS``."""
    engine = draw(state_dicts(max_size=4, non_empty=(ANCHOR,)))
    base_version = draw(st.integers(0, 1000))
    kinds = draw(st.sets(st.sampled_from(ADAPTER_MUTATIONS), min_size=1))
    protect = frozenset({ANCHOR})

    # the manifest's tensor set: the engine's, or one that differs from it (the tensors then match the manifest)
    update = dict(engine)
    if "manifest" in kinds:
        changed, _ = draw(mutated_tensor_sets(engine, protect=protect, min_mutations=1))
        update = {n: v for n, v in (changed.items() if isinstance(changed, dict) else changed)}
        update = {n: (v if isinstance(v, torch.Tensor) else torch.zeros(3)) for n, v in update.items()}
        if update.keys() == engine.keys() and all(TensorSpec.of(update[n]) == TensorSpec.of(engine[n]) for n in update):
            update["extra+manifest"] = torch.zeros(1)  # e.g. only a duplicate was drawn: make the manifest differ
    layout = WeightLayout()
    if "layout" in kinds:
        if draw(st.booleans()):  # a format no adapter installs yet
            size = draw(st.integers(1, 8))
            layout = WeightLayout(format="kernel", tp_size=size, tp_rank=draw(st.integers(0, size - 1)))
        else:  # a tensor-parallel shard
            size = draw(st.integers(2, 8))
            layout = WeightLayout(tp_size=size, tp_rank=draw(st.integers(0, size - 1)))
    version = draw(st.integers(0, base_version) if "stale" in kinds else st.integers(base_version + 1, 2000))
    manifest = _digested_manifest(update, "digest" in kinds, weight_version=version, layout=layout)

    tensors: Any = update
    if "tensors" in kinds:
        tensors, _ = draw(mutated_tensor_sets(update, protect=protect, min_mutations=1))
    if "digest" in kinds:
        flipped = _flip_one_byte(update[ANCHOR], draw(st.integers(min_value=0)))
        if isinstance(tensors, dict):
            tensors = {**tensors, ANCHOR: flipped}
        else:
            tensors = [(n, flipped if n == ANCHOR else v) for n, v in tensors]
    return {
        "engine": engine,
        "ignore": draw(st.booleans()),
        "base_version": base_version,
        "kinds": kinds,
        "manifest": manifest,
        "tensors": tensors,
    }


@FUZZ
@given(bad_installs())
def test_adapter_refuses_bad_updates_before_any_write(case: dict[str, Any]) -> None:
    adapter = _engine_with_baseline(case["engine"], case["ignore"], case["base_version"])
    with pytest.raises(HotWeightsError) as info:
        adapter.install(case["manifest"], case["tensors"])
    err = info.value
    assert isinstance(err, (WeightManifestValidationError, UnsupportedLayoutError, StaleWeightVersionError)), err
    assert not isinstance(err, InstallError)
    kinds = case["kinds"]
    if kinds == {"layout"}:
        assert isinstance(err, UnsupportedLayoutError)
    elif kinds == {"stale"}:
        assert isinstance(err, StaleWeightVersionError)
    elif kinds == {"digest"}:
        assert isinstance(err, WeightManifestValidationError)
        assert {(m.kind, m.name) for m in err.mismatches} == {("digest", ANCHOR)}
    elif "layout" not in kinds and "stale" not in kinds:
        assert isinstance(err, WeightManifestValidationError)
    _assert_refused_untouched(adapter, case["base_version"])
    event("+".join(sorted(kinds)))


@FUZZ
@given(state_dicts(max_size=3, non_empty=(ANCHOR,)), st.integers(min_value=0))
def test_adapter_refuses_flipped_byte_with_from_state_dict_digests(engine: dict[str, torch.Tensor], at: int) -> None:
    adapter = _engine_with_baseline(engine, False, 0)
    manifest = WeightUpdateManifest.from_state_dict(engine, weight_version=1, digests=True)
    with pytest.raises(WeightManifestValidationError) as info:
        adapter.install(manifest, {**engine, ANCHOR: _flip_one_byte(engine[ANCHOR], at)})
    assert ("digest", ANCHOR) in {(m.kind, m.name) for m in info.value.mismatches}
    _assert_refused_untouched(adapter, 0)


@FUZZ
@given(
    state_dicts(max_size=3, non_empty=(ANCHOR,)),
    st.sampled_from(["sparse", "nested", "meta+digest"]),
)
def test_adapter_refuses_exotic_tensor_values(engine: dict[str, torch.Tensor], kind: str) -> None:
    adapter = _engine_with_baseline(engine, False, 0)
    t = engine[ANCHOR]
    if kind == "sparse":
        value = t.to_sparse()
    elif kind == "nested":
        with warnings.catch_warnings():  # "nested tensors are a prototype"
            warnings.simplefilter("ignore")
            value = torch.nested.nested_tensor([t.reshape(-1), t.reshape(-1)[:1]])
    else:
        value = torch.empty_like(t, device="meta")
    manifest = _digested_manifest(engine, kind == "meta+digest", weight_version=1)
    with pytest.raises(HotWeightsError):
        adapter.install(manifest, {**engine, ANCHOR: value})
    _assert_refused_untouched(adapter, 0)


@FUZZ
@given(
    state_dicts(max_size=3),
    st.sampled_from(["single", "triple", "unhashable-name"]),
    st.data(),
)
def test_adapter_refuses_malformed_pairs(engine: dict[str, torch.Tensor], kind: str, data: st.DataObject) -> None:
    adapter = _engine_with_baseline(engine, False, 0)
    pairs: list[Any] = list(engine.items())
    at = data.draw(st.integers(0, len(pairs)))
    bad: Any = {"single": ("extra+x",), "triple": ("extra+x", torch.zeros(1), 0), "unhashable-name": (["x"], 1)}[kind]
    pairs.insert(at, bad)
    with pytest.raises(HotWeightsError):
        adapter.install(WeightUpdateManifest.from_state_dict(engine, weight_version=1), pairs)
    _assert_refused_untouched(adapter, 0)


# ============================================================================================ 4. engine-side staging
def _payload(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> bytearray:
    """What the bytes transport's ``send`` puts in its descriptor."""
    data = bytearray(bucket.nbytes)
    if bucket.nbytes:
        pack_into(torch.frombuffer(data, dtype=torch.uint8), bucket, dict(tensors))
    return data


def _bytes_descriptor(data: bytes | bytearray) -> dict[str, Any]:
    return {"transport": "bytes", "data": data, "nbytes": len(data)}


def _snapshot(area: StagingArea) -> tuple[Any, ...]:
    s = area.session
    assert s is not None
    return (id(s), list(s.staged), [id(t) for t in s.staged.values()], s.nbytes, s.digests_verified, len(s.keepalive))


def _open_session(tensors: Mapping[str, torch.Tensor], digests: bool) -> tuple[StagingArea, WeightUpdateManifest]:
    manifest = _digested_manifest(tensors, digests, update_id="fuzz-update")
    area = StagingArea(
        owner=object()
    )  # random bytes are floats of any value: NaN and Inf are tests/unit/test_finite.py's
    assert area.begin(manifest.to_json(), finite=False) == "fuzz-update"
    return area, manifest


def _bucket_verdict(
    entries: list[dict[str, Any]],
    bucket_nbytes: int,
    data: bytes,
    desc_nbytes: int,
    manifest: WeightUpdateManifest,
    tensors: Mapping[str, torch.Tensor],
    staged: set[str],
) -> tuple[list[str], list[str]]:
    """(hard, soft): reasons the bucket must be refused, and irregularities that may be refused (planner never
    produces them). A bucket with neither must be accepted."""
    hard: list[str] = []
    soft: list[str] = []
    if not entries:
        hard.append("a bucket with no tensors")
    if not desc_nbytes == bucket_nbytes == len(data):
        hard.append(f"sizes: descriptor {desc_nbytes}, bucket {bucket_nbytes}, data {len(data)}")
    seen: set[str] = set()
    end = 0
    ranges: list[tuple[int, int]] = []
    for e in entries:
        name, off, n = e["name"], e["offset"], e["nbytes"]
        spec = manifest.tensors.get(name)
        if name in seen:
            hard.append(f"{name!r} twice")
        seen.add(name)
        if name in staged:
            hard.append(f"{name!r} already staged")
        if spec is None:
            hard.append(f"{name!r} unknown")
        elif n != spec.expected_nbytes:
            hard.append(f"{name!r} nbytes {n}")
        if off + n > bucket_nbytes:
            hard.append(f"{name!r} out of bounds")
        if off % ALIGNMENT:
            soft.append(f"{name!r} misaligned")
        if off < end:
            soft.append(f"{name!r} out of order")
        end = max(end, off + n)
        if n:
            ranges.append((off, off + n))
        if spec is not None and spec.digest is not None and data[off : off + n] != _raw(tensors[name]):
            hard.append(f"{name!r} digest")
    ranges.sort()
    if any(a_end > b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges)):
        hard.append("overlap")
    if end != bucket_nbytes:
        soft.append(f"tensors end at {end}, bucket declares {bucket_nbytes}")
    packed = sum(-(-e["nbytes"] // ALIGNMENT) * ALIGNMENT for e in entries)
    if bucket_nbytes > packed:  # bytes no tensor accounts for (a receiver would allocate them on the caller's word)
        soft.append(f"bucket declares {bucket_nbytes} bytes, its tensors packed need {packed}")
    return hard, soft


#: What one staging case gets wrong: one aspect at a time (so each check is reached), or everything at once.
STAGING_FOCUS = (
    "entry", "declared", "payload", "transport", "descriptor-nbytes", "update-id", "restage", "made-up", "everything"
)  # fmt: skip
ENTRY_MUTATIONS = ("rename", "offset", "nbytes", "duplicate", "drop")


@st.composite
def staging_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A session with some buckets staged, then one bucket (and descriptor) with ``focus`` wrong."""
    tensors = draw(state_dicts(max_size=4))
    digests = draw(st.booleans())
    manifest = _digested_manifest(tensors, digests, update_id="fuzz-update")
    buckets = plan_buckets(manifest, bucket_bytes=draw(st.integers(1, 256)))
    focus = draw(st.sampled_from(STAGING_FOCUS))
    wild = focus == "everything"
    if focus == "restage":  # a bucket whose tensors were staged already
        pre = draw(st.integers(1, len(buckets)))
        target = draw(st.sampled_from(buckets[:pre]))
    elif wild:
        pre = draw(st.integers(0, len(buckets)))
        target = draw(st.sampled_from(buckets))
    else:
        pre = draw(st.integers(0, len(buckets) - 1))
        target = draw(st.sampled_from(buckets[pre:]))
    names_pool = st.sampled_from([*manifest.tensors, "ghost+1", "ghost+2"])
    offsets = st.integers(0, 8).map(lambda k: k * ALIGNMENT) | st.integers(0, target.nbytes + 2 * ALIGNMENT)

    entries = [e.model_dump() for e in target.entries]
    declared = target.nbytes
    if focus == "entry" or wild:
        at = draw(st.sampled_from(range(len(entries)))) if not wild else None
        mutated: list[dict[str, Any]] = []
        for i, entry in enumerate(entries):
            if wild:
                how = draw(st.sampled_from(("keep", "keep", *ENTRY_MUTATIONS)))
            else:
                how = draw(st.sampled_from(ENTRY_MUTATIONS)) if i == at else "keep"
            if how == "rename":
                entry["name"] = draw(names_pool)
            elif how == "offset":
                entry["offset"] = draw(offsets)
            elif how == "nbytes":
                entry["nbytes"] = draw(st.integers(0, 2 * entry["nbytes"] + 8))
            if how != "drop":
                mutated.append(entry)
            if how == "duplicate":
                mutated.append(dict(entry))
        entries = mutated
    elif focus == "made-up":
        entries = draw(
            st.lists(
                st.fixed_dictionaries({"name": names_pool, "offset": offsets, "nbytes": st.integers(0, 300)}),
                max_size=4,
            )
        )
        for entry in entries:  # mostly the right size
            spec = manifest.tensors.get(entry["name"])
            if spec is not None and draw(st.booleans()):
                entry["nbytes"] = spec.expected_nbytes
        declared = max((e["offset"] + e["nbytes"] for e in entries), default=0)
    if focus == "declared" or ((wild or focus == "made-up") and draw(st.booleans())):
        declared = draw(st.integers(0, declared + 2 * ALIGNMENT))

    # the payload as a sender packs it, then perhaps damaged
    data = bytearray(declared)
    for e in entries:
        name, off = e["name"], e["offset"]
        if name in tensors and e["nbytes"] == tensors[name].nbytes and off + e["nbytes"] <= declared:
            data[off : off + e["nbytes"]] = _raw(tensors[name])
    damage = "none"
    if focus == "payload" or wild:
        damage = draw(st.sampled_from(("none",) * wild + ("truncate", "oversize", "random", "flip")))
    if damage == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "oversize":
        data += draw(st.binary(min_size=1, max_size=80))
    elif damage == "random":
        data = bytearray(draw(st.binary(min_size=len(data), max_size=len(data))))
    elif damage == "flip" and data:
        data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))

    transport = "bytes"
    if focus == "transport" or (wild and draw(st.booleans())):
        transport = draw(
            st.sampled_from(["carrier-pigeon", "", "BYTES", "bytes "])
            | st.text(max_size=8).filter(lambda s: s not in available_transports())
        )
    desc_nbytes = len(data)
    if focus == "descriptor-nbytes" or (wild and draw(st.booleans())):
        desc_nbytes = draw(st.sampled_from([len(data), declared]) | st.integers(-1, 2 * declared + ALIGNMENT))
    update_id = "fuzz-update"
    if focus == "update-id" or (wild and draw(st.booleans())):
        update_id = draw(st.sampled_from(["", "fuzz-update ", "other"]) | st.text(max_size=12))
    return {
        "focus": focus,
        "tensors": tensors,
        "digests": digests,
        "buckets": buckets,
        "pre": pre,
        "staged": {e.name for b in buckets[:pre] for e in b.entries},
        "update_id": update_id,
        "bucket_json": json.dumps({"index": draw(st.integers(0, 9)), "nbytes": declared, "entries": entries}),
        "entries": entries,
        "declared": declared,
        "data": bytes(data),
        "descriptor": {"transport": transport, "data": bytes(data), "nbytes": desc_nbytes},
    }


@FUZZ
@given(staging_cases())
def test_staging_refuses_bad_buckets_and_keeps_the_session(case: dict[str, Any]) -> None:
    tensors = case["tensors"]
    area, manifest = _open_session(tensors, case["digests"])
    for bucket in case["buckets"][: case["pre"]]:  # the good buckets before are staged
        payload = _payload(bucket, tensors)
        assert area.stage("fuzz-update", bucket.model_dump_json(), _bytes_descriptor(payload)) == bucket.nbytes
    before = _snapshot(area)

    descriptor = case["descriptor"]
    hard, soft = _bucket_verdict(
        case["entries"], case["declared"], case["data"], descriptor["nbytes"], manifest, tensors, case["staged"]
    )
    if descriptor["transport"] != "bytes":
        hard.append(f"transport {descriptor['transport']!r}")
    if case["update_id"] != "fuzz-update":
        hard.append("update id")

    try:
        staged_bytes = area.stage(case["update_id"], case["bucket_json"], descriptor)
    except STAGING_ERRORS as exc:
        assert not isinstance(exc, pydantic.ValidationError), exc
        assert hard or soft, f"refused a good bucket: {exc}"
        assert _snapshot(area) == before, "a refused bucket changed the session"
        event(f"{case['focus']}: refused")
        return
    assert not hard, f"accepted a bad bucket: {hard}"  # irregular (soft) but safe buckets may be accepted
    session = area.session
    assert session is not None
    assert staged_bytes == case["declared"] == len(case["data"])
    assert session.nbytes == before[3] + staged_bytes
    new = {e["name"] for e in case["entries"]}
    assert list(session.staged)[: len(before[1])] == before[1]
    assert set(session.staged) == set(before[1]) | new
    for e in case["entries"]:
        got = session.staged[e["name"]]
        spec = manifest.tensors[e["name"]]
        assert (tuple(got.shape), got.dtype) == (spec.shape, spec.torch_dtype)
        assert _raw(got) == case["data"][e["offset"] : e["offset"] + e["nbytes"]]
    event(f"{case['focus']}: accepted")


@FUZZ
@given(
    state_dicts(max_size=3),
    st.one_of(
        st.text(),
        json_values.map(json.dumps),
        st.fixed_dictionaries(
            {"index": st.integers(-2, 2) | st.none(), "nbytes": st.integers(-2, 200) | st.text(max_size=2)},
            optional={
                "entries": st.lists(st.dictionaries(st.sampled_from(["name", "offset", "nbytes", "x"]), json_scalars))
            },
        ).map(json.dumps),
    ),
)
def test_staging_refuses_malformed_bucket_json(tensors: dict[str, torch.Tensor], bucket_json: str) -> None:
    area, _ = _open_session(tensors, False)
    before = _snapshot(area)
    try:
        area.stage("fuzz-update", bucket_json, {"transport": "bytes", "data": b"", "nbytes": 0})
    except STAGING_ERRORS as exc:
        assert not isinstance(exc, pydantic.ValidationError), f"pydantic error leaked: {exc}"
    assert _snapshot(area) == before


@FUZZ
@given(
    state_dicts(max_size=3),
    st.sampled_from(["no-data", "no-nbytes", "nbytes-none", "nbytes-list", "nbytes-inf", "not-a-dict", "shm"]),
)
def test_staging_refuses_malformed_descriptors(tensors: dict[str, torch.Tensor], kind: str) -> None:
    area, manifest = _open_session(tensors, False)
    bucket = plan_buckets(manifest, bucket_bytes=1 << 20)[0]
    payload = bytes(_payload(bucket, tensors))
    descriptor: Any = _bytes_descriptor(payload)
    if kind == "no-data":
        del descriptor["data"]
    elif kind == "no-nbytes":
        del descriptor["nbytes"]
    elif kind.startswith("nbytes-"):
        descriptor["nbytes"] = {"nbytes-none": None, "nbytes-list": [len(payload)], "nbytes-inf": float("inf")}[kind]
    elif kind == "not-a-dict":
        descriptor = [("transport", "bytes"), ("data", payload)]
    else:
        descriptor["transport"] = "shm"
    before = _snapshot(area)
    try:
        area.stage("fuzz-update", bucket.model_dump_json(), descriptor)
    except STAGING_ERRORS as exc:
        assert not isinstance(exc, pydantic.ValidationError), exc
    assert _snapshot(area) == before


@FUZZ
@given(state_dicts(max_size=4, non_empty=(ANCHOR,)), st.data())
def test_staging_refuses_one_flipped_byte_with_from_state_dict_digests(
    tensors: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    """A correctly packed bucket with one bit of one tensor flipped: refused for its digest, nothing kept."""
    manifest = WeightUpdateManifest.from_state_dict(tensors, weight_version=1, update_id="fuzz-update", digests=True)
    area = StagingArea(owner=object())
    area.begin(manifest.to_json(), finite=False)  # a flipped bit may make a NaN: the digest is what is tested here
    buckets = plan_buckets(manifest, bucket_bytes=data.draw(st.integers(1, 256)))
    target = data.draw(st.sampled_from([b for b in buckets if any(e.nbytes for e in b.entries)]))
    entry = data.draw(st.sampled_from([e for e in target.entries if e.nbytes]))
    payload = _payload(target, tensors)
    payload[entry.offset + data.draw(st.integers(0, entry.nbytes - 1))] ^= 1 << data.draw(st.integers(0, 7))
    before = _snapshot(area)
    with pytest.raises(ValueError, match="digest") as info:
        area.stage("fuzz-update", target.model_dump_json(), _bytes_descriptor(bytes(payload)))
    assert entry.name in str(info.value)
    assert _snapshot(area) == before


# ============================================================================================ shm descriptors
_SHM_KINDS = ["regular", "symlink", "directory", "fifo", "absent"]


@FUZZ
@given(
    st.one_of(
        st.text(st.characters(codec="ascii", exclude_characters="\x00/"), min_size=1, max_size=40),
        st.builds(
            lambda h, extra: f"hotweights-{os.getpid()}-{h}{extra}",
            st.text("0123456789abcdefABCDEF-", min_size=31, max_size=33),
            st.sampled_from(["", "x", ".tmp"]),
        ),
    ),
    st.sampled_from(_SHM_KINDS),
    st.sampled_from(["", "sub/", "../", "./", "/tmp/"]),
)
def test_shm_open_bucket_maps_only_hotweights_segment_files(name: str, kind: str, where: str) -> None:
    """A worker maps a regular file in SHM_DIR named like a hotweights segment; any other path in a descriptor
    (a symlink, a directory, a FIFO, another name, another directory) raises and maps nothing."""
    from hotweights.transports import shm, shm_files

    if name in (".", ".."):
        return
    path = shm_files.SHM_DIR / name
    created = False
    if where == "" and not path.exists() and not path.is_symlink() and kind != "absent":
        created = True
        if kind == "regular":
            path.write_bytes(b"\0" * 8)
        elif kind == "symlink":
            path.symlink_to("/etc/hostname")
        elif kind == "directory":
            path.mkdir()
        else:
            os.mkfifo(path)
    raw = f"{where}{name}" if where.startswith("/") else f"{shm_files.SHM_DIR}/{where}{name}"
    try:
        try:
            buffer, _ = shm.Receiver.open(shm.Receiver.parse({"transport": "shm", "path": raw, "nbytes": 8}))
        except (ValueError, OSError):
            mapped = False
        else:
            mapped = True
            assert buffer.numel() == 8
        ok = created and kind == "regular" and shm_files.SEGMENT_NAME.fullmatch(name) is not None
        assert mapped == ok, (raw, kind)
    finally:
        if created:
            if kind == "directory":
                path.rmdir()
            else:
                path.unlink()


# ============================================================================================ profile check
@pytest.mark.slow
def test_slow_profile_is_active() -> None:
    """Run by ``make test-slow`` (HYPOTHESIS_PROFILE=slow, -m slow): proves the fuzz tests get 10,000 examples."""
    assert settings().max_examples >= 10_000
