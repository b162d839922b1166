"""What a checkpoint costs the training thread: a sync save (training waits while the checkpoint is gathered,
written, summed and copied to the run directory) against an async one (training waits for the gathers
and a copy in host memory only; a background thread writes), in one run.

    python benchmarks/checkpoint_stall.py          # the quickstart model and a GPT-2 of ~106M parameters

Each case is the worker's own training loop (worker.Trainer, checkpoints through LocalReporter into a
run directory, as Ray Train's workers write theirs) on 2 ranks of a gloo process group, under ddp, zero-3
and megatron T=2, once with `train.checkpoint_mode: sync` and once with `async`: 18 steps, a checkpoint
every 6 (more training between two saves than a write takes, as in a real run). Every record carries the save's stall on the training thread (`checkpoint_stall_s`, with any
wait for the previous write, `checkpoint_wait_s`) and the write's time (`checkpoint_write_s`); the table
shows their medians over the run's 3 saves. Target (the larger model): the async stall at most 10% of
the sync save's. Prints a table and writes benchmarks/results/checkpoint_stall.json and
docs/checkpoint-stall.md (`--out`, `--page` elsewhere).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # run from the repository's root, as every benchmark (benchmarks/common.py)

from raytrain_par import data, models  # noqa: E402
from raytrain_par.config import load_experiment  # noqa: E402
from raytrain_par.local_group import run_ranks  # noqa: E402

from common import (REPO, check_readme_target, markdown_table, print_table, provenance, train_loop,  # noqa: E402
                    write_json, write_page)

MODELS = {
    "quickstart": [],
    "gpt2 106M": ["model={name: gpt2-small, n_layer: 14, dropout: 0.0}"],
}
STRATEGIES = {"ddp": "strategy={name: ddp}", "zero-3": "strategy={name: zero-3}",
              "megatron T=2": "strategy={name: megatron, tensor_parallel: 2}"}
COMMON = ["scaling.num_workers=2", "train.global_batch_size=2", "train.max_steps=18", "train.eval_every_steps=6",
          "train.eval_at_start=false", "train.checkpoint_every_evals=1", "train.warmup_steps=0",
          "train.lr_schedule=constant", "data.max_val_samples=8"]
TARGET = 0.10


def _median(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def measure(model: str, strategy: str, mode: str, work: Path) -> dict:
    spec = load_experiment(REPO / "experiments" / "quickstart.yaml",
                           [*COMMON, *MODELS[model], STRATEGIES[strategy], f"train.checkpoint_mode={mode}"])
    info = data.prepare(spec.data, log=lambda *_: None)
    params = sum(p.numel() for p in models.build(spec.model, info, 0)[0].parameters())
    root = work / f"{model}-{strategy}-{mode}".replace(" ", "_").replace("=", "")
    try:
        records = run_ranks(2, train_loop, spec.to_dict(), info.to_json(), str(root))[0]
        sizes = sum(f.stat().st_size for f in sorted(root.glob("checkpoint_*"))[-1].iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "parameters": params, "strategy": strategy, "mode": mode, "checkpoint_bytes": sizes,
            "saves": len([r for r in records if r.get("checkpoint_stall_s") is not None]),
            "stall_s": _median(records, "checkpoint_stall_s"), "wait_s": _median(records, "checkpoint_wait_s"),
            "write_s": _median(records, "checkpoint_write_s"), "step_time_s": _median(records, "step_time_s"),
            "stalls_s": [r["checkpoint_stall_s"] for r in records if r.get("checkpoint_stall_s") is not None],
            "final_loss": records[-1]["train_loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}")
    p.add_argument("--out", help="JSON path (default benchmarks/results/checkpoint_stall.json)")
    p.add_argument("--page", help="the docs page (default docs/checkpoint-stall.md)")
    a = p.parse_args()
    check_readme_target("checkpoint-stall", a.page)
    made = provenance()
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-") as work:
        for model in a.models.split(","):
            for strategy in a.strategies.split(","):
                for mode in ("sync", "async"):
                    rows.append(measure(model, strategy, mode, Path(work)))
                    r = rows[-1]
                    print(f"{model} {strategy} {mode}: stall {r['stall_s']:.3f} s, write {r['write_s']:.3f} s",
                          flush=True)
    table, verdicts = [], {}
    for model in a.models.split(","):
        for strategy in a.strategies.split(","):
            sync, background = ([r for r in rows if (r["model"], r["strategy"], r["mode"]) == (model, strategy, m)][0]
                                for m in ("sync", "async"))
            ratio = background["stall_s"] / sync["stall_s"]
            verdicts.setdefault(model, []).append(ratio)
            table.append([model, f"{sync['parameters'] / 1e6:.1f}M", strategy, f"{sync['checkpoint_bytes'] / 2**20:.0f}",
                          f"{sync['stall_s']:.3f}", f"{background['stall_s']:.3f}", f"{background['wait_s']:.3f}",
                          f"{background['write_s']:.3f}", f"{ratio:.2f}",
                          f"{sync['step_time_s']:.3f} / {background['step_time_s']:.3f}"])
    head = ["model", "parameters", "strategy", "checkpoint MiB", "sync save s", "async stall s", "of it waiting s",
            "async write s (background)", "async stall / sync save", "step s sync / async"]
    print_table(head, table)
    larger = list(MODELS)[-1]
    worst = max(verdicts.get(larger, [float("nan")]))
    met = worst <= TARGET
    verdict = (f"async stall / sync save at most {worst:.2f} over ddp, zero-3, megatron T=2 on {larger} "
               f"(target: at most {TARGET:.2f}): **{'met' if met else 'NOT met'}**")
    path = write_json("checkpoint_stall", {"rows": rows, "target": TARGET, "met": met, "worst_ratio": worst}, a.out,
                      made=made)
    print(f"written {path}\n{verdict}")
    first = ", ".join(f"{r['model']} {r['strategy']} {r['stalls_s'][0]:.2f} s" for r in rows
                      if r["mode"] == "async" and r["stalls_s"] and r["stalls_s"][0] is not None)
    page = write_page("checkpoint-stall", "Checkpoint stall: sync against async saves", f"""
What a checkpoint costs the training thread. A **sync** save stops training while the state is gathered
into whole tensors, written (safetensors, the index, the checksums of the manifest) and copied into the
run directory. An **async** save (`train.checkpoint_mode: async`, the default) stops it only while the
state is gathered and copied into host memory; a background thread writes and copies while training goes
on, and a save that finds the previous one still being written waits for it ("of it waiting").

Each case is the worker's own training loop on 2 ranks of a gloo process group on this machine, 18 steps of
a global batch of 2 rows, a checkpoint every 6 steps; each figure is the median over its 3 saves, taken
from the run's records (`checkpoint_stall_s`, `checkpoint_wait_s`, `checkpoint_write_s`). "step s" is the
median step time: under async the background write shares the machine's cores with training.

{markdown_table(head, table)}

Target, on the larger model: the async stall at most {TARGET:.0%} of the sync save's time. {verdict}.

What remains of the stall under async is a copy of each rank's own tensors into host memory: ddp's whole
model, zero-3's partitions and megatron's tensor-parallel slices, which the background thread gathers
into whole tensors over gloo groups of their own. The first async save also allocates the host memory
that later ones copy into (each case's first save: {first}).
See [failures](failures.md#checkpoints-off-the-training-thread).
""", a.page, verdict=verdict, made=made)
    print(f"written {page}")


if __name__ == "__main__":
    main()
