"""An adaptive batch (train.adaptive_batch) against fixed batches 8..128: the training time and the rows
it takes each to reach the target, and the adaptive run's batch over time, in one run.

    python benchmarks/adaptive.py            # gpt2-tiny and gpt2-mini on the Bible, ddp on 2 ranks

Each run is the worker's own training loop (worker.Trainer) on 2 ranks of a gloo process group, ddp, on
`experiments/goodput-search.yaml`'s data and target (val_perplexity <= 80), stopped at the target. The
fixed batches train with the file's learning rate scaled by sqrt(M / 16) (as that sweep's grid does);
the adaptive runs start at batch 8 with that batch's rate and may grow to 128, AdaScale's gain (the
default) or sqrt scaling the rate. Every run evaluates about every 320 rows and warms up over about 160
rows. Time to the target is training seconds (`wall_time_s`: evaluations left out), interpolated between
evaluations, as `raytrain-par report` counts it.

Target: the adaptive run (adascale) reaches the target in at most 0.9x the best fixed batch's time on
one of the models and no slower than it on the other. Prints a table and writes
benchmarks/results/adaptive.json, docs/adaptive-results.md and its figure (`--out`, `--page` elsewhere).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # run from the repository's root, as every benchmark (benchmarks/common.py)

from raytrain_par import data  # noqa: E402
from raytrain_par.config import load_experiment  # noqa: E402
from raytrain_par.local_group import run_ranks  # noqa: E402
from raytrain_par.metrics.efficiency import crossing  # noqa: E402

from common import (DOCS, REPO, check_readme_target, markdown_table, print_table, provenance,  # noqa: E402
                    train_loop, write_json, write_page)

MODELS = {"gpt2-tiny": "model={name: gpt2-tiny, dropout: 0.0}", "gpt2-mini": "model={name: gpt2-mini, dropout: 0.0}"}
FIXED = [8, 16, 32, 64, 128]
START, LARGEST, BASE_LR_BATCH = 8, 128, 16
ROWS_PER_EVAL, WARMUP_ROWS, MAX_ROWS = 320, 160, 40_000
TARGET_RATIO = 0.9


def cases() -> dict[str, list[str]]:
    """Overrides of each run: fixed batches with the sqrt-scaled rate, the adaptive runs from batch 8."""
    lr = load_experiment(REPO / "experiments" / "goodput-search.yaml", []).train.lr
    out = {}
    for m in FIXED:
        out[f"fixed {m}"] = [f"train.global_batch_size={m}", f"train.lr={lr * math.sqrt(m / BASE_LR_BATCH):.6g}",
                             f"train.eval_every_steps={max(1, ROWS_PER_EVAL // m)}",
                             f"train.warmup_steps={max(1, WARMUP_ROWS // m)}", f"train.max_steps={MAX_ROWS // m}"]
    for rule in ("adascale", "sqrt"):
        out[f"adaptive ({rule})"] = [
            f"train.global_batch_size={START}", f"train.lr={lr * math.sqrt(START / BASE_LR_BATCH):.6g}",
            f"train.eval_every_steps={ROWS_PER_EVAL // START}", f"train.warmup_steps={WARMUP_ROWS // START}",
            f"train.max_steps={MAX_ROWS // START}",
            f"train.adaptive_batch={{max_global_batch_size: {LARGEST}, lr_scaling: {rule}}}"]
    return out


def measure(model: str, name: str, overrides: list[str], work: Path) -> dict:
    spec = load_experiment(REPO / "experiments" / "goodput-search.yaml",
                           [MODELS[model], "sweep=null", "train.stop_at_target=true", "train.checkpoint_every_evals=0",
                            "scaling.num_workers=2", *overrides])
    info = data.prepare(spec.data, log=lambda *_: None)
    root = work / f"{model}-{name}".replace(" ", "_").replace("(", "").replace(")", "")
    try:
        records = run_ranks(2, train_loop, spec.to_dict(), info.to_json(), str(root), True, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = spec.target
    return {"model": model, "run": name, "target": str(t),
            "time_to_target_s": crossing(records, t.metric, t.value, t.mode, "wall_time_s"),
            "samples_to_target": crossing(records, t.metric, t.value, t.mode, "samples_seen"),
            "steps": records[-1]["step"], "final": records[-1][t.metric],
            "curve": [{k: r.get(k) for k in ("step", "wall_time_s", "samples_seen", "global_batch_size", "lr",
                                             "grad_noise_scale", t.metric, "batch_decision", "step_time_s")}
                      for r in records]}


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        for r in (r for r in rows if r["model"] == model):
            curve = r["curve"]
            adaptive = r["run"].startswith("adaptive")
            style = {"linewidth": 2.2} if adaptive else {"linewidth": 1, "alpha": 0.8}
            axes[0][j].plot([c["wall_time_s"] for c in curve], [c["val_perplexity"] for c in curve], label=r["run"],
                            **style)
            axes[1][j].step([c["wall_time_s"] for c in curve], [c["global_batch_size"] for c in curve], where="pre",
                            label=r["run"], **style)
        axes[0][j].axhline(80, color="grey", linestyle=":")
        axes[0][j].set(title=model, yscale="log", ylabel="validation perplexity", xlabel="training seconds")
        axes[1][j].set(yscale="log", ylabel="global batch", xlabel="training seconds")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _f(x, fmt):
    return "not reached" if x is None else format(x, fmt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--out", help="JSON path (default benchmarks/results/adaptive.json)")
    p.add_argument("--page", help="the docs page (default docs/adaptive-results.md)")
    a = p.parse_args()
    check_readme_target("adaptive-results", a.page)
    made = provenance()
    rows = []
    with tempfile.TemporaryDirectory(prefix="adaptive-") as work:
        for model in a.models.split(","):
            for name, overrides in cases().items():
                rows.append(measure(model, name, overrides, Path(work)))
                r = rows[-1]
                reached = (f"{r['time_to_target_s']:.1f} s and {r['samples_to_target']:.0f} rows to the target"
                           if r["time_to_target_s"] is not None else f"target not reached in {r['steps']} steps")
                print(f"{model} {name}: {reached}", flush=True)
    table, ratios = [], {}
    for model in a.models.split(","):
        mine = [r for r in rows if r["model"] == model]
        fixed = [r for r in mine if r["run"].startswith("fixed") and r["time_to_target_s"] is not None]
        best = min(fixed, key=lambda r: r["time_to_target_s"], default=None)
        for r in mine:
            t = r["time_to_target_s"]
            vs = None if t is None or best is None else t / best["time_to_target_s"]
            if r["run"] == "adaptive (adascale)":
                ratios[model] = vs
            batches = [c["global_batch_size"] for c in r["curve"]]
            table.append([model, r["run"], _f(t, ".1f"), _f(r["samples_to_target"], ".0f"), r["steps"],
                          _f(vs, ".2f"), " -> ".join(str(b) for b in dict.fromkeys(batches))])
    head = ["model", "run", "time to target (s)", "rows to target", "steps", "/ best fixed", "batches, in order"]
    print_table(head, table)
    known = [v for v in ratios.values() if v is not None]
    met = len(known) == len(ratios) and min(known) <= TARGET_RATIO and max(known) <= 1.0
    text = ", ".join(f"{m} {_f(v, '.2f')}" for m, v in ratios.items())
    verdict = (f"adaptive / best fixed batch, time to target: {text} (target: at most {TARGET_RATIO} on one, "
               f"1.0 on the other): **{'met' if met else 'NOT met'}**")
    path = write_json("adaptive", {"rows": rows, "ratios": ratios, "target_ratio": TARGET_RATIO, "met": met}, a.out,
                      made=made)
    print(f"written {path}\n{verdict}")
    fig = DOCS / "results" / "adaptive" / "batch_over_time.png" if a.page is None else Path(a.page).with_suffix(".png")
    figure(rows, fig)
    detail = []
    for r in rows:
        if r["run"].startswith("adaptive"):
            steps = [f"{c['step']}: {c['global_batch_size']}"
                     + ("" if c["grad_noise_scale"] is None else f" (noise {c['grad_noise_scale']:.1f})")
                     for c in r["curve"]]
            detail.append(f"- {r['model']}, {r['run']}: " + "; ".join(steps))
    page = write_page("adaptive-results", "Adaptive batch against fixed batches", f"""
Every run trains `experiments/goodput-search.yaml`'s data to its target (val_perplexity <= 80): the worker's
own training loop on 2 ranks of a gloo process group on this machine, ddp, stopped at the target. The fixed
batches {', '.join(map(str, FIXED))} train with the file's learning rate scaled by sqrt(M / {BASE_LR_BATCH});
the adaptive runs start at batch {START} with that batch's rate and may grow to {LARGEST}
([adaptive-batch.md](adaptive-batch.md)), the rate scaled by AdaScale's gain (the default) or by sqrt(M / {START}).
Every run evaluates about every {ROWS_PER_EVAL} rows (an adaptive run: every {ROWS_PER_EVAL // START} steps of
progress) and decides its batch at each evaluation. Time to the target is training seconds, evaluations
left out, interpolated between evaluations.

{markdown_table(head, table)}

Target: the adaptive run (adascale) at most {TARGET_RATIO}x the best fixed batch's time on one model, and no
slower on the other. {verdict}.

![validation perplexity and global batch against training seconds]({fig.relative_to(DOCS) if a.page is None else fig.name})

The adaptive runs' batch at each evaluation, with the noise scale measured by then (rows):

{chr(10).join(detail)}
""", a.page, verdict=verdict, made=made)
    print(f"written {page}")


if __name__ == "__main__":
    main()
