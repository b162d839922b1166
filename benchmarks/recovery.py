"""Recovery from a lost worker, per strategy: time from the kill to training resumed, and steps
redone (trained again because they came after the last checkpoint).

A run with `train.max_failures: 1` checkpoints every `--checkpoint-every` evaluations; a training
worker is killed with SIGKILL from outside once the run has passed `--kill-after` steps; Ray Train
replaces the worker group and the loop resumes from the latest intact checkpoint.

    python benchmarks/recovery.py [--strategies ddp,zero-3,megatron,pipeline] [--steps 16]

Strategies are named as under `strategy.name`; the model-parallel ones run with 2-way splits
(`megatron`: tensor_parallel 2, `pipeline`: 2 stages with the 1F1B schedule).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import ray
from common import print_table, write_json
from ray.util.state import list_actors

from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment, start_local_cluster, worker_env
from raytrain_par.metrics.records import read_records

HERE = Path(__file__).resolve().parent

# The strategy block of each measured strategy (on the default 2 workers).
STRATEGIES = {
    "ddp": "{name: ddp}",
    "zero-1": "{name: zero-1}",
    "zero-2": "{name: zero-2}",
    "zero-3": "{name: zero-3}",
    "fsdp": "{name: fsdp}",
    "megatron": "{name: megatron, tensor_parallel: 2}",
    "pipeline": "{name: pipeline, stages: 2, schedule: 1f1b}",
}


def measure(strategy: str, a, work: Path) -> dict:
    spec = load_experiment(a.experiment, [
        f"strategy={STRATEGIES[strategy]}", f"scaling.num_workers={a.workers}", f"train.max_steps={a.steps}",
        "train.eval_every_steps=2", f"train.checkpoint_every_evals={a.checkpoint_every}", "train.max_failures=1",
        "train.lr_schedule=constant", "train.warmup_steps=0", "data.max_val_samples=16",
        f"output_dir={work / strategy}"])
    done = {}
    thread = threading.Thread(target=lambda: done.update(result=run_experiment(spec, log=lambda *_: None)))
    thread.start()
    metrics = work / strategy / spec.name / "metrics.parquet"
    before = []
    while not before and thread.is_alive():
        time.sleep(0.1)
        if metrics.exists():
            before = [r for r in read_records(metrics) if r["step"] >= a.kill_after]
    workers = list_actors(address=ray.get_runtime_context().gcs_address,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    t_kill = time.time()
    os.kill(workers[-1]["pid"], signal.SIGKILL)
    thread.join()
    records = done["result"].records
    last = max(before, key=lambda r: r["step"])
    after = min((r for r in records if r.get("resumed_from_step") is not None), key=lambda r: r["step"])
    at_kill = last["step"] + int((t_kill - last["timestamp"]) / (last["step_time_s"] or 1))
    return {"strategy": strategy, "killed_at_step": at_kill, "resumed_from_step": after["resumed_from_step"],
            "steps_redone": max(0, at_kill - after["resumed_from_step"]),
            "recovery_s": after["started_at"] - t_kill, "completed": done["result"].error is None,
            "final_step": records[-1]["step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default=str(HERE.parent / "experiments" / "quickstart.yaml"))
    p.add_argument("--strategies", default="ddp,zero-3,megatron,pipeline",
                   help=f"comma-separated, of: {', '.join(STRATEGIES)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill-after", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=2, help="evaluations (every 2 steps) per checkpoint")
    p.add_argument("--out")
    a = p.parse_args()
    unknown = [s for s in a.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        p.error(f"--strategies: unknown {unknown[0]!r}; use some of {', '.join(STRATEGIES)}")
    start_local_cluster(num_cpus=a.workers + 1, env=worker_env())
    work = Path(tempfile.mkdtemp(prefix="raytrain-par-recovery-"))
    rows = [measure(s, a, work) for s in a.strategies.split(",")]
    print_table(["strategy", "killed at step", "resumed from", "steps redone", "kill -> training (s)", "completed"],
                [[r["strategy"], r["killed_at_step"], r["resumed_from_step"], r["steps_redone"],
                  f"{r['recovery_s']:.1f}", r["completed"]] for r in rows])
    print(f"written {write_json('recovery', {'rows': rows, 'steps': a.steps, 'workers': a.workers}, a.out)}")


if __name__ == "__main__":
    main()
