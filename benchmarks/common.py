"""Shared by the benchmark scripts: where results go, how tables print, and the docs pages that
publish them (each page says the date, commit, machine and command that produced it; that part lives
in raytrain_par/provenance.py, which `raytrain-par reproduce` writes its pages with too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The benchmarks run from the repository's root (`python benchmarks/NAME.py`, as `make bench` does):
# their pages go to its docs/, their JSON to its benchmarks/results/, and where the package is not
# installed, its raytrain_par/ is imported.
REPO = Path.cwd()
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs"
README = REPO / "README.md"

sys.path.insert(0, str(REPO))
from raytrain_par.provenance import commit, machine, machine_device, machine_text, provenance  # noqa: E402,F401
from raytrain_par.tables import markdown_table, text_table  # noqa: E402,F401
from raytrain_par.provenance import write_page as provenance_page  # noqa: E402


def train_loop(rank: int, world: int, spec_dict: dict, info_dict: dict, root: str, verbose: bool = False) -> list[dict]:
    """The worker's training loop (worker.Trainer) on one rank of a process group (local_group.run_ranks),
    checkpoints through LocalReporter into `root` as Ray Train's workers write theirs; returns its records.
    `verbose`: rank 0 prints what the loop says (a resume, a change of batch)."""
    import torch

    from raytrain_par.config import from_dict
    from raytrain_par.data.shards import DatasetInfo, read_split
    from raytrain_par.strategies import DistContext
    from raytrain_par.worker import LocalReporter, Trainer, memory_train_loader

    spec, info = from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    ctx = DistContext.current(torch.device("cpu"))
    reporter = LocalReporter(root, ctx.rank, ctx.world_size, log=lambda *_: None)
    log = print if verbose and ctx.rank == 0 else (lambda *_: None)
    trainer = Trainer(spec, info, ctx, reporter, memory_train_loader(spec, read_split(info, info.train_path)),
                      read_split(info, info.val_path), log=log)
    return trainer.run()


def write_json(name: str, payload: dict, out: str | None = None, made: dict | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**(made or provenance()), **payload}, indent=1))
    return path


def print_table(head: list[str], rows: list[list]) -> None:
    print(text_table(head, rows))


def write_page(name: str, title: str, body: str, out: str | None = None, verdict: str | None = None,
               made: dict | None = None) -> Path:
    """docs/<name>.md: `body` (Markdown) under a title and the line saying how it was produced.
    The page is the benchmark's output: regenerate it rather than edit it. With `verdict` (what was
    measured against the target, and whether it was met), README.md's line for the benchmark says it
    too, when the page is the default one. `made`: the provenance of the measurement (default: now)."""
    made = made or provenance()
    page = provenance_page(Path(out) if out else DOCS / f"{name}.md", title, body, made=made)
    if verdict is not None and out is None:
        text = README.read_text()
        i, j = _target_block(text, name)
        line = (f"- [{title}](docs/{name}.md): {verdict} ({machine_device(made['machine'])}, {made['date'][:10]}, "
                f"commit `{made['commit']}`)")
        if i == j:  # its first verdict: a block of its own
            line = f"<!-- target {name} -->\n{line}\n<!-- /target -->"
            README.write_text(f"{text[:i]}\n{line}{text[j:]}")
        else:
            README.write_text(f"{text[:i]}\n{line}\n{text[j:]}")
    return page


def _target_block(text: str, name: str) -> tuple[int, int]:
    """Where README.md's block for `name` starts (after its opening mark) and ends (at its closing mark);
    a benchmark's first verdict goes after the last block there is (an empty range)."""
    start, end = f"<!-- target {name} -->", "<!-- /target -->"
    i = text.find(start)
    j = text.find(end, i) if i >= 0 else -1
    if j >= 0:
        return i + len(start), j
    last = text.rfind(end)
    if last < 0:
        raise SystemExit(f"README.md has no `<!-- target NAME -->` ... `{end}` block for benchmark verdicts; "
                         f"fix: add one under '## Targets', or write the page elsewhere with --page")
    return last + len(end), last + len(end)


def check_readme_target(name: str, out: str | None) -> None:
    """Before a benchmark that writes a verdict starts: README.md holds the block its line goes in."""
    if out is None:
        _target_block(README.read_text(), name)
