"""Shared by the benchmark scripts: where results go, how tables print, and the docs pages that
publish them (each page says the date, commit, machine and command that produced it; that part lives
in raytrain_par/provenance.py, which `raytrain-par reproduce` writes its pages with too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"

sys.path.insert(0, str(HERE.parent))  # this checkout's package, installed or not
from raytrain_par.provenance import (commit, machine, machine_text, markdown_table, provenance,  # noqa: E402,F401
                                     table_cells)
from raytrain_par.provenance import write_page as provenance_page  # noqa: E402


def write_json(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(), **payload}, indent=1))
    return path


def print_table(head: list[str], rows: list[list]) -> None:
    cells, widths = table_cells(head, rows)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def write_page(name: str, title: str, body: str, out: str | None = None) -> Path:
    """docs/<name>.md: `body` (Markdown) under a title and the line saying how it was produced.
    The page is the benchmark's output: regenerate it rather than edit it."""
    return provenance_page(Path(out) if out else DOCS / f"{name}.md", title, body)
