"""TensorSpec, WeightUpdateManifest and ExpectedWeights: building, (de)serialising and validating."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pydantic
import pytest
import torch
from safetensors.torch import load_file, save_file

from hotweights import (
    ExpectedWeights,
    TensorSpec,
    WeightLayout,
    WeightManifestValidationError,
    WeightUpdateManifest,
)


def _state_dict() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.zeros(10, 4, dtype=torch.bfloat16),  # 80 bytes
        "layer.bias": torch.ones(4),  # 16 bytes
        "step": torch.tensor(3, dtype=torch.int64),  # 8 bytes, 0-d
    }


def _kinds_and_names(exc: WeightManifestValidationError) -> set[tuple[str, str]]:
    return {(m.kind, m.name) for m in exc.mismatches}


# ---------------------------------------------------------------------------------------------- TensorSpec
class TestTensorSpec:
    def test_of_records_shape_dtype_and_nbytes(self) -> None:
        spec = TensorSpec.of(torch.zeros(2, 3, dtype=torch.bfloat16))
        assert spec.shape == (2, 3)
        assert spec.dtype == "torch.bfloat16"
        assert spec.nbytes == 12
        assert spec.torch_dtype is torch.bfloat16
        assert spec.numel == 6
        assert spec.expected_nbytes == 12

    def test_of_scalar_and_empty_tensors(self) -> None:
        scalar = TensorSpec.of(torch.tensor(7, dtype=torch.int64))
        assert (scalar.shape, scalar.numel, scalar.nbytes) == ((), 1, 8)
        empty = TensorSpec.of(torch.zeros(0, 5))
        assert (empty.shape, empty.numel, empty.nbytes) == ((0, 5), 0, 0)

    def test_of_non_contiguous_tensor_uses_logical_size(self) -> None:
        spec = TensorSpec.of(torch.zeros(4, 6).t())
        assert spec.shape == (6, 4)
        assert spec.nbytes == 96 == spec.expected_nbytes

    @pytest.mark.parametrize(
        ("given", "normalised"),
        [
            ("float32", "torch.float32"),
            ("torch.float32", "torch.float32"),
            ("bfloat16", "torch.bfloat16"),
            ("float", "torch.float32"),
            ("half", "torch.float16"),
            ("torch.int8", "torch.int8"),
            ("bool", "torch.bool"),
        ],
    )
    def test_dtype_string_is_normalised(self, given: str, normalised: str) -> None:
        assert TensorSpec(shape=(1,), dtype=given).dtype == normalised

    @pytest.mark.parametrize("bad", ["float33", "torch.float33", "Tensor", "Size", "", "torch.", "FLOAT32"])
    def test_unknown_dtype_is_refused(self, bad: str) -> None:
        with pytest.raises(pydantic.ValidationError, match="is not a torch dtype"):
            TensorSpec(shape=(1,), dtype=bad)

    def test_consistent_nbytes_is_accepted(self) -> None:
        spec = TensorSpec(shape=(2, 3), dtype="float16", nbytes=12)
        assert spec.nbytes == 12

    @pytest.mark.parametrize("nbytes", [0, 6, 13, 24])
    def test_inconsistent_nbytes_is_refused(self, nbytes: int) -> None:
        with pytest.raises(pydantic.ValidationError, match=rf"nbytes {nbytes} does not match .* \(12 bytes\)"):
            TensorSpec(shape=(2, 3), dtype="float16", nbytes=nbytes)

    def test_negative_nbytes_is_refused(self) -> None:
        with pytest.raises(pydantic.ValidationError, match="greater than or equal to 0"):
            TensorSpec(shape=(0,), dtype="float32", nbytes=-1)

    @pytest.mark.parametrize("shape", [(-1,), (2, -3), (4, 0, -1)])
    def test_negative_shape_is_refused(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(pydantic.ValidationError, match="negative dimension"):
            TensorSpec(shape=shape, dtype="float32")

    def test_is_frozen_and_hashable(self) -> None:
        spec = TensorSpec(shape=(2,), dtype="float32")
        with pytest.raises(pydantic.ValidationError, match="frozen"):
            spec.shape = (3,)  # type: ignore[misc]
        assert spec.shape == (2,)
        assert hash(spec) == hash(TensorSpec(shape=(2,), dtype="torch.float32"))

    def test_extra_fields_are_refused(self) -> None:
        with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
            TensorSpec(shape=(2,), dtype="float32", device="cuda")  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------- builders
class TestFromStateDict:
    def test_mapping(self) -> None:
        sd = _state_dict()
        m = WeightUpdateManifest.from_state_dict(sd, weight_version=3)
        assert m.weight_version == 3
        assert list(m.tensors) == ["embed.weight", "layer.bias", "step"]
        assert m.tensors["embed.weight"] == TensorSpec(shape=(10, 4), dtype="torch.bfloat16", nbytes=80)
        assert m.tensors["step"] == TensorSpec(shape=(), dtype="torch.int64", nbytes=8)
        assert len(m) == 3
        assert m.layout == WeightLayout()
        assert m.metadata == {}
        assert len(m.update_id) == 32
        int(m.update_id, 16)  # a uuid4 hex
        assert WeightUpdateManifest.from_state_dict(sd, weight_version=3).update_id != m.update_id

    def test_list_of_pairs_and_generator_match_mapping(self) -> None:
        sd = _state_dict()
        from_map = WeightUpdateManifest.from_state_dict(sd, weight_version=1, update_id="u")
        from_pairs = WeightUpdateManifest.from_state_dict(list(sd.items()), weight_version=1, update_id="u")
        from_gen = WeightUpdateManifest.from_state_dict(
            ((n, t) for n, t in sd.items()), weight_version=1, update_id="u"
        )
        assert from_pairs == from_map
        assert from_gen == from_map
        assert list(from_pairs.tensors) == list(sd)

    def test_passes_through_update_id_layout_and_metadata(self) -> None:
        layout = WeightLayout(tp_rank=1, tp_size=2)
        m = WeightUpdateManifest.from_state_dict(
            _state_dict(),
            weight_version=9,
            update_id="run-7/step-9",
            layout=layout,
            metadata={"run": "r7", "lr": 0.5},
        )
        assert m.update_id == "run-7/step-9"
        assert m.layout == layout
        assert m.metadata == {"run": "r7", "lr": 0.5}

    def test_non_tensors_and_duplicates_are_all_listed(self) -> None:
        items = [
            ("a", torch.zeros(2)),
            ("b", [1.0, 2.0]),
            ("c", None),
            ("a", torch.ones(2)),
            ("d", torch.zeros(1)),
        ]
        with pytest.raises(WeightManifestValidationError) as info:
            WeightUpdateManifest.from_state_dict(items, weight_version=0)  # type: ignore[arg-type]
        err = info.value
        assert _kinds_and_names(err) == {("not_tensor", "b"), ("not_tensor", "c"), ("manifest", "a")}
        assert len(err.mismatches) == 3
        actual = {m.name: m.actual for m in err.mismatches}
        assert actual == {"b": "list", "c": "NoneType", "a": "name appears more than once"}
        msg = str(err)
        assert msg.startswith("manifest refused, nothing was written: 3 mismatch(es)")
        for name in ("'b'", "'c'", "a: name appears more than once"):
            assert name in msg
        assert "'d'" not in msg and "d:" not in msg

    def test_empty_is_refused(self) -> None:
        with pytest.raises(WeightManifestValidationError, match="at least one tensor") as info:
            WeightUpdateManifest.from_state_dict({}, weight_version=0)
        assert _kinds_and_names(info.value) == {("manifest", "tensors")}

    @pytest.mark.parametrize("name", ["", " w", "w "])
    def test_blank_or_padded_names_are_refused(self, name: str) -> None:
        with pytest.raises(WeightManifestValidationError, match="non-empty without surrounding spaces"):
            WeightUpdateManifest.from_state_dict({name: torch.zeros(1)}, weight_version=0)

    def test_negative_version_is_refused(self) -> None:
        with pytest.raises(WeightManifestValidationError) as info:
            WeightUpdateManifest.from_state_dict(_state_dict(), weight_version=-1)
        assert _kinds_and_names(info.value) == {("manifest", "weight_version")}


def test_from_module_describes_state_dict() -> None:
    module = torch.nn.Linear(3, 2)
    module.register_buffer("kept", torch.zeros(5, dtype=torch.int32))
    module.register_buffer("scratch", torch.zeros(7), persistent=False)
    m = WeightUpdateManifest.from_module(module, weight_version=4, update_id="mod")
    assert list(m.tensors) == ["weight", "bias", "kept"]
    assert m.tensors["weight"].shape == (2, 3)
    assert m.tensors["bias"].shape == (2,)
    assert m.tensors["kept"] == TensorSpec(shape=(5,), dtype="torch.int32", nbytes=20)
    assert (m.weight_version, m.update_id) == (4, "mod")
    m.validate(module.state_dict())


class TestFromSafetensors:
    @pytest.fixture
    def ckpt(self, tmp_path: Path) -> Path:
        save_file(
            {"a.weight": torch.zeros(2, 3), "a.bias": torch.zeros(3, dtype=torch.bfloat16)},
            str(tmp_path / "model-00001-of-00002.safetensors"),
        )
        save_file(
            {"b.weight": torch.zeros(4, 4, dtype=torch.float16)},
            str(tmp_path / "model-00002-of-00002.safetensors"),
        )
        return tmp_path

    def test_single_file(self, ckpt: Path) -> None:
        m = WeightUpdateManifest.from_safetensors(ckpt / "model-00001-of-00002.safetensors", weight_version=2)
        assert set(m.tensors) == {"a.weight", "a.bias"}
        assert m.tensors["a.weight"] == TensorSpec(shape=(2, 3), dtype="torch.float32")
        assert m.tensors["a.bias"] == TensorSpec(shape=(3,), dtype="torch.bfloat16")
        assert m.weight_version == 2
        assert m.total_bytes == 24 + 6

    def test_str_path_and_list_of_paths(self, ckpt: Path) -> None:
        files = sorted(ckpt.glob("*.safetensors"))
        from_str = WeightUpdateManifest.from_safetensors(str(files[1]), weight_version=0)
        assert set(from_str.tensors) == {"b.weight"}
        from_list = WeightUpdateManifest.from_safetensors([str(f) for f in files], weight_version=0)
        assert set(from_list.tensors) == {"a.weight", "a.bias", "b.weight"}

    def test_directory_reads_every_file(self, ckpt: Path) -> None:
        m = WeightUpdateManifest.from_safetensors(ckpt, weight_version=5, update_id="dir")
        assert set(m.tensors) == {"a.weight", "a.bias", "b.weight"}
        assert m.tensors["b.weight"] == TensorSpec(shape=(4, 4), dtype="torch.float16")
        assert m.total_bytes == 24 + 6 + 32
        loaded: dict[str, torch.Tensor] = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            loaded.update(load_file(str(f)))
        m.validate(loaded)

    def test_directory_with_index_reads_only_indexed_files(self, ckpt: Path) -> None:
        index = {"metadata": {}, "weight_map": {"b.weight": "model-00002-of-00002.safetensors"}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        m = WeightUpdateManifest.from_safetensors(ckpt, weight_version=0)
        assert set(m.tensors) == {"b.weight"}

    def test_empty_directory_raises_file_not_found(self, tmp_path: Path) -> None:
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in") as info:
            WeightUpdateManifest.from_safetensors(tmp_path, weight_version=0)
        assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------------------------------------- JSON
class TestJson:
    def test_round_trip(self) -> None:
        m = WeightUpdateManifest.from_state_dict(
            _state_dict(),
            weight_version=7,
            layout=WeightLayout(tp_rank=0, tp_size=1),
            metadata={"run": "abc", "lr": 0.1, "ok": True, "none": None, "n": 3},
        )
        text = m.to_json()
        back = WeightUpdateManifest.from_json(text)
        assert back == m
        assert list(back.tensors) == list(m.tensors)
        assert WeightUpdateManifest.from_json(text.encode()) == m
        data = json.loads(text)
        assert data["weight_version"] == 7
        assert data["update_id"] == m.update_id
        assert data["tensors"]["embed.weight"] == {
            "shape": [10, 4],
            "dtype": "torch.bfloat16",
            "nbytes": 80,
            "digest": None,
        }
        assert data["metadata"]["none"] is None

    def test_round_trip_through_parse(self) -> None:
        m = WeightUpdateManifest.from_state_dict(_state_dict(), weight_version=1)
        assert WeightUpdateManifest.parse(json.loads(m.to_json())) == m

    _SPEC: ClassVar[dict[str, object]] = {"shape": [2], "dtype": "float32"}

    @pytest.mark.parametrize(
        ("text", "field"),
        [
            ("{not json", "manifest"),
            ("", "manifest"),
            ("[]", "manifest"),
            ("42", "manifest"),
            (json.dumps({"tensors": {"w": _SPEC}}), "weight_version"),
            (json.dumps({"weight_version": "abc", "tensors": {"w": _SPEC}}), "weight_version"),
            (json.dumps({"weight_version": 1.5, "tensors": {"w": _SPEC}}), "weight_version"),
            (json.dumps({"weight_version": -1, "tensors": {"w": _SPEC}}), "weight_version"),
            (json.dumps({"weight_version": 1, "tensors": [["w", _SPEC]]}), "tensors"),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": {"shape": "x", "dtype": "float32"}}}),
                "tensors.w.shape",
            ),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": {"shape": [2], "dtype": "float33"}}}),
                "tensors.w.dtype",
            ),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": {"shape": [-2], "dtype": "float32"}}}),
                "tensors.w.shape",
            ),
            (json.dumps({"weight_version": 1, "tensors": {"w": {**_SPEC, "nbytes": 3}}}), "tensors.w"),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": {**_SPEC, "color": "red"}}}),
                "tensors.w.color",
            ),
            (json.dumps({"weight_version": 1, "tensors": {"w": _SPEC}, "extra": 1}), "extra"),
            (json.dumps({"weight_version": 1, "tensors": {"w": _SPEC}, "layout": {"tp_rank": 1}}), "layout"),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": _SPEC}, "layout": {"format": "fused"}}),
                "layout.format",
            ),
            (
                json.dumps({"weight_version": 1, "tensors": {"w": _SPEC}, "metadata": {"k": [1]}}),
                "metadata.k",
            ),
            (json.dumps({"weight_version": 1, "tensors": {"w": _SPEC}, "update_id": ""}), "update_id"),
        ],
    )
    def test_bad_input_raises_our_error_not_pydantics(self, text: str, field: str) -> None:
        with pytest.raises(WeightManifestValidationError) as info:
            WeightUpdateManifest.from_json(text)
        err = info.value
        assert not isinstance(err, pydantic.ValidationError)
        assert isinstance(err.__cause__, pydantic.ValidationError)
        assert {m.kind for m in err.mismatches} == {"manifest"}
        names = [m.name for m in err.mismatches]
        assert any(n == field or n.startswith(field + ".") for n in names), names
        assert str(err).startswith("manifest refused, nothing was written:")
        assert "fix (manifest):" in str(err)

    def test_every_bad_field_is_listed(self) -> None:
        text = json.dumps(
            {
                "weight_version": -3,
                "tensors": {"w": {"shape": [2], "dtype": "nope"}},
                "layout": {"tp_size": 0},
                "x": 1,
            }
        )
        with pytest.raises(WeightManifestValidationError) as info:
            WeightUpdateManifest.from_json(text)
        names = {m.name for m in info.value.mismatches}
        assert {"weight_version", "tensors.w.dtype", "layout.tp_size", "x"} <= names

    def test_bool_weight_version_is_refused(self) -> None:
        text = json.dumps({"weight_version": True, "tensors": {"w": {"shape": [2], "dtype": "float32"}}})
        with pytest.raises(WeightManifestValidationError):
            WeightUpdateManifest.from_json(text)


# ---------------------------------------------------------------------------------------------- validate
class TestValidate:
    @pytest.fixture
    def manifest(self) -> WeightUpdateManifest:
        sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(5), "ok": torch.zeros(1)}
        return WeightUpdateManifest.from_state_dict(sd, weight_version=1)

    def test_matching_tensors_pass(self, manifest: WeightUpdateManifest) -> None:
        tensors = {"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(5), "ok": torch.ones(1)}
        assert manifest.mismatches(tensors) == []
        assert manifest.validate(tensors) is None
        assert manifest.validate(list(tensors.items())) is None

    def test_names_every_mismatch_at_once(self, manifest: WeightUpdateManifest) -> None:
        tensors = {
            "a": torch.zeros(3, 2),  # shape
            "b": torch.zeros(4, dtype=torch.float16),  # dtype
            # "c" missing
            "d": torch.zeros(1),  # unexpected
            "ok": torch.zeros(1),
        }
        with pytest.raises(WeightManifestValidationError) as info:
            manifest.validate(tensors)
        err = info.value
        assert _kinds_and_names(err) == {
            ("shape", "a"),
            ("dtype", "b"),
            ("missing", "c"),
            ("unexpected", "d"),
        }
        assert len(err.mismatches) == 4
        by_kind = {m.kind: m for m in err.mismatches}
        assert (by_kind["shape"].expected, by_kind["shape"].actual) == ("[2, 3]", "[3, 2]")
        assert (by_kind["dtype"].expected, by_kind["dtype"].actual) == ("torch.float32", "torch.float16")
        msg = str(err)
        assert msg.startswith("weight update refused, nothing was written: 4 mismatch(es)")
        for name in ("'a'", "'b'", "'c'", "'d'"):
            assert name in msg
        assert "'ok'" not in msg
        for kind in ("dtype", "missing", "shape", "unexpected"):
            assert f"fix ({kind}):" in msg

    def test_shape_and_dtype_of_one_tensor_both_reported(self, manifest: WeightUpdateManifest) -> None:
        tensors = {
            "a": torch.zeros(6, dtype=torch.int32),
            "b": torch.zeros(4),
            "c": torch.zeros(5),
            "ok": torch.zeros(1),
        }
        with pytest.raises(WeightManifestValidationError) as info:
            manifest.validate(tensors)
        assert _kinds_and_names(info.value) == {("shape", "a"), ("dtype", "a")}

    def test_non_tensor_value_is_reported(self, manifest: WeightUpdateManifest) -> None:
        tensors = {"a": "not a tensor", "b": torch.zeros(4), "c": torch.zeros(5), "ok": torch.zeros(1)}
        with pytest.raises(WeightManifestValidationError) as info:
            manifest.validate(tensors)  # type: ignore[arg-type]
        assert ("not_tensor", "a") in _kinds_and_names(info.value)
        assert "fix (not_tensor): pass torch.Tensor values" in str(info.value)


def test_total_bytes() -> None:
    m = WeightUpdateManifest.from_state_dict(_state_dict(), weight_version=0)
    assert m.total_bytes == 80 + 16 + 8
    specs_only = WeightUpdateManifest.parse(
        {
            "weight_version": 0,
            "tensors": {"x": {"shape": [3, 5], "dtype": "float64"}, "y": {"shape": [0], "dtype": "int8"}},
        }
    )
    assert specs_only.total_bytes == 120


# ------------------------------------------------------------------------------------------ ExpectedWeights
class TestExpectedWeights:
    @pytest.fixture
    def expected(self) -> ExpectedWeights:
        return ExpectedWeights(
            tensors={
                "embed.weight": TensorSpec(shape=(10, 4), dtype="bfloat16"),
                "norm.weight": TensorSpec(shape=(4,), dtype="float32"),
            },
            ignored={"lm_head.weight": "tied to embed.weight"},
        )

    def _manifest(self, **tensors: torch.Tensor) -> WeightUpdateManifest:
        return WeightUpdateManifest.from_state_dict(
            {k.replace("__", "."): v for k, v in tensors.items()}, weight_version=0
        )

    def test_ignored_name_is_not_a_mismatch(self, expected: ExpectedWeights) -> None:
        m = self._manifest(
            embed__weight=torch.zeros(10, 4, dtype=torch.bfloat16),
            norm__weight=torch.zeros(4),
            lm_head__weight=torch.zeros(10, 4, dtype=torch.bfloat16),
        )
        assert expected.mismatches(m) == []

    def test_ignored_name_may_be_absent(self, expected: ExpectedWeights) -> None:
        m = self._manifest(embed__weight=torch.zeros(10, 4, dtype=torch.bfloat16), norm__weight=torch.zeros(4))
        assert expected.mismatches(m) == []

    def test_every_difference_is_reported(self, expected: ExpectedWeights) -> None:
        m = self._manifest(
            embed__weight=torch.zeros(10, 4),  # dtype
            lm_head__weight=torch.zeros(10, 4, dtype=torch.bfloat16),  # ignored
            extra__weight=torch.zeros(2),  # unexpected
            # norm.weight missing
        )
        got = {(x.kind, x.name) for x in expected.mismatches(m)}
        assert got == {("dtype", "embed.weight"), ("unexpected", "extra.weight"), ("missing", "norm.weight")}

    def test_without_ignored_the_extra_name_is_unexpected(self) -> None:
        expected = ExpectedWeights(tensors={"w": TensorSpec(shape=(2,), dtype="float32")})
        m = self._manifest(w=torch.zeros(2), lm_head__weight=torch.zeros(2))
        assert [(x.kind, x.name) for x in expected.mismatches(m)] == [("unexpected", "lm_head.weight")]
