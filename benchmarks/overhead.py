"""Time per training step: raytrain-par's DDP engine under Ray Train vs plain `torchrun` DDP.

Same model (the experiment's GPT-2), data (its prepared shards), global batch, worker count and
threads per worker. The two are run in alternating rounds within one invocation, so that both
see the same machine load; the ratio of the medians is the overhead (target: at most 1.05).

    python benchmarks/overhead.py [--experiment experiments/quickstart.yaml] [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import print_table, write_json

from raytrain_par import data, models
from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment, start_local_cluster, worker_env
from raytrain_par.local_group import free_port

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default=str(HERE.parent / "experiments" / "quickstart.yaml"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", help="JSON file (default benchmarks/results/overhead.json)")
    a = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="raytrain-par-overhead-"))
    # The same arithmetic on both sides: no clipping, no decay, constant learning rate, no
    # evaluation or checkpoint inside the timed interval.
    spec = load_experiment(a.experiment, [
        f"scaling.num_workers={a.workers}", f"train.max_steps={a.warmup + a.steps}",
        f"train.eval_every_steps={a.warmup}", "train.eval_at_start=false", "train.checkpoint_every_evals=0",
        "train.grad_clip=0", "train.weight_decay=0", "train.lr_schedule=constant", "train.warmup_steps=0",
        "data.max_val_samples=16", f"output_dir={work}"])
    if spec.model.name not in models.GPT2_NAMES:
        sys.exit("the overhead benchmark compares GPT-2 experiments")
    info = data.prepare(spec.data, spec.data.cache_dir)
    sizes = models.gpt2_sizes(spec.model)
    threads = str(max(1, int(spec.scaling.cpus_per_worker)))
    start_local_cluster(num_cpus=a.workers + 1, env=worker_env(spec))

    ours, plain = [], []
    for r in range(a.rounds):
        result = run_experiment(spec, log=lambda *_: None)
        ours.append(result.records[-1]["step_time_s"])
        out = work / f"torchrun-{r}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.workers}",
               f"--master_port={free_port()}", str(HERE / "torchrun_ddp.py"), "--data", info.train_path,
               "--seq-len", str(info.seq_len), "--vocab", str(info.vocab_size), "--n-layer", str(sizes["n_layer"]),
               "--n-embd", str(sizes["n_embd"]), "--n-head", str(sizes["n_head"]),
               "--batch", str(spec.train.global_batch_size), "--warmup", str(a.warmup), "--steps", str(a.steps),
               "--lr", str(spec.train.lr), "--out", str(out)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": threads},
                       stdout=subprocess.DEVNULL)
        plain.append(json.loads(out.read_text())["step_time_s"])
        print(f"round {r + 1}/{a.rounds}: raytrain-par under Ray {ours[-1]:.4f} s/step, torchrun {plain[-1]:.4f} s/step")

    ratio = statistics.median(ours) / statistics.median(plain)
    print()
    print_table(["runner", "median s/step", "rounds (s/step)"], [
        ["raytrain-par ddp (Ray Train)", f"{statistics.median(ours):.4f}", " ".join(f"{x:.4f}" for x in ours)],
        ["plain torchrun ddp", f"{statistics.median(plain):.4f}", " ".join(f"{x:.4f}" for x in plain)],
    ])
    print(f"\noverhead ratio (ours / torchrun): {ratio:.3f}  (target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    path = write_json("overhead", {
        "experiment": spec.name, "model": spec.model.name, "workers": a.workers,
        "global_batch_size": spec.train.global_batch_size, "steps": a.steps, "warmup": a.warmup,
        "raytrain_par_step_s": ours, "torchrun_step_s": plain, "ratio": ratio, "target": 1.05,
    }, a.out)
    print(f"written {path}")


if __name__ == "__main__":
    main()
