"""Render the architectures x paths table of ``docs/architectures.md`` from the cells the conformance suite ran
(``docs/architectures.json``, written by ``make test-matrix``). Run by ``make test-matrix``; not a docs page."""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
PATHS = [
    "in-process",
    "zero-config",
    "extension auto",
    "extension reload atomic",
    "extension reload streaming",
    "extension direct atomic",
    "extension aside atomic",
    "extension delta",
    "verify reads back",
    "bf16 engine, fp32 cast",
]


#: Cells the suite does not run, and why (everything else it ran, or says "not run").
TRANSFORMERS_BACKEND_IN_PROCESS = (
    "not supported: vLLM serves it through its Transformers backend, which breaks the trainer's model of that class "
    "in the same process"
)


def not_run(variant: str, path: str) -> str:
    from hotweights.testing import MOE_ARCHS, TRANSFORMERS_BACKEND

    arch = variant.rsplit("-", 2)[0]
    if path == "in-process" and arch in TRANSFORMERS_BACKEND:
        return TRANSFORMERS_BACKEND_IN_PROCESS
    if path == "bf16 engine, fp32 cast" and arch not in MOE_ARCHS:
        return "—"
    return "not run"


def table(cells: dict[str, dict[str, str]]) -> str:
    lines = ["| model | " + " | ".join(PATHS) + " |", "|---" * (len(PATHS) + 1) + "|"]
    for variant in sorted(cells):
        row = [cells[variant].get(p, not_run(variant, p)).replace("|", "/") for p in PATHS]
        lines.append(f"| {variant} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    cells = json.loads((DOCS / "architectures.json").read_text())
    page = DOCS / "architectures.md"
    text = page.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{table(cells)}\n{END}{tail}")


if __name__ == "__main__":
    main()
