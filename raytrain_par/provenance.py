"""Generated pages: what produced them (date, commit, machine, command), their tables, and the line
under their title that marks them as output to regenerate, never to edit by hand.

Used by `raytrain-par reproduce` and by the benchmark scripts (through benchmarks/common.py);
tests/test_docs.py recognises a generated page by GENERATED_MARK.
"""

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
GENERATED_MARK = "Regenerate it with the same command; do not edit it."


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


def provenance(command: str | None = None) -> dict:
    """When, where and how a figure was produced (the command: this process's, unless given)."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "machine": machine(), "command": command or cli_command()}


RUNS_FILE = "provenance.json"


def cli_command() -> str:
    """This process's command line as the user typed it: `raytrain-par ...` for the console script."""
    argv = sys.argv
    if argv and Path(argv[0]).name == "raytrain-par":
        argv = ["raytrain-par", *argv[1:]]
    else:
        argv = ["python", *argv]
    return " ".join(shlex.quote(x) for x in argv)


def record_run(results_dir: str | Path) -> dict:
    """Append this run's provenance (command, commit, date, the launching machine) to the results
    directory's provenance.json: a resumed run adds its own entry beside the first one's."""
    path = Path(results_dir) / RUNS_FILE
    made = provenance()
    part = path.with_suffix(".part")  # replaced whole: a run killed while writing leaves the last good file
    part.write_text(json.dumps({"runs": [*runs_of(results_dir), made]}, indent=1) + "\n")
    os.replace(part, path)
    return made


def runs_of(results_dir: str | Path) -> list[dict]:
    """The runs record_run noted in a results directory (none for one written before it existed)."""
    path = Path(results_dir) / RUNS_FILE
    try:
        return list(json.loads(path.read_text())["runs"]) if path.exists() else []
    except (ValueError, KeyError, TypeError):  # not what record_run writes: the runs are unknown, not an error
        return []


def machine_device(m: dict) -> str:
    """What a `machine()` computed on: its GPU, or its CPU core count."""
    return m.get("cuda") or f"{m.get('cpu_count')} CPU cores"


def machine_text(m: dict) -> str:
    where = machine_device(m) + ("" if m.get("cuda") else f" ({m.get('processor')})")
    return f"{where}, torch {m.get('torch')}, Python {m.get('python')}"


def write_page(path: str | Path, title: str, body: str, command: str | None = None, made: dict | None = None) -> Path:
    """`body` (Markdown) under a title and the line saying how it was produced and not to edit it. `made`:
    the provenance taken when the run started (else now), so that the page's own files, rewritten by the
    run, do not count as changes to the commit it names."""
    p = made or provenance(command)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n"
                    f"Written by `{p['command']}` on {p['date']}, commit `{p['commit']}`, on "
                    f"{machine_text(p['machine'])}. {GENERATED_MARK}\n\n"
                    f"{body.strip()}\n")
    return path
