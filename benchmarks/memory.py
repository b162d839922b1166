"""Model-state memory per worker of every data-parallel strategy, measured, beside the theory.

For each precision, worker count and strategy (by default the grid in the sweep of
experiments/zero-memory.yaml: a ~26M-parameter GPT-2, ddp / zero-1 / zero-2 / zero-3 / fsdp,
1, 2 and 4 workers, fp32 and bf16), a fresh gloo process group trains a few steps and reports
what each worker holds:

- measured: model-state bytes the allocator holds (see raytrain_par/metrics/memory.py: glibc's
  mallinfo2 on CPU, torch.cuda statistics on GPU), the largest
  worker, per parameter;
- theory: bytes per parameter with Adam(W) on N workers -- fp32: DDP 16, ZeRO-1 8 + 8/N,
  ZeRO-2 4 + 12/N, ZeRO-3 and FSDP 16/N; mixed precision: DDP 16, ZeRO-1 4 + 12/N,
  ZeRO-2 2 + 14/N, ZeRO-3 and FSDP 16/N;
- by design: what the implementation is documented to hold beyond the theory (DeepSpeed keeps an
  fp32 master copy of its partition also when training in fp32, +4/N; its gradient buckets);
- the reduction against DDP on as many workers, and the step time against DDP's.

    python benchmarks/memory.py                          # the whole grid
    python benchmarks/memory.py --workers 4 --precisions bf16 --strategies ddp,zero-3,fsdp
    python benchmarks/memory.py --set data.seq_len=32 --set train.global_batch_size=4   # less compute

Model states do not depend on the batch, so `--set` can shrink it where compute is scarce (CPUs
without native bf16 run bf16 matrix products an order of magnitude slower than fp32).

Prints a Markdown table, writes the rows as JSON and the table with what it shows into a docs page
(docs/memory-<precisions>.md unless --page says otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

REPO = Path.cwd()  # run from the repository's root, as every benchmark (benchmarks/common.py)
sys.path.insert(0, str(REPO))

from common import markdown_table, write_json, write_page  # noqa: E402
from raytrain_par import config, data, models, strategies  # noqa: E402
from raytrain_par.data.loader import MemoryLoader  # noqa: E402
from raytrain_par.data.shards import DatasetInfo, read_split  # noqa: E402
from raytrain_par.local_group import run_ranks  # noqa: E402
from raytrain_par.metrics.memory import return_freed_memory  # noqa: E402
from raytrain_par.strategies import DistContext  # noqa: E402

NOTES = {
    ("zero-1", "fp32"): "DeepSpeed keeps an fp32 master copy of its partition (+4/N)",
    ("zero-2", "fp32"): "DeepSpeed keeps an fp32 master copy of its partition (+4/N)",
    ("zero-3", "fp32"): "DeepSpeed keeps an fp32 master copy of its partition (+4/N)",
}


def _measure_rank(rank: int, world: int, spec_dict: dict, info_dict: dict, steps: int) -> dict:
    return_freed_memory()  # peak resident memory that follows what is in use (see metrics/memory.py)
    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    arrays = read_split(info, info.train_path)  # before the engine: data is not model state
    model, task = models.build(spec.model, info, spec.train.seed)
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(), steps)
    loader = MemoryLoader(arrays, spec.train.global_batch_size, engine.dp_rank, engine.dp_size, spec.train.seed)
    times = []
    for _, batch in zip(range(steps), loader.epoch(0)):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - t0)
    return {"memory": engine.memory(), "num_params": engine.num_params,
            "step_time_s": sum(times[1:]) / max(1, len(times) - 1)}  # the first step builds state


def measure(spec_dict: dict, info: dict, world: int, steps: int) -> list[dict]:
    """Train `steps` steps on `world` fresh processes; returns each rank's report."""
    return run_ranks(world, _measure_rank, spec_dict, info, steps, group_of_one=True, fresh=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="experiments/zero-memory.yaml")
    p.add_argument("--strategies", help="default: the experiment's sweep")
    p.add_argument("--workers", help="e.g. 1,2,4 (default: the experiment's sweep)")
    p.add_argument("--precisions", help="fp32,bf16 (default: the experiment's sweep)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the experiment, as `raytrain-par run --set`")
    p.add_argument("--steps", type=int, default=3, help="steps per measurement (>= 2: optimizer state exists "
                   "from the second on)")
    p.add_argument("--out", help="JSON file (default: benchmarks/results/memory.json)")
    p.add_argument("--page", help="Markdown page (default: docs/memory-<precisions>.md)")
    args = p.parse_args(argv)

    spec = config.load_experiment(args.experiment, args.overrides)
    sweep = (spec.sweep or {}).get("grid", {})

    def pick(option, key, default):
        return option.split(",") if option else [str(v) for v in sweep.get(key, default)]

    names = pick(args.strategies, "strategy.name", [spec.strategy.name])
    workers = [int(w) for w in pick(args.workers, "scaling.num_workers", [spec.scaling.num_workers])]
    precisions = pick(args.precisions, "train.precision", [spec.train.precision])
    info = data.prepare(spec.data, spec.data.cache_dir).to_json()

    rows = []
    for precision in precisions:
        for n in workers:
            for name in names:
                raw = spec.to_dict()
                raw.update(sweep=None, strategy={"name": name})
                raw["scaling"]["num_workers"] = n
                raw["train"]["precision"] = precision
                s = config.parse(raw)
                t0 = time.perf_counter()
                reports = measure(s.to_dict(), info, n, args.steps)
                worst = max(reports, key=lambda r: r["memory"]["mem_model_state_bytes"])
                mem, params = worst["memory"], worst["num_params"]
                est = strategies.engine_class(name, s.strategy.options).model_state_bytes(s.strategy.options, s.train, n, params)
                row = {
                    "strategy": name, "workers": n, "precision": precision, "num_params": params,
                    "measured_bytes": mem["mem_model_state_bytes"], "census_bytes": mem["mem_model_state_census_bytes"],
                    "param_bytes": mem["mem_param_bytes"], "grad_bytes": mem["mem_grad_bytes"],
                    "optim_bytes": mem["mem_optim_bytes"], "peak_bytes": mem["mem_peak_bytes"],
                    "measured_per_param": mem["mem_model_state_bytes"] / params,
                    "theory_per_param": est.theory / params, "by_design_per_param": est.expected / params,
                    "step_time_s": max(r["step_time_s"] for r in reports), "note": NOTES.get((name, precision), ""),
                }
                rows.append(row)
                print(f"  {precision} {name} x{n}: {row['measured_per_param']:.2f} B/param measured, "
                      f"{row['theory_per_param']:.2f} theory, step {row['step_time_s']:.2f} s "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    for row in rows:
        ddp = next((r for r in rows if r["strategy"] == "ddp" and r["workers"] == row["workers"]
                    and r["precision"] == row["precision"]), None)
        row["vs_ddp"] = row["measured_bytes"] / ddp["measured_bytes"] if ddp else None
        row["step_time_vs_ddp"] = row["step_time_s"] / ddp["step_time_s"] if ddp else None
        # within 10% of the theory, or of what the implementation keeps by design
        row["meets_target"] = (abs(row["measured_per_param"] / row["theory_per_param"] - 1) <= 0.10
                               or (row["note"] != "" and abs(row["measured_per_param"] / row["by_design_per_param"] - 1) <= 0.10))

    print(table(rows))
    out = write_json("memory", {"experiment": spec.to_dict(), "rows": rows}, args.out)
    print(f"\n{len(rows)} rows in {out}")
    page = write_page(f"memory-{'-'.join(precisions)}", f"Model states per worker, measured ({', '.join(precisions)})",
                      page_body(spec, rows, args.steps, args.experiment), args.page)
    print(f"written {page}")
    return 0


def page_body(spec, rows: list[dict], steps: int, experiment: str) -> str:
    """The page's text: what was trained, the table, and what it says at the largest worker count."""
    t = spec.train
    path = Path(experiment).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    lines = [f"Every strategy of `{shown}` trained {steps} steps in a fresh gloo process group: "
             f"{spec.model.name} ({rows[0]['num_params'] / 1e6:.1f}M parameters), AdamW, a global batch of "
             f"{t.global_batch_size} rows of {spec.data.seq_len} tokens; the largest worker's model-state bytes per "
             "parameter, as the allocator counts them (see [memory.md](memory.md)), beside the theory and what "
             "the implementation holds by design.", "", table(rows), ""]
    for precision in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == precision]
        most = max(r["workers"] for r in mine)
        cuts = [f"{r['strategy']} {1 - r['vs_ddp']:.0%} less" for r in mine
                if r["workers"] == most and r["strategy"] != "ddp" and r["vs_ddp"] is not None]
        met = sum(r["meets_target"] for r in mine)
        lines.append(f"- {precision}: on {most} workers, against ddp: {', '.join(cuts) or 'no ddp row'}. "
                     f"{met} of {len(mine)} rows within 10% of their theory or of what the implementation holds "
                     "by design.")
    lines.append("\nStep times on a machine whose cores the workers share say little about speed; the step-time "
                 "column is there to show that a strategy ran, not how fast it is on a cluster.")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ["precision", "strategy", "workers", "measured B/param", "theory", "by design", "measured / theory",
            "vs DDP", "step time vs DDP", "note"]
    return markdown_table(head, [[
        r["precision"], r["strategy"], r["workers"], f"{r['measured_per_param']:.2f}", f"{r['theory_per_param']:.2f}",
        f"{r['by_design_per_param']:.2f}", f"{r['measured_per_param'] / r['theory_per_param']:.2f}",
        "-" if r["vs_ddp"] is None else f"{r['vs_ddp']:.2f}x",
        "-" if r["step_time_vs_ddp"] is None else f"{r['step_time_vs_ddp']:.2f}x", r["note"]] for r in rows])


if __name__ == "__main__":
    sys.exit(main())
