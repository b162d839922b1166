"""Tables of already formatted cells, for the terminal (columns right-aligned, two spaces apart) and
for Markdown pages: every table the package and its benchmarks print or write goes through these."""

from __future__ import annotations


def table_cells(head: list[str], rows: list[list]) -> tuple[list[list[str]], list[int]]:
    """The rows as strings, and each column's width."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    return cells, widths


def text_table(head: list[str], rows: list[list]) -> str:
    cells, widths = table_cells(head, rows)
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *cells])


def markdown_table(head: list[str], rows: list[list]) -> str:
    cells, _ = table_cells(head, rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
