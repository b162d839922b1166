"""Could `plan`'s reference run stop short of the target? What a reference stopped at a fraction of the
way would have measured, against the one that trains to the target.

    python benchmarks/reference_fraction.py [--experiment experiments/goodput-search.yaml] [--set FIELD=VALUE ...]
    python benchmarks/reference_fraction.py --records RESULTS/plan/reference/metrics.parquet --experiment X.yaml

Trains the reference that `raytrain-par plan` trains for the experiment (its own configuration, or ddp
where its strategy does not measure the noise scale) once to the target, evaluating every 5 steps
unless `--set train.eval_every_steps=N` says otherwise (`--records` reads an earlier run's records
instead). Then, for each fraction f of the way from the first evaluation to the target (on the loss
scale: the log of a perplexity), it takes the records up to where f was reached and computes what
plan would have computed from a reference stopped there:

- the steps and the share of the reference's training time it takes to get there;
- the gradient noise scale B_noise as plan weighs it (McCandlish et al.'s S_min (1 + B/M) summed over
  the evaluation intervals), and the last one measured;
- the predicted steps to the target at the sweep's smallest and largest global batch, relative to the
  reference's batch: (1 + B/M) / (1 + B/M0). These ratios are what ranks the batch sizes (the steps
  scale S_min is common to every point), so a fraction is good enough where they match f = 1's.

Prints the table, writes benchmarks/results/reference_fraction.json and docs/goodput-reference.md.
"""

from __future__ import annotations

import argparse
import math
import tempfile

from common import markdown_table, print_table, provenance, write_json, write_page

from raytrain_par.config import load_experiment
from raytrain_par.driver import ray_cluster, run_experiment
from raytrain_par.goodput import reference_spec
from raytrain_par.metrics.efficiency import crossing
from raytrain_par.metrics.goodput import fit_reference
from raytrain_par.metrics.records import read_records
from raytrain_par.sweep import check_goodput, plan

FRACTIONS = (0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
PAGE = "goodput-reference"


def _loss_scale(metric: str):
    """The metric on a scale where the way to the target is measured (a perplexity's log is the loss),
    and back."""
    if metric == "val_perplexity":
        return math.log, math.exp
    return (lambda v: v), (lambda v: v)


def at_fractions(records: list[dict], metric: str, target: float, mode: str, batches: list[int]) -> list[dict]:
    """One row per fraction f: what a reference that stopped f of the way to the target measured."""
    records = sorted(records, key=lambda r: r["step"])
    to_scale, from_scale = _loss_scale(metric)
    start, end = to_scale(records[0][metric]), to_scale(target)
    full_s = crossing(records, metric, target, mode, "wall_time_s")
    if full_s is None:
        raise SystemExit(f"the reference never reached {metric} {target:g} in {records[-1]['step']} steps: "
                         "raise train.max_steps or ease the target")
    rows = []
    for f in FRACTIONS:
        goal = from_scale(start + f * (end - start)) if f < 1 else target
        ref = fit_reference(records, metric, goal, mode)
        wall = crossing(records, metric, goal, mode, "wall_time_s")
        last = [r.get("grad_noise_scale") for r in records if r["step"] <= math.ceil(ref.steps)]
        last = next((b for b in reversed(last) if b is not None), None)
        rows.append({"fraction": f, "metric_value": goal, "steps": ref.steps, "time_share": wall / full_s,
                     "noise_scale": ref.noise_scale, "last_noise_scale": last,
                     "steps_ratio": {m: (1 + ref.noise_scale / m) / (1 + ref.noise_scale / ref.batch) for m in batches},
                     "reference_batch": ref.batch})
    return rows


AGREE = 0.10  # steps ratios this close to the whole run's rank the batch sizes alike


def _agrees(row: dict, full: dict) -> bool:
    return all(abs(row["steps_ratio"][m] / full["steps_ratio"][m] - 1) <= AGREE for m in full["steps_ratio"])


def _conclusion(rows: list[dict]) -> str:
    """Whether, and from which fraction on, a reference stopped short would have ranked the batch sizes
    as the whole one does: every later fraction must agree too, or the agreement is a coincidence of
    the noise measured so far."""
    full, short = rows[-1], rows[:-1]
    safe = next((r for k, r in enumerate(short) if all(_agrees(q, full) for q in short[k:])), None)
    if safe is not None:
        return (f"From {safe['fraction']:.0%} of the way on, a reference stopped short predicts the steps ratios of "
                f"the whole run within {AGREE:.0%}, so ranks the batch sizes alike, and could save "
                f"{1 - safe['time_share']:.0%} of its time.")
    agree = [f"{r['fraction']:.0%}" for r in short if _agrees(r, full)]
    coincidence = (f" The {', '.join(agree)} rows agree within {AGREE:.0%} but later ones do not: what the first "
                   "steps measured happens to be close, and has not settled." if agree else "")
    return (f"No fraction short of the target predicts the whole run's steps ratios within {AGREE:.0%} from there on."
            + coincidence + " The noise scale grows as the loss falls (as McCandlish et al. 2018 observe), here most "
            "near the target, so a reference that stops short measures the noise of an easier problem than the one "
            "the sweep's trials solve, and favours small batches. This is why `plan` trains its reference to the "
            "target ([sweeps](sweeps.md#goodput-predict-every-points-time-to-the-target-before-training-it)).")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="experiments/goodput-search.yaml")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="experiment override")
    p.add_argument("--records", help="an earlier reference run's metrics.parquet: analyse it without training")
    p.add_argument("--out", help="JSON file (default benchmarks/results/reference_fraction.json)")
    p.add_argument("--page", help="Markdown page (default docs/goodput-reference.md)")
    a = p.parse_args()
    # the reference's records go to a directory of their own: a plan's under the experiment's output_dir stay
    work = tempfile.mkdtemp(prefix="raytrain-par-reference-")
    spec = load_experiment(a.experiment, ["train.eval_every_steps=5", *a.set, f"output_dir={work}"])
    sweep = plan(spec)
    check_goodput(sweep, "benchmarks/reference_fraction.py")  # a target, and two batch sizes to rank
    ref, note = reference_spec(spec)
    if note:
        print(f"note: {note}")
    made = provenance()
    if a.records:
        records = read_records(a.records)
    else:
        with ray_cluster(ref):
            records = run_experiment(ref).records
    batches = sweep.global_batches()
    small, large = batches[0], batches[-1]
    rows = at_fractions(records, sweep.metric, sweep.target, sweep.mode, [small, large])
    m0 = rows[-1]["reference_batch"]
    head = ["fraction of the way", f"stopped at {sweep.metric}", "steps", "share of the reference's time",
            "B_noise as plan weighs it", "last B_noise measured", f"steps at batch {small} / {m0}",
            f"steps at batch {large} / {m0}"]
    table = [[f"{r['fraction']:.0%}", f"{r['metric_value']:.4g}", f"{r['steps']:.1f}", f"{r['time_share']:.2f}",
              f"{r['noise_scale']:.2f}", f"{r['last_noise_scale']:.2f}" if r["last_noise_scale"] is not None else "-",
              f"{r['steps_ratio'][small]:.2f}", f"{r['steps_ratio'][large]:.2f}"] for r in rows]
    print_table(head, table)
    payload = {"experiment": spec.name, "metric": sweep.metric, "target": sweep.target,
               "reference": {"strategy": ref.strategy.name, "num_workers": ref.scaling.num_workers,
                             "global_batch_size": ref.train.global_batch_size,
                             "eval_every_steps": ref.train.eval_every_steps},
               "records_from": a.records, "fractions": rows}
    print(f"written {write_json('reference_fraction', payload, a.out, made)}")
    conclusion = _conclusion(rows)
    print(conclusion)
    body = (
        f"`{spec.name}` ({spec.model.name} on {spec.data.name}, target {spec.target}): the reference `raytrain-par "
        f"plan` trains ({ref.strategy.name} on {ref.scaling.num_workers} worker(s), global batch "
        f"{ref.train.global_batch_size}, evaluated every {ref.train.eval_every_steps} steps), and what it would have "
        "measured had it stopped a fraction of the way from its first evaluation to the target (on the loss scale). "
        "The steps ratios rank the batch sizes: every point's predicted steps to the target are S_min (1 + B/M), and "
        "S_min is common to all of them.\n\n"
        + markdown_table(head, table) + "\n\n"
        + conclusion + "\n")
    print(f"written {write_page(PAGE, 'Goodput: a reference stopped short of the target', body, a.page, made=made)}")


if __name__ == "__main__":
    main()
