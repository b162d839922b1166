"""Pipeline schedules compared: step time, measured bubble against the ideal, memory per stage.

For each number of stages P and each schedule, P processes (torch.multiprocessing, one process
group, no Ray) train the same GPT-2 on the same random tokens for a few steps. Reported per run:
the mean step time, the measured bubble (fraction of a step a stage is not computing, mean over
stages) next to GPipe's ideal (P - 1) / (M + P - 1), and per stage the parameter bytes and the peak
activation bytes autograd held. The synchronous schedules compute the same thing: their last losses
must agree (to 1e-4).

    python benchmarks/pipeline.py                         # P = 2, 4 on the CPU (gloo): docs/pipelines.md
    python benchmarks/pipeline.py --stages 4 8 --device cuda --n-layer 24 --n-embd 1024 --batch 64

On a machine with fewer cores than P the processes share cores, and a rank that waits lends its
core to the others: measured bubbles there say more about the machine than about the schedule.
Beside each stage's measured activations, what `raytrain-par estimate` predicts for it. Writes
benchmarks/results/pipeline.json and docs/pipelines.md (`--page` elsewhere).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from common import markdown_table, print_table, provenance, write_json, write_page

from raytrain_par import config, estimate, models, strategies
from raytrain_par.data.shards import DatasetInfo
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics.records import mib
from raytrain_par.strategies import DistContext

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "pipedream"]


def _spec(args, stages: int, schedule: str) -> dict:
    if schedule == "pipedream":
        strategy = {"name": "pipedream", "stages": stages, "microbatches": args.microbatches or 4 * stages}
    else:
        strategy = {"name": "pipeline", "stages": stages, "schedule": schedule,
                    "microbatches": args.microbatches or 4 * stages}
    return {"name": "bench", "model": {"name": args.model, "n_layer": args.n_layer, "n_embd": args.n_embd,
                                       "n_head": args.n_head},
            "data": {"name": "kjv", "seq_len": args.seq_len, "vocab_size": args.vocab},
            "strategy": strategy, "scaling": {"num_workers": stages, "use_gpu": args.device == "cuda"},
            "train": {"global_batch_size": args.batch, "max_steps": args.warmup + args.steps, "lr": 1e-4}}


def _worker(rank: int, world: int, args, spec_dict: dict) -> dict:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    spec = config.from_dict(spec_dict)
    info = _info(args)
    model, task = models.build(spec.model, info, 0)
    steps = args.warmup + args.steps
    # one step more than run: pipedream drains its pipeline in its last step, outside what is timed
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext(rank, world, rank, device),
                                     steps + 1)
    del model
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)}
               for _ in range(steps)]
    losses, times = [], []
    for i, batch in enumerate(batches):
        if i == args.warmup:
            engine.memory()  # records measure from here: torch's schedules infer shapes in their first step
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(float(engine.train_step(batch)))
        times.append(time.perf_counter() - t0)
    return {"losses": losses, "step_s": sum(times[args.warmup:]) / args.steps, "memory": engine.memory()}


def _info(args) -> DatasetInfo:
    return DatasetInfo(name="random", kind="text", train_path="", val_path="", num_train=0, num_val=0,
                       seq_len=args.seq_len, vocab_size=args.vocab)


def run(args, stages: int, schedule: str) -> dict:
    spec_dict = config.parse(_spec(args, stages, schedule)).to_dict()  # invalid options fail here, not in a worker
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    results = dict(enumerate(run_ranks(stages, _worker, args, spec_dict, backend=backend, threads=args.threads,
                                        fresh=True)))
    first = results[0]
    m = spec_dict["strategy"]["microbatches"]
    mem = first["memory"]
    return {"stages": stages, "schedule": schedule, "microbatches": m, "step_s": max(r["step_s"] for r in results.values()),
            "bubble": mem["bubble_fraction"], "bubble_per_stage": mem["stage_bubble_fraction"],
            "bubble_ideal": (stages - 1) / (m + stages - 1), "layers_per_stage": mem["stage_layers"],
            "param_bytes_per_stage": mem["stage_param_bytes"], "activation_bytes_per_stage": mem["stage_activation_bytes"],
            "stash_bytes_per_stage": mem.get("stage_stash_bytes"), "losses": first["losses"],
            "estimated_activation_bytes_per_stage": _estimated(config.from_dict(spec_dict), _info(args))}


def _estimated(spec, info) -> list[float]:
    """`estimate`'s activations per pipeline stage, in the order the engine records its stages (a
    pipeline rank's stages in the order it holds them)."""
    ranks = estimate.pipeline_ranks(spec, info)
    return [r.activations for r in ranks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    p.add_argument("--microbatches", type=int, help="default 4 x stages")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", choices=["gloo", "nccl"])
    p.add_argument("--out", help="JSON file (default benchmarks/results/pipeline.json)")
    p.add_argument("--page", help="Markdown page (default docs/pipelines.md)")
    args = p.parse_args()

    rows = []
    for stages in args.stages:
        for schedule in args.schedules:
            row = run(args, stages, schedule)
            rows.append(row)
            print(f"P={stages} {schedule}: {row['step_s'] * 1000:.0f} ms/step, bubble {row['bubble']:.2f} "
                  f"(ideal {row['bubble_ideal']:.2f})", flush=True)
    for stages in args.stages:  # the synchronous schedules compute the same thing
        sync = [r["losses"][-1] for r in rows if r["stages"] == stages and r["schedule"] != "pipedream"]
        assert max(sync) - min(sync) < 1e-4, f"P={stages}: synchronous schedules disagree: {sync}"

    made = provenance()
    print(f"written {write_json('pipeline', {'args': vars(args), 'runs': rows}, args.out, made)}")
    render(rows, args, args.page, made)


def _mib(values) -> str:
    return " / ".join(mib(b) for b in values)


def render(rows: list[dict], args, page: str | None, made: dict) -> None:
    head = ["P", "schedule", "M", "ms/step", "bubble (measured)", "ideal (P-1)/(M+P-1)", "parameters per stage, MiB",
            "activations per stage, MiB", "estimated, MiB"]
    table = [[r["stages"], r["schedule"], r["microbatches"], f"{r['step_s'] * 1000:.0f}", f"{r['bubble']:.2f}",
              f"{r['bubble_ideal']:.2f}", _mib(r["param_bytes_per_stage"]), _mib(r["activation_bytes_per_stage"]),
              _mib(r["estimated_activation_bytes_per_stage"])] for r in rows]
    print()
    print_table(head, table)
    off = [(r, m / e - 1) for r in rows for m, e in zip(r["activation_bytes_per_stage"],
                                                        r["estimated_activation_bytes_per_stage"]) if e]
    worst, gap = max(off, key=lambda x: abs(x[1])) if off else (None, 0.0)
    largest = {r["stages"]: max(r["param_bytes_per_stage"]) for r in rows if r["schedule"] == "1f1b"}
    text = (f"A GPT-2 ({args.model}, {args.n_layer} blocks of width {args.n_embd}, vocabulary {args.vocab}, "
            f"{args.seq_len} tokens per row, batch {args.batch}) under each schedule on {args.device}, "
            f"{args.steps} timed steps after {args.warmup}; M microbatches per step (PipeDream the same M). "
            "The synchronous schedules reach the same loss (checked to 1e-4). Activations are the saved-activation "
            "tracker's peak per stage; `estimated` is what `raytrain-par estimate` predicts for that stage"
            + (f", at most {abs(gap):.0%} off ({worst['schedule']}, P = {worst['stages']})." if worst else ".")
            + " Step times and bubbles on a machine with fewer cores than P say more about the machine than about "
              "the schedule: a waiting rank lends its core to the others.\n\n"
            + markdown_table(head, table) + "\n")
    if len(largest) > 1:
        fewest, most = min(largest), max(largest)
        text += (f"\nGoing from {fewest} to {most} stages shrinks the largest stage's parameters only from "
                 f"{mib(largest[fewest])} to {mib(largest[most])} MiB (1F1B's split): the embedding and "
                 "the LM head's copy stay whole on the first and last stage.\n")
    print(f"written {write_page('pipelines', 'Pipeline schedules: step time, bubble and memory per stage', text, page, made=made)}")


if __name__ == "__main__":
    main()
