"""Shared by the benchmark scripts: where results go, how tables print, and the docs pages that
publish them (each page says the date, commit, machine and command that produced it)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "processor": platform.processor() or platform.machine()}


def commit() -> str:
    """The checked-out commit (with '+changes' when the tree differs from it), or 'unknown'."""
    def git(*args):
        # --no-optional-locks: reading the status never takes the lock another git command may hold
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=HERE, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def provenance() -> dict:
    """When, where and how a figure was produced."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "machine": machine(), "command": " ".join(shlex.quote(x) for x in ["python", *sys.argv])}


def machine_text(m: dict) -> str:
    where = m.get("cuda") or f"{m.get('cpu_count')} CPU cores ({m.get('processor')})"
    return f"{where}, torch {m.get('torch')}, Python {m.get('python')}"


def write_json(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(), **payload}, indent=1))
    return path


def table_cells(head: list[str], rows: list[list]) -> tuple[list[list[str]], list[int]]:
    """The rows as strings, and each column's width."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    return cells, widths


def print_table(head: list[str], rows: list[list]) -> None:
    cells, widths = table_cells(head, rows)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def markdown_table(head: list[str], rows: list[list]) -> str:
    cells, _ = table_cells(head, rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])


def write_page(name: str, title: str, body: str, out: str | None = None) -> Path:
    """docs/<name>.md: `body` (Markdown) under a title and the line saying how it was produced.
    The page is the benchmark's output: regenerate it rather than edit it."""
    p = provenance()
    path = Path(out) if out else DOCS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n"
                    f"Written by `{p['command']}` on {p['date']}, commit `{p['commit']}`, on "
                    f"{machine_text(p['machine'])}. Regenerate it with the same command; do not edit it.\n\n"
                    f"{body.strip()}\n")
    return path
