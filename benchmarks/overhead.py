"""Time per training step: raytrain-par's engines under Ray Train against what a user would run
instead -- plain DDP, DeepSpeed ZeRO and FSDP2 scripts under `torchrun` (benchmarks/torchrun_plain.py).

Both sides train the same model (the experiment's GPT-2), the same shapes of data (its prepared
shards), the same global batch, worker count, threads per worker, precision and optimizer settings
(AdamW, no weight decay, no clipping, constant learning rate; the DeepSpeed config is the one our
zero-N engine builds), and are timed over the same window: the `--steps` steps after `--warmup`
steps. Ours is read from the run's records (`wall_time_s` counts training steps only: evaluations
and reports between them are outside it); theirs is the script's own clock over the same steps.
Rounds alternate which side goes first, so that both see the same machine load; the ratio of the
medians is the overhead (target: at most 1.05 for every strategy).

    python benchmarks/overhead.py                              # ddp, zero-1, zero-2, zero-3, fsdp
    python benchmarks/overhead.py --strategies ddp --rounds 5
    python benchmarks/overhead.py --set train.precision=bf16   # any experiment field

Prints a table and a verdict, writes benchmarks/results/overhead.json and docs/overhead.md.
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

from common import markdown_table, print_table, write_json, write_page

from raytrain_par import data, models
from raytrain_par.models import gpt2
from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment, start_local_cluster, worker_env
from raytrain_par.local_group import free_port

HERE = Path(__file__).resolve().parent
TARGET = 1.05
BASELINES = {"ddp": "torch DDP", "zero-1": "DeepSpeed ZeRO-1", "zero-2": "DeepSpeed ZeRO-2",
             "zero-3": "DeepSpeed ZeRO-3", "fsdp": "torch FSDP2"}


def our_step_time(spec, warmup: int, steps: int) -> float:
    """Mean step time over steps warmup+1 .. warmup+steps, from the run's records."""
    records = run_experiment(spec, log=lambda *_: None).records
    at = {r["step"]: r["wall_time_s"] for r in records}
    return (at[warmup + steps] - at[warmup]) / steps


def plain_command(spec, strategy: str, info, work: Path, a) -> list[str]:
    sizes = gpt2.sizes(spec.model.name, spec.model.options)
    t = spec.train
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.workers}",
           f"--master_port={free_port()}", str(HERE / "torchrun_plain.py"), "--strategy", strategy,
           "--data", info.train_path, "--seq-len", str(info.seq_len), "--vocab", str(info.vocab_size),
           "--n-layer", str(sizes["n_layer"]), "--n-embd", str(sizes["n_embd"]), "--n-head", str(sizes["n_head"]),
           "--batch", str(t.global_batch_size), "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--lr", str(t.lr), "--betas", *map(str, t.betas), "--eps", str(t.eps), "--precision", t.precision]
    o = spec.strategy.options
    if strategy == "ddp":
        cmd += ["--bucket-cap-mb", str(o.bucket_cap_mb)]
    elif strategy == "fsdp" and not o.reshard_after_forward:
        cmd += ["--no-reshard-after-forward"]
    elif strategy.startswith("zero-"):
        from raytrain_par.strategies.zero import deepspeed_config, merged

        model, _ = models.build_on_meta(spec.model, info)
        ds = merged(deepspeed_config(int(strategy[-1]), o, t, t.global_batch_size, a.workers,
                                     models.parameter_count(model), "cpu"), o.deepspeed)
        path = work / f"{strategy}.json"
        path.write_text(json.dumps(ds))
        cmd += ["--deepspeed-config", str(path)]
    return cmd


def plain_step_time(cmd: list[str], out: Path, threads: str, env: dict) -> float:
    cmd = [*cmd, "--out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, **env, "OMP_NUM_THREADS": threads},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["step_time_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default=str(HERE.parent / "experiments" / "quickstart.yaml"))
    p.add_argument("--strategies", default=",".join(BASELINES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps (a multiple of --warmup)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="experiment override")
    p.add_argument("--out", help="JSON file (default benchmarks/results/overhead.json)")
    p.add_argument("--page", help="Markdown page (default docs/overhead.md)")
    a = p.parse_args()
    names = [s for s in a.strategies.split(",") if s]
    unknown = [s for s in names if s not in BASELINES]
    if unknown:
        p.error(f"--strategies {','.join(unknown)}: no plain baseline; choose from {', '.join(BASELINES)}")
    if a.steps % a.warmup:
        p.error(f"--steps {a.steps}: must be a multiple of --warmup {a.warmup} (records are taken every "
                "--warmup steps, and the timed window runs from one record to another)")

    work = Path(tempfile.mkdtemp(prefix="raytrain-par-overhead-"))
    # The same arithmetic on both sides: no clipping, no decay, constant learning rate, no checkpoint.
    common = [f"scaling.num_workers={a.workers}", f"train.max_steps={a.warmup + a.steps}",
              f"train.eval_every_steps={a.warmup}", "train.eval_at_start=false", "train.checkpoint_every_evals=0",
              "train.grad_clip=0", "train.weight_decay=0", "train.lr_schedule=constant", "train.warmup_steps=0",
              "train.stop_at_target=false", "data.max_val_samples=16", f"output_dir={work}", *a.set]
    specs = {s: load_experiment(a.experiment, [*common, f"strategy.name={s}"]) for s in names}
    first = specs[names[0]]
    if first.model.name not in models.GPT2_NAMES:
        sys.exit("the overhead benchmark compares GPT-2 experiments")
    info = data.prepare(first.data, first.data.cache_dir)
    threads = str(max(1, int(first.scaling.cpus_per_worker)))
    env = worker_env(first)
    start_local_cluster(num_cpus=a.workers + 1, env=env)

    results = {}
    for i, s in enumerate(names):
        cmd = plain_command(specs[s], s, info, work, a)
        ours, plain = [], []
        for r in range(a.rounds):
            sides = [("ours", lambda: ours.append(our_step_time(specs[s], a.warmup, a.steps))),
                     ("plain", lambda: plain.append(plain_step_time(cmd, work / f"{s}-{r}.json", threads, env)))]
            for _, run in (sides if (i + r) % 2 == 0 else sides[::-1]):
                run()
            print(f"{s} round {r + 1}/{a.rounds}: raytrain-par under Ray {ours[-1]:.4f} s/step, "
                  f"plain {BASELINES[s]} under torchrun {plain[-1]:.4f} s/step", flush=True)
        ratio = statistics.median(ours) / statistics.median(plain)
        results[s] = {"ours_s": ours, "plain_s": plain, "ratio": ratio, "met": ratio <= TARGET}

    head = ["strategy", "plain baseline", "ours s/step", "plain s/step", "ratio", f"<= {TARGET}",
            "rounds ours", "rounds plain"]
    rows = [[s, BASELINES[s], f"{statistics.median(r['ours_s']):.4f}", f"{statistics.median(r['plain_s']):.4f}",
             f"{r['ratio']:.3f}", "met" if r["met"] else "NOT met", " ".join(f"{x:.4f}" for x in r["ours_s"]),
             " ".join(f"{x:.4f}" for x in r["plain_s"])] for s, r in results.items()]
    print()
    print_table(head, rows)
    missed = [s for s, r in results.items() if not r["met"]]
    verdict = (f"every ratio at most {TARGET}: met" if not missed
               else f"ratio above {TARGET} for {', '.join(missed)}: NOT met")
    print(f"\noverhead (ours / plain, median of {a.rounds} rounds): {verdict}")
    t = first.train
    setup = (f"{first.model.name} ({models.parameter_count(models.build_on_meta(first.model, info)[0]) / 1e6:.1f}M "
             f"parameters), {a.workers} workers x {threads} thread(s), global batch {t.global_batch_size} of "
             f"{info.seq_len} tokens, {t.precision}, AdamW; {a.steps} timed steps after {a.warmup} warm-up steps, "
             f"{a.rounds} rounds in alternating order")
    payload = {"experiment": first.name, "model": first.model.name, "workers": a.workers, "threads": threads,
               "global_batch_size": t.global_batch_size, "precision": t.precision, "steps": a.steps,
               "warmup": a.warmup, "rounds": a.rounds, "target": TARGET, "results": results, "verdict": verdict}
    print(f"written {write_json('overhead', payload, a.out)}")
    page = write_page("overhead", "Overhead against the plain libraries", f"""
Seconds per training step of raytrain-par's engines under Ray Train against plain scripts of the
same library under `torchrun` ([benchmarks/torchrun_plain.py](../benchmarks/torchrun_plain.py)): {setup}.
The ratio is ours over plain, of the medians; the target is at most {TARGET} for every strategy.

{markdown_table(head, rows)}

**Verdict: {verdict}.**
""", a.page)
    print(f"written {page}")


if __name__ == "__main__":
    main()
