"""What a checkpoint costs the training thread: a sync save (training waits while every rank writes its own
pieces, sums them and copies them to the run directory) against an async one (training waits for a copy
of each rank's pieces in host memory only; a background thread writes), and how a sync save's time goes
with the number of workers that write it, in one run.

    python benchmarks/checkpoint_stall.py          # the quickstart model and a GPT-2 of ~106M parameters

Each case is the worker's own training loop (worker.Trainer, checkpoints through LocalReporter into a
run directory, as Ray Train's workers write theirs) on 2 ranks of a gloo process group, under ddp, zero-3
and megatron T=2, once with `train.checkpoint_mode: sync` and once with `async`: 18 steps, a checkpoint
every 6 (more training between two saves than a write takes, as in a real run). Every record carries the save's stall on the training thread (`checkpoint_stall_s`, with any
wait for the previous write, `checkpoint_wait_s`) and the write's time (`checkpoint_write_s`); the table
shows their medians over the run's 3 saves, and the first save's stall. Then sync saves of the larger model
on 1, 2 and 4 workers under ddp and zero-3. Targets (the larger model): every async stall, the first
included, at most 10% of the sync save's; a sync save on 4 workers no longer than on 1 (each rank writes
its share). Prints the tables and writes benchmarks/results/checkpoint_stall.json and
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
SCALING = {"strategies": ["ddp", "zero-3"], "workers": [1, 2, 4]}
COMMON = ["train.global_batch_size=4", "train.max_steps=18", "train.eval_every_steps=6",
          "train.eval_at_start=false", "train.checkpoint_every_evals=1", "train.warmup_steps=0",
          "train.lr_schedule=constant", "data.max_val_samples=8"]
TARGET = 0.10


def _median(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def measure(model: str, strategy: str, mode: str, work: Path, workers: int = 2) -> dict:
    spec = load_experiment(REPO / "experiments" / "quickstart.yaml",
                           [*COMMON, *MODELS[model], STRATEGIES[strategy], f"train.checkpoint_mode={mode}",
                            f"scaling.num_workers={workers}"])
    info = data.prepare(spec.data, log=lambda *_: None)
    params = sum(p.numel() for p in models.build(spec.model, info, 0)[0].parameters())
    root = work / f"{model}-{strategy}-{mode}-{workers}".replace(" ", "_").replace("=", "")
    try:
        records = run_ranks(workers, train_loop, spec.to_dict(), info.to_json(), str(root))[0]
        sizes = sum(f.stat().st_size for f in sorted(root.glob("checkpoint_*"))[-1].iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "parameters": params, "strategy": strategy, "mode": mode, "workers": workers,
            "checkpoint_bytes": sizes,
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
    larger = list(MODELS)[-1]
    if larger in a.models.split(","):
        for strategy in SCALING["strategies"]:
            for workers in SCALING["workers"]:
                if workers != 2:
                    rows.append(measure(larger, strategy, "sync", Path(work), workers))
                    print(f"{larger} {strategy} sync on {workers}: save {rows[-1]['stall_s']:.3f} s", flush=True)
    table, verdicts, firsts = [], {}, {}
    for model in a.models.split(","):
        for strategy in a.strategies.split(","):
            sync, background = ([r for r in rows if (r["model"], r["strategy"], r["mode"], r["workers"])
                                 == (model, strategy, m, 2)][0] for m in ("sync", "async"))
            ratio, first = background["stall_s"] / sync["stall_s"], background["stalls_s"][0] / sync["stall_s"]
            verdicts.setdefault(model, []).append(ratio)
            firsts.setdefault(model, []).append(first)
            table.append([model, f"{sync['parameters'] / 1e6:.1f}M", strategy, f"{sync['checkpoint_bytes'] / 2**20:.0f}",
                          f"{sync['stall_s']:.3f}", f"{background['stall_s']:.3f}", f"{background['wait_s']:.3f}",
                          f"{background['stalls_s'][0]:.3f}", f"{background['write_s']:.3f}", f"{ratio:.2f} / {first:.2f}",
                          f"{sync['step_time_s']:.3f} / {background['step_time_s']:.3f}"])
    head = ["model", "parameters", "strategy", "checkpoint MiB", "sync save s", "async stall s", "of it waiting s",
            "first async stall s", "async write s (background)", "async stall / sync save (median / first)",
            "step s sync / async"]
    print_table(head, table)
    scaling, growth = [], {}
    for strategy in SCALING["strategies"]:
        saves = {r["workers"]: r["stall_s"] for r in rows
                 if (r["model"], r["strategy"], r["mode"]) == (larger, strategy, "sync")}
        if len(saves) == len(SCALING["workers"]):
            growth[strategy] = saves[max(saves)] / saves[min(saves)]
            scaling.append([strategy, *(f"{saves[w]:.3f}" for w in SCALING["workers"]), f"{growth[strategy]:.2f}"])
    scaling_head = ["strategy", *(f"sync save s, {w} worker{'s' * (w > 1)}" for w in SCALING["workers"]),
                    f"{max(SCALING['workers'])} workers / 1"]
    if scaling:
        print_table(scaling_head, scaling)
    worst = max(verdicts.get(larger, [float("nan")]))
    worst_first = max(firsts.get(larger, [float("nan")]))
    worst_growth = max(growth.values(), default=float("nan"))
    met = worst <= TARGET and worst_first <= TARGET and worst_growth <= 1.0
    verdict = (f"async stall / sync save at most {worst:.2f} (median), {worst_first:.2f} (first save) over ddp, "
               f"zero-3, megatron T=2 on {larger} (target: at most {TARGET:.2f}); a sync save on "
               f"{max(SCALING['workers'])} workers takes at most {worst_growth:.2f} times its time on 1 (target: "
               f"at most 1): **{'met' if met else 'NOT met'}**")
    path = write_json("checkpoint_stall", {"rows": rows, "target": TARGET, "met": met, "worst_ratio": worst,
                                           "worst_first_ratio": worst_first, "save_growth": growth}, a.out, made=made)
    print(f"written {path}\n{verdict}")
    page = write_page("checkpoint-stall", "Checkpoint stall: sync against async saves", f"""
What a checkpoint costs the training thread. A **sync** save stops training while every rank writes its
own pieces (safetensors, its part of the index, the checksums of the manifest, taken as it writes) and
copies them into the run directory. An **async** save (`train.checkpoint_mode: async`, the default) stops
it only while each rank copies its own pieces into host memory; a background thread writes and copies
while training goes on, and a save that finds the previous one still being written waits for it ("of it
waiting"). A tensor that several ranks hold alike (ddp's every tensor, megatron's replicated ones) is
written by one of them, so each of ddp's 2 ranks writes about half.

Each case is the worker's own training loop on 2 ranks of a gloo process group on this machine, 18 steps of
a global batch of 4 rows, a checkpoint every 6 steps; each figure is the median over its 3 saves, taken
from the run's records (`checkpoint_stall_s`, `checkpoint_wait_s`, `checkpoint_write_s`), beside the first
async save's stall, which also allocates the host memory the later ones copy into. "step s" is the median
step time: under async the background write shares the machine's cores with training.

{markdown_table(head, table)}

Sync saves of {larger} on 1, 2 and 4 workers (the same 18 steps; the median of 3 saves):

{markdown_table(scaling_head, scaling) if scaling else "(not run: --models leaves it out)"}

Targets, on the larger model: every async stall, the first included, at most {TARGET:.0%} of the sync
save's time; a sync save on {max(SCALING['workers'])} workers no longer than on 1. {verdict}.
See [failures](failures.md#checkpoints-off-the-training-thread).
""", a.page, verdict=verdict, made=made)
    print(f"written {page}")


if __name__ == "__main__":
    main()
