"""Time to target at a worker count no probe ran: `raytrain-par plan --probe-workers 1` against runs that
train the two-worker points to the target.

    python benchmarks/plan_unprobed.py [--experiment experiments/goodput-search.yaml] [--set FIELD=VALUE ...]

One embedded Ray cluster, one job at a time. First the plan: its reference run (ddp on two workers, to
the target, measuring the gradient noise scale; the plan does not use its step times) and one probe run
timing ddp on one worker at each batch of the grid. Each point on two workers is then predicted by the
step-time model (`raytrain-par estimate`'s, metrics/steptime.py) on this machine's CPU, its loopback
link measured and its achievable fraction and per-step overhead fitted to the one-worker probes, times
the steps the reference's noise scale predicts at that batch and its learning rate. Then every
two-worker point trains to the target, and its measured time to the target (training seconds, as
`time_to_target_s` counts them) is compared with the prediction, split into steps and seconds per step.

Target: every two-worker point's predicted time to the target within 20% of the measured one. Prints a
table and writes benchmarks/results/plan_unprobed.json, docs/plan-unprobed.md and README.md's line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # run from the repository's root, as every benchmark (benchmarks/common.py)

from common import check_readme_target, markdown_table, print_table, provenance, write_json, write_page  # noqa: E402

from raytrain_par.config import load_experiment  # noqa: E402
from raytrain_par.driver import ray_cluster, run_experiment  # noqa: E402
from raytrain_par.goodput import make_plan  # noqa: E402
from raytrain_par.metrics.efficiency import crossing  # noqa: E402
from raytrain_par.sweep import plan as sweep_plan  # noqa: E402

TARGET = 0.20
PAGE = "plan-unprobed"
GRID = "sweep={grid: {scaling.num_workers: [1, 2], train.global_batch_size: [8, 16, 32]}, lr_scaling: sqrt}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="experiments/goodput-search.yaml")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="experiment override")
    p.add_argument("--out", help="JSON file (default benchmarks/results/plan_unprobed.json)")
    p.add_argument("--page", help="Markdown page (default docs/plan-unprobed.md, and README.md's line)")
    a = p.parse_args(argv)
    check_readme_target(PAGE, a.page)
    made = provenance()
    work = Path(tempfile.mkdtemp(prefix="plan-unprobed-"))
    spec = load_experiment(a.experiment, [GRID, *a.set, f"output_dir={work}"])
    metric, goal, mode = spec.target.metric, spec.target.value, spec.target.mode
    points = sweep_plan(spec)
    with ray_cluster(spec, None, log=print):
        result = make_plan(spec, probe_workers=[1], log=lambda line: print(f"[plan] {line}", flush=True))
        rows = []
        for r in result.rows:
            if r["num_workers"] != 2:
                continue
            s = points.trial_spec(json.loads(r["overrides"]))
            s = replace(s, name=f"measured-{r['trial']}", sweep=None, output_dir=str(work / "measured"),
                        train=replace(s.train, stop_at_target=True))
            run = run_experiment(s, log=lambda line: print(f"[{r['trial']}] {line}", flush=True))
            records = run.records
            seconds = crossing(records, metric, goal, mode, "wall_time_s")
            steps = crossing(records, metric, goal, mode, "step")
            step_s = statistics.median(x["step_time_s"] for x in records if x.get("step_time_s"))
            rows.append({"point": r["trial"], "global_batch_size": r["global_batch_size"],
                         "step_time_from": r["step_time_from"],
                         "predicted_steps": r["predicted_steps_to_target"], "measured_steps": steps,
                         "predicted_step_s": r["predicted_step_time_s"], "measured_step_s": step_s,
                         "predicted_s": r["predicted_time_to_target_s"], "measured_s": seconds,
                         "error": None if seconds is None else r["predicted_time_to_target_s"] / seconds - 1})
            print(f"{r['trial']}: predicted {r['predicted_time_to_target_s']:.1f} s, measured "
                  f"{'-' if seconds is None else f'{seconds:.1f} s'}", flush=True)
    probes = {r["trial"]: r["predicted_step_time_s"] for r in result.rows if r["num_workers"] == 1}

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = ["point", "steps predicted", "steps measured", "s/step predicted", "s/step measured",
            "to target predicted (s)", "to target measured (s)", "error"]
    table = [[r["point"], f(r["predicted_steps"], ".1f"), f(r["measured_steps"], ".1f"),
              f(r["predicted_step_s"], ".3f"), f(r["measured_step_s"], ".3f"), f(r["predicted_s"], ".1f"),
              f(r["measured_s"], ".1f"), f(r["error"], "+.0%")] for r in rows]
    print_table(head, table)
    within = sum(r["error"] is not None and abs(r["error"]) <= TARGET for r in rows)
    worst = max(rows, key=lambda r: abs(r["error"]) if r["error"] is not None else float("inf"))
    met = bool(rows) and within == len(rows)
    verdict = (f"probing one worker, {within} of {len(rows)} two-worker points within {TARGET:.0%} of the measured "
               f"time to target, the worst {worst['point']} {f(worst['error'], '+.0%')} (target: every point): "
               f"**{'met' if met else 'NOT met'}**")
    path = write_json("plan_unprobed", {"rows": rows, "probes_s": probes, "achievable": result.achievable,
                                        "step_overhead_s": result.step_overhead_s,
                                        "background_cores": result.background_cores,
                                        "reference": {"batch": result.reference.batch,
                                                      "steps": result.reference.steps,
                                                      "noise_scale": result.reference.noise_scale},
                                        "notes": result.notes, "met": met}, a.out, made=made)
    print(f"written {path}\n{verdict}")
    ref = result.reference
    page = write_page(PAGE, "Time to target on unprobed workers", f"""
`{spec.name}` ({spec.model.name} on {spec.data.name}, target {spec.target}, lr scaled by sqrt from
{spec.train.lr:g} at batch {spec.train.global_batch_size}), its sweep's grid set to 1 and 2 workers x global
batch 8, 16, 32 (ddp), on one embedded Ray cluster of this machine's CPU, one job at a time.

`raytrain-par plan --probe-workers 1` ([sweeps.md](sweeps.md#predict-worker-counts-no-probe-ran)): the
reference trained to the target at batch {ref.batch} ({ref.steps:.1f} steps; gradient noise scale
{ref.noise_scale:.1f}); one probe run timed ddp on one worker at each batch. Every two-worker point's step is
`raytrain-par estimate`'s model on this CPU (the loopback link measured, the achievable fraction and
the overhead per step fitted to the one-worker probes: {', '.join(
    f'{k} {v:.2f} and {result.step_overhead_s.get(k, 0) * 1e3:.1f} ms' for k, v in result.achievable.items())};
the machine's other processes, Ray's own among them, kept {result.background_cores:.2f} of its
{os.cpu_count()} cores busy during the probes, and two workers share what is left), and its steps
the reference's at the lr the sweep's rule gives the batch (`Reference.steps_to_target`: S_min (1 + B_noise / M),
or more where the lr limits progress). The one-worker probes, seconds per step: {', '.join(f'{k} {v:.3f}' for k, v in probes.items())}. Then each two-worker point
trained to the target; "measured" is its training time to the target (`time_to_target_s`), its steps to
the crossing and its median seconds per step.

{markdown_table(head, table)}

Target: every two-worker point within {TARGET:.0%}. {verdict}.
""", a.page, verdict=verdict, made=made)
    print(f"written {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
