"""Megatron tensor parallel (T = 1, 2, 4, and 2 x 2 with data parallel) against DDP on the same GPT-2.

For each layout: median step time, per-worker memory (parameters, all model states, activations
kept for backward, peak), and bytes all-reduced per step and worker, measured by counting every
all-reduce, beside the Megatron paper's count (Shoeybi et al. 2019: per layer two all-reduces of
the [b, s, h] activations forward and two backward, b = the rows of one data-parallel slice; our
vocabulary-parallel embedding and LM head add one each way, the parallel cross-entropy three
floats per token) and, for data parallel, one all-reduce of every local gradient. "wire" is what a
ring all-reduce moves per worker: 2 (n - 1) / n times the payload (the paper's 8bsh(t-1)/t per layer).

    python benchmarks/tensor_parallel.py                        # gpt2-mini on CPU, gloo
    python benchmarks/tensor_parallel.py --device cuda --model gpt2-medium --batch 32 --seq-len 1024

Each layout runs in its own process group (torch.multiprocessing, no Ray), all ranks on this machine.
Prints a table and writes JSON (default results/benchmarks/tensor_parallel.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_par import config, data, models, strategies  # noqa: E402
from raytrain_par.models import gpt2  # noqa: E402
from raytrain_par.data.loader import MemoryLoader  # noqa: E402
from raytrain_par.data.shards import DatasetInfo, read_split  # noqa: E402
from raytrain_par.local_group import run_ranks  # noqa: E402
from raytrain_par.metrics.memory import SavedActivations  # noqa: E402
from raytrain_par.metrics.records import mib  # noqa: E402
from raytrain_par.strategies import DistContext  # noqa: E402

# (label, strategy, workers)
LAYOUTS = [
    ("ddp x1", {"name": "ddp"}, 1),
    ("ddp x2", {"name": "ddp"}, 2),
    ("ddp x4", {"name": "ddp"}, 4),
    ("megatron T=1", {"name": "megatron", "tensor_parallel": 1}, 1),
    ("megatron T=2", {"name": "megatron", "tensor_parallel": 2}, 2),
    ("megatron T=4", {"name": "megatron", "tensor_parallel": 4}, 4),
    ("megatron T=2 x D=2", {"name": "megatron", "tensor_parallel": 2}, 4),
]


def _count_ddp(counter: dict, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def measure(rank: int, world: int, spec_dict: dict, info_dict: dict, steps: int, device_type: str) -> dict:
    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, task = models.build(spec.model, info, spec.train.seed)
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(device), steps)
    ddp_bytes = {"bytes": 0}
    if spec.strategy.name == "ddp" and world > 1:
        engine.module.register_comm_hook(ddp_bytes, _count_ddp)
    loader = MemoryLoader(read_split(info, info.train_path), spec.train.global_batch_size, engine.dp_rank,
                          engine.dp_size, spec.train.seed)
    times, activations = [], None
    for i, batch in zip(range(steps), loader.epoch(0)):
        ddp_bytes["bytes"] = 0
        saved = SavedActivations() if i == 1 else None
        t0 = time.perf_counter()
        with saved.track(engine.module.parameters()) if saved else contextlib.nullcontext():
            float(engine.train_step(batch))  # float(): waits for the device
        times.append(time.perf_counter() - t0)
        activations = saved.peak if saved is not None else activations
    mem = engine.memory()
    tp = getattr(engine, "tp", None)
    # model states from the census of live tensors: the allocator's count would hold the batches above
    return {
        "step_time_s": statistics.median(times[1:]), "mem_param_bytes": mem["mem_param_bytes"],
        "mem_model_state_bytes": mem["mem_model_state_census_bytes"], "mem_activation_bytes": activations,
        "mem_peak_bytes": mem["mem_peak_bytes"],
        "tp_allreduce_bytes": mem.get("comm_tp_allreduce_bytes_per_step", 0),
        "dp_allreduce_bytes": mem.get("comm_dp_allreduce_bytes_per_step", ddp_bytes["bytes"]),
        "tp_size": tp.size if tp is not None else 1, "dp_size": engine.dp_size,
    }


def formula(spec, info: DatasetInfo, tp_size: int, dp_size: int, params_local: int) -> dict:
    sizes = gpt2.sizes(spec.model.name, spec.model.options)
    n_layer, h = sizes["n_layer"], sizes["n_embd"]
    b, s = spec.train.global_batch_size // dp_size, info.seq_len
    layers = 4 * n_layer * b * s * h if tp_size > 1 else 0
    extra = 2 * b * s * h + 3 * b * s if tp_size > 1 else 0
    dp = params_local if dp_size > 1 else 0
    return {"paper_tp_layer_bytes": 4 * layers, "tp_formula_bytes": 4 * (layers + extra), "dp_formula_bytes": dp,
            "wire_bytes_per_worker": (2 * (tp_size - 1) / tp_size * 4 * (layers + extra)
                                      + 2 * (dp_size - 1) / dp_size * dp)}


# -- a process group per layout ----------------------------------------------------------------------

def run_group(world: int, backend: str, fn, *args) -> list:
    return run_ranks(world, fn, *args, backend=backend, threads=int(os.environ.get("OMP_NUM_THREADS", "1")),
                     fresh=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="steps per layout; the first is not timed")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every layout this many times, in turn, and keep each one's fastest (a shared machine)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layouts", default=",".join(label for label, _, _ in LAYOUTS),
                   help="comma-separated subset of: " + ", ".join(label for label, _, _ in LAYOUTS))
    p.add_argument("--out", default="results/benchmarks/tensor_parallel.json")
    args = p.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    info = data.prepare(config.DataSpec(name="kjv", seq_len=args.seq_len, vocab_size=config.DEFAULT_VOCAB_SIZE), log=lambda *_: None)
    wanted = [w.strip() for w in args.layouts.split(",")]
    specs = {}
    for label, strategy, workers in LAYOUTS:
        if label in wanted:
            specs[label] = config.parse({
                "name": "bench", "model": {"name": args.model}, "data": {"name": "kjv", "seq_len": args.seq_len},
                "strategy": strategy, "scaling": {"num_workers": workers, "use_gpu": args.device == "cuda"},
                "train": {"global_batch_size": args.batch, "max_steps": args.steps, "lr": 1e-3}}).to_dict()
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for label, spec_dict in specs.items():
            workers = spec_dict["scaling"]["num_workers"]
            out = run_group(workers, backend, measure, spec_dict, info.to_json(), args.steps, args.device)
            worst = max(out, key=lambda r: r["mem_model_state_bytes"])
            row = {"layout": label, "workers": workers, **worst,
                   "step_time_s": max(r["step_time_s"] for r in out)}  # a step ends when its slowest worker's does
            row.update(formula(config.from_dict(spec_dict), info, row["tp_size"], row["dp_size"],
                               row["mem_param_bytes"]))
            if label not in best or row["step_time_s"] < best[label]["step_time_s"]:
                best[label] = row
            print(f"[{repeat + 1}/{args.repeats}] {label}: {row['step_time_s'] * 1000:.0f} ms/step", flush=True)
    rows = list(best.values())
    head = ["layout", "ms/step", "params MiB", "states MiB", "activ MiB", "peak MiB", "TP allreduce MiB",
            "paper 4Lbsh MiB", "TP formula MiB", "DP allreduce MiB", "DP formula MiB", "wire MiB/worker"]
    table = [[r["layout"], f"{r['step_time_s'] * 1000:.0f}", mib(r["mem_param_bytes"]), mib(r["mem_model_state_bytes"]),
              mib(r["mem_activation_bytes"]), mib(r["mem_peak_bytes"]), mib(r["tp_allreduce_bytes"]),
              mib(r["paper_tp_layer_bytes"]), mib(r["tp_formula_bytes"]), mib(r["dp_allreduce_bytes"]),
              mib(r["dp_formula_bytes"]), mib(r["wire_bytes_per_worker"])] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    print(f"\n{args.model}, global batch {args.batch} x {args.seq_len} tokens, {args.device}/{backend}, "
          f"per worker (largest), bytes per step")
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths)))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": args.model, "global_batch": args.batch, "seq_len": args.seq_len,
                                "device": args.device, "steps": args.steps, "repeats": args.repeats,
                                "rows": rows}, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
