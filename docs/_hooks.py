"""mkdocs hooks of the hotweights site (``hooks:`` in mkdocs.yml; not a page).

- The README is the site's Quickstart page (``quickstart.md``, generated at build time), so it is written once.
  Its ``docs/...`` links become site links, its links to other repository files (``examples/...``) plain text, and
  ``../README.md`` links in the pages point at the Quickstart.
- The nav lists pages that may not exist yet (pages being written); missing ones are left out, with an INFO line.
- Sphinx roles in docstrings (``:class:`X```) are shown as plain code.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.hotweights")

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = "quickstart.md"

_LINK = re.compile(r"\]\(([^)\s#]+\.md)(#[^)\s]*)?\)")
_REPO_LINK = re.compile(r"\[([^\]]+)\]\((?!docs/|[a-z]+://|#)[^)\s]+\)")
_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc|obj):(<code>)~?")


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    config["nav"] = _existing(config["nav"], docs)
    return config


def _existing(nav: list[Any], docs: Path) -> list[Any]:
    kept: list[Any] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            value = _existing(value, docs)
            if value:
                kept.append({next(iter(entry)): value} if isinstance(entry, dict) else value)
        elif value == QUICKSTART or "://" in value or (docs / value).is_file():
            kept.append(entry)
        else:
            log.info("nav: %s does not exist (yet); left out", value)
    return kept


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = _REPO_LINK.sub(r"\1", readme)  # links to repository files (examples/...) outside the site: text only
    files.append(File.generated(config, QUICKSTART, content=readme.replace("](docs/", "](")))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def relink(m: re.Match[str]) -> str:
        target, anchor = m.group(1), m.group(2) or ""
        where = posixpath.normpath(posixpath.join(here, target))
        if where == "../README.md":
            return f"]({posixpath.relpath(QUICKSTART, here or '.')}{anchor})"
        return m.group(0)

    return _LINK.sub(relink, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub(r"\1", html)
