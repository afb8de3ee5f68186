"""docs/index.md's tree of ``src/hotweights`` names every module of the package, and only those.

The tree is the fenced block that starts with ``src/hotweights/``: one entry per line (``├── name`` or ``└── name``,
four columns per level), a package as ``name/`` (its ``__init__.py`` is the package itself), then the entry's role.
The package is read from the filesystem when the test runs, so a module added, moved or removed without its line in
the tree fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "hotweights"
INDEX = ROOT / "docs" / "index.md"

_ENTRY = re.compile(r"^(?P<indent>(?:[│ ] {3})*)[├└]── (?P<name>\S+)(?P<role>.*)$")


def tree_block(text: str) -> list[str]:
    """The lines of the fenced block whose first line is ``src/hotweights/``, that line excluded."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "src/hotweights/" and i > 0 and lines[i - 1].startswith("```"):
            block: list[str] = []
            for entry in lines[i + 1 :]:
                if entry.startswith("```"):
                    return block
                block.append(entry)
    raise AssertionError(f"{INDEX.relative_to(ROOT)} has no fenced block starting with 'src/hotweights/'")


def parse_tree(lines: list[str]) -> dict[str, str]:
    """Each entry's path relative to the package (a package ends with ``/``) -> its role.

    Lines without a branch (``├──`` / ``└──``) continue the role above them and are skipped.
    """
    entries: dict[str, str] = {}
    parents: list[str] = []
    for line in lines:
        m = _ENTRY.match(line)
        if m is None:
            continue
        depth = len(m["indent"]) // 4
        assert depth <= len(parents), f"entry deeper than its parent: {line!r}"
        del parents[depth:]
        path = "".join(parents) + m["name"]
        assert path not in entries, f"listed twice: {path}"
        entries[path] = m["role"].strip()
        if m["name"].endswith("/"):
            parents.append(m["name"])
    return entries


def package_modules() -> set[str]:
    """Every module of the package as the tree names it: ``x.py`` files, and each subpackage as ``name/``."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            found.add("/".join(rel.parts[:-1]) + "/")  # the package itself
        else:
            found.add(rel.as_posix())
    return found


def test_tree_lists_every_module_and_only_those() -> None:
    listed = parse_tree(tree_block(INDEX.read_text(encoding="utf-8")))
    actual = package_modules()
    missing = sorted(actual - set(listed))
    stale = sorted(set(listed) - actual)
    assert not missing, f"modules missing from the tree in docs/index.md: {missing}"
    assert not stale, f"the tree in docs/index.md names modules that do not exist: {stale}"


def test_every_entry_says_what_it_is() -> None:
    listed = parse_tree(tree_block(INDEX.read_text(encoding="utf-8")))
    assert not [path for path, role in listed.items() if not role], "entries without a role"


def test_parser_reads_nesting_and_continuations() -> None:
    lines = [
        "├── a.py            role a",
        "├── pkg/            a package",
        "│   ├── b.py        role b",
        "│   │               continued",
        "│   └── sub/        nested",
        "│       └── c.py    role c",
        "└── d.py            role d",
    ]
    assert parse_tree(lines) == {
        "a.py": "role a",
        "pkg/": "a package",
        "pkg/b.py": "role b",
        "pkg/sub/": "nested",
        "pkg/sub/c.py": "role c",
        "d.py": "role d",
    }
