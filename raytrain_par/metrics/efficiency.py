"""Statistical efficiency: how soon a run reaches its target, read from its evaluation records.

Time-to-target is interpolated linearly between the last evaluation that missed the target and
the first that met it, on wall time, epochs and samples alike: evaluations are sparse, and reading
off the first evaluation that met it would reward whichever trial happened to evaluate then.
"""

from __future__ import annotations

import math
from statistics import mean


def _met(value: float, target: float, mode: str) -> bool:
    return value >= target if mode == "max" else value <= target


def crossing(records: list[dict], metric: str, target: float, mode: str, axis: str) -> float | None:
    """The `axis` value (e.g. wall_time_s) at which `metric` first reaches `target`, interpolated
    between evaluations; None if it never does. Records must be of one trial."""
    prev = None
    for r in sorted(records, key=lambda r: r["step"]):
        value = r.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if _met(value, target, mode):
            if prev is None:
                return float(r[axis])
            v0, x0 = prev[metric], float(prev[axis])
            if value == v0:
                return float(r[axis])
            return x0 + (target - v0) / (value - v0) * (float(r[axis]) - x0)
        prev = r
    return None


def summarize(records: list[dict], metric: str | None = None, target: float | None = None,
              mode: str = "min") -> dict:
    """One row of trials.parquet from one trial's records."""
    records = sorted(records, key=lambda r: r["step"])
    last = records[-1]
    trained = [r for r in records if r.get("step_time_s")]
    row = {k: last.get(k) for k in ("experiment", "trial", "strategy", "num_workers", "global_batch_size")}
    # An elastic run's worker count changes between records: the summary keeps the largest and the
    # smallest, and how often it changed.
    workers = [r["num_workers"] for r in records if r.get("num_workers")]
    if workers:
        row["num_workers"], row["min_workers"] = max(workers), min(workers)
    row.update({
        "resizes": sum(a != b for a, b in zip(workers, workers[1:])),
        "evaluations": len(records),
        "steps": last["step"],
        "epochs": last["epoch"],
        "wall_time_s": last["wall_time_s"],
        "startup_s": last.get("startup_s"),
        "mean_step_time_s": mean(r["step_time_s"] for r in trained) if trained else None,
        "throughput": (last["samples_seen"] / last["wall_time_s"]) if last["wall_time_s"] else None,
        "epoch_time_s": (last["wall_time_s"] / last["epoch"]) if last["epoch"] else None,
        "mem_peak_bytes": max((r.get("mem_peak_bytes") or 0) for r in records),
        "mem_model_state_bytes": max((r.get("mem_model_state_bytes") or 0) for r in records),
        "final_val_loss": last.get("val_loss"),
        # Over the whole run: every step's model FLOPs over all of its training time, on every worker.
        "mfu": (last["model_flops_per_step"] * last["step"] / _worker_seconds(records) / (last["peak_tflops"] * 1e12)
                if last.get("model_flops_per_step") and last.get("peak_tflops") and _worker_seconds(records) else None),
        "comm_fraction": _mean_of(records, "comm_fraction"),
    })
    if metric:
        values = [r[metric] for r in records if r.get(metric) is not None]
        best = (max if mode == "max" else min)(values) if values else None
        row.update({"metric": metric, "target": target, "best_metric": best, "final_metric": last.get(metric)})
        if target is not None:
            row["time_to_target_s"] = crossing(records, metric, target, mode, "wall_time_s")
            row["epochs_to_target"] = crossing(records, metric, target, mode, "epoch")
            row["samples_to_target"] = crossing(records, metric, target, mode, "samples_seen")
            row["target_reached"] = row["time_to_target_s"] is not None
    return row


def workers_text(row: dict) -> str:
    """A trial's workers for a table: `4`, or `2-4` for an elastic run that changed size."""
    lo, hi = row.get("min_workers"), row["num_workers"]
    return f"{lo}-{hi}" if lo is not None and lo != hi else str(hi)


def _worker_seconds(records: list[dict]) -> float:
    """Training time x workers, summed over the intervals between evaluations (sorted by step): an
    elastic run's interval counts the workers that trained it."""
    total, prev = 0.0, 0.0
    for r in records:
        total += (r["wall_time_s"] - prev) * (r.get("num_workers") or 1)
        prev = r["wall_time_s"]
    return total


def _mean_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return mean(values) if values else None


def rank(rows: list[dict], mode: str = "min") -> list[dict]:
    """Trials that reached the target first (soonest first), then the others by best metric."""
    def key(r):
        reached = r.get("time_to_target_s")
        best = r.get("best_metric")
        best_key = math.inf if best is None else (-best if mode == "max" else best)
        return (0, reached, best_key) if reached is not None else (1, best_key, 0)
    return sorted(rows, key=key)
