"""`raytrain-par report RESULTS_DIR`: the study's figures and a ranked summary from a run's or a
sweep's records.

Writes into RESULTS_DIR (or --out):
    convergence_wall_time.png   validation metric against wall time, one line per trial
    convergence_epochs.png      the same against epochs
    epoch_time.png              time per epoch against worker count, one line per strategy (and batch)
    mfu.png                     model FLOPs utilisation against worker count, beside it
    memory.png                  peak and model-state memory per worker against worker count
    predicted_vs_measured.png   (search: goodput) predicted against measured time to target per trial
    adaptive_batch.png          (train.adaptive_batch) the global batch and the predicted goodput
                                against wall time, one line per adaptive trial
    summary.md                  the ranking (time to target first) and the figures
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from .errors import UserError  # noqa: E402
from .metrics.efficiency import rank, summarize, workers_text  # noqa: E402
from .metrics.records import read_records  # noqa: E402
from .provenance import GENERATED_MARK, cli_command, machine_text, runs_of  # noqa: E402
from .tables import markdown_table  # noqa: E402

LABELS = {"val_loss": "validation loss", "val_perplexity": "validation perplexity",
          "val_accuracy": "validation accuracy", "grad_noise_scale": "gradient noise scale B_simple (rows)"}


def load(results_dir: Path) -> tuple[list[dict], list[dict]]:
    metrics = results_dir / "metrics.parquet"
    if not metrics.exists():
        raise UserError(f"{results_dir}: no metrics.parquet here.\n  fix: give the directory of a run or sweep, "
                        "e.g. results/quickstart (written by `raytrain-par run` or `sweep`)")
    try:
        records = read_records(metrics)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{metrics}: not a records file raytrain-par can read ({type(e).__name__}: {e}).\n  fix: "
                        "give the directory of a run or sweep whose metrics.parquet is whole (a run being written "
                        "replaces it whole; a copied one may be cut short)") from None
    if not records:
        raise UserError(f"{metrics} holds no records yet; fix: let the run reach its first evaluation")
    trials_file = results_dir / "trials.parquet"
    trials = read_records(trials_file) if trials_file.exists() else []
    return records, trials


def _metric(records: list[dict], trials: list[dict]) -> tuple[str, float | None, str]:
    for t in trials:
        if t.get("metric"):
            m = t["metric"]
            return m, t.get("target"), "max" if m == "val_accuracy" else "min"
    m = "val_perplexity" if records[0].get("val_perplexity") is not None else "val_accuracy"
    return m, None, "max" if m == "val_accuracy" else "min"


def _by_trial(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        out[r["trial"]].append(r)
    return {k: sorted(v, key=lambda r: r["step"]) for k, v in out.items()}


def _convergence(groups, metric, target, x, xlabel, title, path):
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, rs in groups.items():
        pts = [(r[x], r[metric]) for r in rs if r.get(metric) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    if metric in ("val_perplexity", "grad_noise_scale"):
        ax.set_yscale("log")
    _finish(fig, ax, xlabel, LABELS.get(metric, metric), title, path)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    # titles name the experiment: a long one would be cut at the figure's edge
    ax.set_title(title, **({"fontsize": 10} if len(title) > 50 else {}))
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scaling(rows, series, ylabel, title, path):
    """Values against num_workers, one line per (strategy, batch) and per entry of `series`
    ((value of a trial row, legend suffix, line style)); log2 worker axis."""
    batches = {r["global_batch_size"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("min_workers") not in (None, r["num_workers"]):
            continue  # an elastic trial that changed size is no one point of a curve over worker counts
        groups[r["strategy"] + (f", batch {r['global_batch_size']}" if len(batches) > 1 else "")].append(r)
    for label, group in sorted(groups.items()):
        color = next(colors)
        for value, suffix, style in series:
            points: dict[int, list[float]] = defaultdict(list)
            for r in group:
                if value(r) is not None:
                    points[r["num_workers"]].append(value(r))
            xs = sorted(points)
            if xs:
                ax.plot(xs, [sum(points[x]) / len(points[x]) for x in xs], linestyle=style, marker="o",
                        color=color, label=label + suffix)
    ax.set_xscale("log", base=2)
    _finish(fig, ax, "workers (GPUs)", ylabel, title, path)


def _mib(n):
    return n / 2**20 if n else None


def _pct(x):
    return None if x is None else 100 * x


def _value(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _markdown_table(rows: list[dict], metric: str) -> str:
    head = ["#", "trial", "strategy", "workers", "batch", "lr", "time to target (s)", "epochs to target",
            f"best {metric}", "s/step", "samples/s", "MFU %", "exposed comm %", "peak MiB/worker",
            "model-state MiB/worker", "status"]
    return markdown_table(head, [[
        i + 1, r["trial"], r["strategy"], workers_text(r), r["global_batch_size"],
        _value(r.get("lr"), ".3g"), _value(r.get("time_to_target_s"), ".1f"), _value(r.get("epochs_to_target"), ".2f"),
        _value(r.get("best_metric"), ".4g"), _value(r.get("mean_step_time_s"), ".3f"), _value(r.get("throughput"), ".1f"),
        _value(_pct(r.get("mfu")), ".1f"), _value(_pct(r.get("comm_fraction")), ".1f"),
        _value(_mib(r.get("mem_peak_bytes")), ".0f"), _value(_mib(r.get("mem_model_state_bytes")), ".1f"),
        r.get("status") or "completed"] for i, r in enumerate(rows)])


def _adaptive(groups: dict[str, list[dict]], title: str, path: Path) -> None:
    """The global batch each interval trained with, and the goodput predicted for it, against wall time."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, rs in groups.items():
        trained = [r for r in rs if r.get("step")]
        top.step([r["wall_time_s"] for r in trained], [r["global_batch_size"] for r in trained], where="pre",
                 marker="o", markersize=3, label=name)
        pts = [(r["wall_time_s"], r["predicted_goodput"]) for r in trained if r.get("predicted_goodput") is not None]
        if pts:
            bottom.plot(*zip(*pts), marker="o", markersize=3, label=name)
    top.set_yscale("log", base=2)
    top.set_ylabel("global batch (rows)")
    top.set_title(title, **({"fontsize": 10} if len(title) > 50 else {}))
    top.grid(True, alpha=0.3, which="both")
    top.legend(fontsize=8)
    _finish(fig, bottom, "wall time of training (s)", "predicted goodput\n(rows of the starting batch / s)", "", path)


def _predicted_vs_measured(rows: list[dict], title: str, path: Path) -> None:
    """Measured against predicted time to target, one point per trained trial, with the line where
    they are equal; points not trained are marked on the predicted axis."""
    fig, ax = plt.subplots(figsize=(6, 5))
    trained = [r for r in rows if r.get("time_to_target_s") is not None]
    for r in trained:
        ax.scatter(r["predicted_time_to_target_s"], r["time_to_target_s"], color="tab:blue")
        ax.annotate(r["trial"], (r["predicted_time_to_target_s"], r["time_to_target_s"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    skipped = [r["predicted_time_to_target_s"] for r in rows if r.get("time_to_target_s") is None]
    values = [r["predicted_time_to_target_s"] for r in rows] + [r["time_to_target_s"] for r in trained]
    lo, hi = min(values), max(values)
    ax.plot([lo, hi], [lo, hi], color="black", linestyle="--", linewidth=1, label="measured = predicted")
    if skipped:
        ax.scatter(skipped, [lo] * len(skipped), marker="x", color="tab:gray",
                   label="not trained or not reached (predicted only)")
    _finish(fig, ax, "predicted time to target (s)", "measured time to target (s)", title, path)


def _prediction_table(rows: list[dict]) -> str:
    head = ["predicted rank", "trial", "predicted steps", "predicted s/step", "predicted time to target (s)",
            "measured time to target (s)", "status"]
    table = markdown_table(head, [[
        _value(r.get("predicted_rank"), "d"), r["trial"], _value(r.get("predicted_steps_to_target"), ".1f"),
        _value(r.get("predicted_step_time_s"), ".3f"), _value(r["predicted_time_to_target_s"], ".1f"),
        _value(r.get("time_to_target_s"), ".1f"), r.get("status") or "completed"]
        for r in sorted(rows, key=lambda r: r.get("predicted_rank") or 0)])
    return "Predicted (`search: goodput`) against measured, in the predicted order:\n\n" + table + "\n\n"


def provenance_text(results_dir: Path) -> str:
    """Which runs wrote the records (command, start, commit, machine, from the results directory's
    provenance.json) and which command wrote this report: what a reader needs to regenerate it."""
    runs = runs_of(results_dir)
    made = [f"`{r['command']}` (started {r['date']}, commit `{r['commit']}`, on {machine_text(r['machine'])})"
            for r in runs]
    if not made:
        source = ("The records do not name the run that wrote them (written before raytrain-par noted its runs in "
                  "provenance.json).")
    elif len(made) == 1:
        source = f"Records written by {made[0]}."
    else:
        source = "Records written by " + "; then ".join(made) + "."
    return f"{source} Report written by `{cli_command()}`. {GENERATED_MARK}\n\n"


class Report(list):
    """What `write_report` wrote: the files (the list itself, in the order written), and the ranking
    of the trials they show, on which metric, towards which target."""

    def __init__(self, files: list[Path], metric: str, target: float | None, mode: str, trials: list[dict]):
        super().__init__(files)
        self.metric, self.target, self.mode, self.trials = metric, target, mode, trials

    @property
    def files(self) -> list[Path]:
        return list(self)


def write_report(results_dir: str | Path, out: str | Path | None = None) -> Report:
    results_dir = Path(results_dir)
    out = Path(out) if out else results_dir
    out.mkdir(parents=True, exist_ok=True)
    records, trials = load(results_dir)
    metric, target, mode = _metric(records, trials)
    groups = _by_trial(records)
    if not trials:  # a single run without a summary: make one
        trials = [summarize(rs, metric, target, mode) for rs in groups.values()]
    rows = rank(trials, mode)
    name = records[0]["experiment"]
    files = [out / "convergence_wall_time.png", out / "convergence_epochs.png", out / "epoch_time.png",
             out / "mfu.png", out / "memory.png"]
    _convergence(groups, metric, target, "wall_time_s", "wall time of training (s)",
                 f"{name}: {LABELS.get(metric, metric)} against wall time", files[0])
    _convergence(groups, metric, target, "epoch", "epochs", f"{name}: {LABELS.get(metric, metric)} against epochs",
                 files[1])
    _scaling(rows, [(lambda r: r.get("epoch_time_s"), "", "-")], "time per epoch (s)", f"{name}: time per epoch",
             files[2])
    peaks = sorted({r["peak_source"] for r in records if r.get("peak_source")})
    _scaling(rows, [(lambda r: None if r.get("mfu") is None else 100 * r["mfu"], "", "-")],
             "model FLOPs utilisation (%)", f"{name}: MFU per worker" + (f"\n(peak: {peaks[0]})" if len(peaks) == 1 else ""),
             files[3])
    _scaling(rows, [(lambda r: _mib(r.get("mem_peak_bytes")), " peak", "-"),
                    (lambda r: _mib(r.get("mem_model_state_bytes")), " model states", "--")],
             "memory per worker (MiB)", f"{name}: memory per worker", files[4])
    if any(r.get("grad_noise_scale") is not None for r in records):
        files.append(out / "noise_scale.png")
        _convergence(groups, "grad_noise_scale", None, "step", "optimizer steps",
                     f"{name}: gradient noise scale (rows) during training", files[-1])
    adaptive = {k: rs for k, rs in groups.items() if any(r.get("batch_decision") for r in rs)}
    if adaptive:
        files.append(out / "adaptive_batch.png")
        _adaptive(adaptive, f"{name}: adaptive batch against wall time", files[-1])
    predicted = [r for r in rows if r.get("predicted_time_to_target_s") is not None]
    if predicted:
        files.append(out / "predicted_vs_measured.png")
        _predicted_vs_measured(predicted, f"{name}: time to target, predicted and measured", files[-1])
    summary = out / "summary.md"
    target_text = f", target {metric} {'>=' if mode == 'max' else '<='} {target:g}" if target is not None else ""
    summary.write_text(
        f"# {name}\n\n{provenance_text(results_dir)}"
        f"{len(rows)} trial(s), ranked by time to target{target_text}, then by best {metric}.\n\n"
        f"{_markdown_table(rows, metric)}\n\n" + (_prediction_table(predicted) if predicted else "") +
        "Wall time counts training steps only (not evaluation, checkpoints, reporting or start-up). MFU: model "
        "FLOPs per step over the training time, per worker, against the peak each record names; exposed comm: "
        "the share of a profiled step spent waiting for communication.\n\n"
        + "".join(f"![{f.stem}]({f.name})\n\n" for f in files))
    return Report([*files, summary], metric, target, mode, rows)
