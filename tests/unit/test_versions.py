"""weight_version_of / weight_versions_of on outputs shaped like vLLM 0.32's (no engine)."""

from __future__ import annotations

import doctest
from types import SimpleNamespace as NS
from typing import Any

import pytest

import hotweights
from hotweights import versions
from hotweights.versions import VersionSpan, WeightVersions, weight_version_of, weight_versions_of


def completion(*spans: tuple[str, int, int], index: int = 0, finish: str | None = "length") -> Any:
    labels = [NS(version=v, start=s, end=e) for v, s, e in spans] if finish is not None else None
    return NS(index=index, finish_reason=finish, weight_versions=labels)


def request(*completions: Any) -> Any:
    return NS(outputs=list(completions))


def test_one_version_is_an_int() -> None:
    out = request(completion(("7", 0, 8)))
    assert weight_version_of(out) == 7
    assert weight_version_of(out.outputs[0]) == 7
    assert weight_versions_of(out) == WeightVersions((VersionSpan(7, 0, 8),))


def test_initial_weights_are_none() -> None:
    out = request(completion((versions.INITIAL_LABEL, 0, 8)))
    assert weight_version_of(out) is None
    assert weight_versions_of(out).versions == (None,)


def test_mixed_versions_refused_by_the_single_form_and_spelled_out_by_the_spans() -> None:
    out = request(completion(("default", 0, 3), ("1", 3, 10), ("2", 10, 80)))
    with pytest.raises(ValueError, match=r"initial \[0:3\], v1 \[3:10\], v2 \[10:80\].*weight_versions_of"):
        weight_version_of(out)
    spans = weight_versions_of(out)
    assert spans.mixed and spans.first is None and spans.last == 2 and spans.versions == (None, 1, 2)
    assert [(s.start, s.end) for s in spans.spans] == [(0, 3), (3, 10), (10, 80)]


def test_several_completions_keep_their_index() -> None:
    out = request(completion(("4", 0, 5)), completion(("4", 0, 2), ("5", 2, 5), index=1))
    spans = weight_versions_of(out)
    assert [s.index for s in spans.spans] == [0, 1, 1]
    assert spans.versions == (4, 5)
    assert weight_version_of(out.outputs[0]) == 4
    with pytest.raises(ValueError, match="more than one"):
        weight_version_of(out)


def test_unfinished_output_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not finished.*last output"):
        weight_version_of(request(completion(finish=None)))


def test_finished_without_labels_is_refused() -> None:
    with pytest.raises(ValueError, match="no weight versions"):
        weight_versions_of(NS(index=0, finish_reason="length", weight_versions=None))


def test_no_tokens_has_no_version() -> None:
    out = request(completion())
    assert weight_versions_of(out).spans == ()
    with pytest.raises(ValueError, match="no tokens"):
        weight_version_of(out)


def test_foreign_label_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'step-3' is not one hotweights records"):
        weight_version_of(request(completion(("step-3", 0, 4))))


def test_spans_are_frozen_values() -> None:
    span = VersionSpan(1, 0, 2)
    with pytest.raises(AttributeError):
        span.version = 2  # type: ignore[misc]
    assert span == VersionSpan(1, 0, 2, index=0)


def test_module_is_pure_and_its_examples_run() -> None:
    assert "vllm" not in vars(versions)
    assert doctest.testmod(versions).failed == 0


def test_exported() -> None:
    assert hotweights.weight_version_of is weight_version_of
    assert hotweights.weight_versions_of is weight_versions_of
    assert "WeightVersions" in versions.__all__  # its home; not in hotweights.__all__
    assert "WeightVersions" not in hotweights.__all__


def test_a_servers_json_answer_is_read_like_an_output() -> None:
    """vLLM's token-in/token-out route (``/inference/v1/generate``) answers JSON: the answer, or one of its choices."""
    answer = {
        "choices": [
            {"index": 0, "finish_reason": "length", "weight_versions": [{"version": "4", "start": 0, "end": 3}]},
            {"index": 1, "finish_reason": "length", "weight_versions": [{"version": "default", "start": 0, "end": 2},
                                                                         {"version": "5", "start": 2, "end": 6}]},
        ]
    }  # fmt: skip
    assert weight_version_of(answer["choices"][0]) == 4
    spans = weight_versions_of(answer).spans
    assert [(s.index, s.version, s.start, s.end) for s in spans] == [(0, 4, 0, 3), (1, None, 0, 2), (1, 5, 2, 6)]
    with pytest.raises(ValueError, match="more than one weight version"):
        weight_version_of(answer)
    with pytest.raises(ValueError, match="not finished"):
        weight_versions_of({"index": 0, "finish_reason": None})
