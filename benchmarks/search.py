"""Goodput search against the whole grid: does `search: goodput` pick the grid's fastest point to the
target, and in what share of the grid's time?

    python benchmarks/search.py [--experiment experiments/goodput-search.yaml] [--set FIELD=VALUE ...]

Runs the experiment's sweep twice on one embedded Ray cluster, one trial at a time: first over the
whole grid (search: grid, every point trained until its target), then with search: goodput (the plan's
reference run and probes, then the points it predicts may win). Each total is the wall time of the
sweep, trial start-ups and the plan included. Prints, and writes to benchmarks/results/search.json,
docs/goodput-search.md (with results/search/predicted_vs_measured.png beside it) and README.md's line
for it (`--render JSON` writes them again from a run's JSON):

- the grid's best time to target and the search's pick, with the pick's time in the grid's run (same
  conditions as the best) and in the search's own run;
- the predicted time to target of every point beside the grid's measured one;
- the total time of each.

Targets: the pick's time within 10% of the grid's best; the search's total at most 1/3 of the grid's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import check_readme_target, markdown_table, print_table, provenance, write_json, write_page

from raytrain_par.config import load_experiment
from raytrain_par.driver import ray_cluster
from raytrain_par.report import _predicted_vs_measured
from raytrain_par.sweep import describe, plan
from raytrain_par.tuning import run_sweep

PICK_WITHIN, TIME_SHARE = 0.10, 1 / 3
PAGE = "goodput-search"


def _point(row: dict) -> str:
    """A trial's point, without Tune's trial id ('w2-b64')."""
    return describe(json.loads(row["overrides"]))


def sweep(spec, search: str, work: Path, overrides: list[str], experiment: str) -> tuple[float, list[dict]]:
    s = load_experiment(experiment, [*overrides, f"sweep.search={search}", f"output_dir={work / search}",
                                     "sweep.max_concurrent_trials=1"])
    t0 = time.perf_counter()
    result = run_sweep(s, log=lambda line: print(f"[{search}] {line}", flush=True))
    return time.perf_counter() - t0, result.trials


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="experiments/goodput-search.yaml")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="experiment override")
    p.add_argument("--out", help="JSON file (default benchmarks/results/search.json)")
    p.add_argument("--page", help="Markdown page (default docs/goodput-search.md, and README.md's line)")
    p.add_argument("--render", metavar="JSON", help="write the page, figure and README line again from the JSON "
                                                     "an earlier run wrote, without training")
    a = p.parse_args()
    check_readme_target(PAGE, a.page)
    spec = load_experiment(a.experiment, a.set)
    grid_plan = plan(spec)  # the sweep block, checked before anything starts
    if a.render:  # a run's JSON from before it held its setup: the experiment's (--experiment, --set)
        render({"setup": setup_of(spec, grid_plan), **json.loads(Path(a.render).read_text())}, a.page)
        return
    made = provenance()  # before this run rewrites its tracked files
    work = Path(tempfile.mkdtemp(prefix="raytrain-par-search-"))
    biggest = max((grid_plan.trial_spec(pt) for pt in grid_plan.points), key=lambda s: s.scaling.num_workers)
    with ray_cluster(biggest):
        grid_s, grid = sweep(spec, "grid", work, a.set, a.experiment)
        search_s, searched = sweep(spec, "goodput", work, a.set, a.experiment)

    measured = {_point(r): r.get("time_to_target_s") for r in grid}
    reached = {k: v for k, v in measured.items() if v is not None}
    if not reached:
        raise SystemExit(f"no grid point reached the target: raise train.max_steps or ease the target ({a.experiment})")
    best_point = min(reached, key=reached.get)
    trained = [r for r in searched if r.get("time_to_target_s") is not None]
    pick = min(trained, key=lambda r: r["time_to_target_s"]) if trained else None
    pick_point = _point(pick) if pick else None
    pick_grid_s = measured.get(pick_point) if pick else None
    pick_ok = pick_grid_s is not None and pick_grid_s <= (1 + PICK_WITHIN) * reached[best_point]
    share = search_s / grid_s
    payload = {"experiment": spec.name, "grid_total_s": grid_s, "search_total_s": search_s, "share": share,
               "grid_best": {"point": best_point, "time_to_target_s": reached[best_point]},
               "pick": {"point": pick_point, "grid_time_to_target_s": pick_grid_s,
                        "search_time_to_target_s": pick and pick["time_to_target_s"]},
               "pick_ok": pick_ok, "time_ok": share <= TIME_SHARE,
               "setup": setup_of(spec, grid_plan),
               "grid": grid, "search": searched}
    payload = json.loads(json.dumps(payload, default=str))
    print(f"written {write_json('search', payload, a.out, made)}")
    render({**made, **payload}, a.page)


def setup_of(spec, grid_plan) -> dict:
    """What the page says of the experiment: model, data, target and the grid's learning rates."""
    t = spec.train
    return {"model": spec.model.name, "data": spec.data.name, "target": str(spec.target), "max_steps": t.max_steps,
            "lr": t.lr, "global_batch_size": t.global_batch_size, "lr_scaling": grid_plan.sweep.lr_scaling,
            "points": len(grid_plan.points)}


def render(payload: dict, page_out: str | None) -> None:
    """Prints the tables and verdicts of a run's JSON, and writes the page, its figure and README.md's line."""
    grid, searched, setup = payload["grid"], payload["search"], payload["setup"]
    measured = {_point(r): r.get("time_to_target_s") for r in grid}
    reached = {k: v for k, v in measured.items() if v is not None}
    best_point, best_s = payload["grid_best"]["point"], payload["grid_best"]["time_to_target_s"]
    pick = payload["pick"]
    n_trained = sum(1 for r in searched if not str(r.get("status", "")).startswith("not trained"))

    predicted = {_point(r): r for r in searched}
    head = ["point", "predicted rank", "predicted s", "grid measured s", "grid rank", "search"]
    grid_rank = {k: i + 1 for i, k in enumerate(sorted(reached, key=reached.get))}
    rows = []
    for point, r in sorted(predicted.items(), key=lambda kv: kv[1].get("predicted_rank") or 10**6):
        rows.append([point, r.get("predicted_rank"), _f(r.get("predicted_time_to_target_s")), _f(measured.get(point)),
                     grid_rank.get(point, "not reached"),
                     f"{r['status']} ({_f(r.get('time_to_target_s'))} s)" if r.get("time_to_target_s") else r["status"]])
    print()
    print_table(head, rows)
    summary_head = ["", "time to target (s)", "total time (s)", "trials trained"]
    summary = [["grid: best", f"{best_point}: {best_s:.1f}", f"{payload['grid_total_s']:.0f}", len(grid)],
               ["goodput search: pick", f"{pick['point']}: {_f(pick['grid_time_to_target_s'])} in the grid's run, "
                f"{_f(pick['search_time_to_target_s'])} in its own", f"{payload['search_total_s']:.0f}", n_trained]]
    print()
    print_table(summary_head, summary)
    share = payload["share"]
    verdicts = [f"pick within {PICK_WITHIN:.0%} of the grid's best: {'met' if payload['pick_ok'] else 'NOT met'}",
                f"search's total time {share:.2f} of the grid's (target <= {TIME_SHARE:.2f}): "
                f"{'met' if payload['time_ok'] else 'NOT met'}"]
    for v in verdicts:
        print(v)
    slower = (f"{pick['grid_time_to_target_s'] / best_s - 1:.0%} slower to the target than the grid's best"
              if pick["grid_time_to_target_s"] is not None else "no pick reached the target")
    readme = (f"the search's pick {slower} (target: within {PICK_WITHIN:.0%}): "
              f"**{'met' if payload['pick_ok'] else 'NOT met'}**; its total time {share:.2f} of the grid's "
              f"(target: at most {TIME_SHARE:.2f}): **{'met' if payload['time_ok'] else 'NOT met'}**")
    page = write_page(PAGE, "Goodput search against the whole grid", f"""
`{payload['experiment']}` ({setup['model']} on {setup['data']}, target {setup['target']}, up to {setup['max_steps']} steps, lr scaled by {setup['lr_scaling']} from
{setup['lr']:g} at batch {setup['global_batch_size']}): the sweep's {setup['points']} grid points, trained one
at a time until the target (`search: grid`), then `search: goodput` on the same cluster. Totals count
the whole sweep: trial start-ups, and for the search its plan (reference run and probes).

{markdown_table(summary_head, summary)}

**{verdicts[0]}. {verdicts[1][0].upper() + verdicts[1][1:]}.**

Every point, in the order the plan predicted (predicted and measured are training seconds, as
`time_to_target_s` counts them):

{markdown_table(head, rows)}

![predicted against measured](results/search/predicted_vs_measured.png)
""", page_out, verdict=readme, made={k: payload[k] for k in ("date", "commit", "machine", "command")})
    print(f"written {page}")
    figure = Path(page).parent / "results" / "search" / "predicted_vs_measured.png"  # beside the page
    figure.parent.mkdir(parents=True, exist_ok=True)
    points = [{"trial": k, "predicted_time_to_target_s": r.get("predicted_time_to_target_s"),
               "time_to_target_s": measured.get(k)} for k, r in predicted.items()
              if r.get("predicted_time_to_target_s") is not None]
    _predicted_vs_measured(points, f"{payload['experiment']}: predicted (goodput plan) against the grid's measured",
                           figure)
    print(f"written {figure}")


def _f(v):
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()
