"""The lazy ``name -> "module:attr"`` registry behind transports, adapter routes and engine handles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hotweights.core.errors import HotWeightsError
from hotweights.core.registry import LazyRegistry


def test_load_imports_the_attribute_or_the_module() -> None:
    registry = LazyRegistry("codec")
    registry.register("dumps", "json:dumps")
    registry.register("module", "json")
    assert registry.load("dumps") is json.dumps
    assert registry.load("module") is json


def test_a_read_only_mapping_of_the_targets() -> None:
    registry = LazyRegistry("codec")
    registry.register("b", "json:loads")
    registry.register("a", "json:dumps")
    assert "a" in registry and "c" not in registry
    assert registry["a"] == "json:dumps"
    assert registry.names() == ["a", "b"] == sorted(registry)
    assert len(registry) == 2
    assert dict(registry) == {"a": "json:dumps", "b": "json:loads"}


def test_an_unknown_name_lists_what_exists() -> None:
    registry = LazyRegistry("codec")
    registry.register("json", "json:dumps")
    with pytest.raises(HotWeightsError, match=r"unknown codec 'yaml'; available: \['json'\]"):
        registry.load("yaml")


def test_a_taken_name_is_refused_and_the_first_stands() -> None:
    registry = LazyRegistry("codec")
    registry.register("json", "json:dumps")
    with pytest.raises(ValueError, match=r"codec 'json' is already registered \(by json:dumps\).*\['json'\]"):
        registry.register("json", "pickle:dumps")
    assert registry.load("json") is json.dumps


def test_the_same_target_again_is_a_no_op() -> None:
    registry = LazyRegistry("codec")
    registry.register("json", "json:dumps")
    registry.register("json", "json:dumps")
    assert registry.names() == ["json"]


@pytest.mark.parametrize("target", ["", ":dumps", "json:"])
def test_a_target_that_is_not_a_dotted_path_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match=r"is not 'package\.module' or 'package\.module:name'"):
        LazyRegistry("codec").register("x", target)


def test_copy_is_independent() -> None:
    registry = LazyRegistry("codec")
    registry.register("json", "json:dumps")
    other = registry.copy()
    other.register("pickle", "pickle:dumps")
    assert registry.names() == ["json"]
    assert other.names() == ["json", "pickle"]
    assert other.kind == "codec"


def test_registering_imports_nothing() -> None:
    code = (
        "import sys\n"
        "from hotweights.core.registry import LazyRegistry\n"
        "r = LazyRegistry('codec')\n"
        "r.register('x', 'xml.dom.minidom:parseString')\n"
        "assert 'xml.dom.minidom' not in sys.modules\n"
        "r.load('x')\n"
        "assert 'xml.dom.minidom' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_three_registries_use_it() -> None:
    from hotweights import handles, transports
    from hotweights.adapters import registry

    assert isinstance(transports._REGISTRY, LazyRegistry)
    assert isinstance(registry._ROUTES, LazyRegistry)
    assert isinstance(handles._KINDS, LazyRegistry)
    assert {"inprocess", "extension", "weight_transfer", "weights_path"} <= set(registry._ROUTES)
    assert handles._KINDS.names() == ["async_llm", "llm"]
