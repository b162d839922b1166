"""The study's setting predicted: GPT2-medium on 8 to 64 V100 and A100 GPUs, every strategy of
experiments/paper/strategies-gpt2-medium.yaml, on the GPU machines of clusters/aws-v100.yaml and
clusters/aws-a100.yaml, and which of the study's findings the predictions reproduce.

    python benchmarks/study_setting.py

Nothing trains: each row is `raytrain-par estimate --cluster FILE`'s memory per GPU and step time
(metrics/memory via the engines' own accounting, metrics/steptime.py), the experiment's model, data,
global batch 256 x 512 tokens and fp32 as the file has them. A worker computes at most 4 rows at
once: the data-parallel strategies accumulate gradients over micro-batches of 4 rows where their
share of the batch is larger, the pipelines run their own microbatches (the file's schedule).

The findings of Nichols et al. 2021 checked, each with the rule of `raytrain-par reproduce`'s judge:

- ZeRO's memory: the best ZeRO stage holds at least 42% less per GPU than ddp (the study measured
  42-66%) and its step is at most 10% slower;
- Megatron's memory is U-shaped in the tensor-parallel degree: at 64 GPUs, T = 1, 2, 4, 8 and 16, each
  data-parallel replica computing its whole share of the batch at once (256 T / 64 rows, as the file
  trains and as the study's runs did: more T, fewer replicas, more rows each), the least memory per GPU
  at an inner T;
- tensor x data parallel is best at scale: at 64 GPUs, the fastest step of every strategy is megatron
  with T > 1 and data-parallel replicas.

Prints the tables and writes benchmarks/results/study_setting.json and docs/study-setting.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # run from the repository's root, as every benchmark (benchmarks/common.py)

from common import markdown_table, print_table, provenance, write_json, write_page  # noqa: E402

from raytrain_par import config, devices, estimate  # noqa: E402
from raytrain_par.config import load_experiment  # noqa: E402
from raytrain_par.errors import ConfigError  # noqa: E402
from raytrain_par.metrics.memory import size_text  # noqa: E402

EXPERIMENT = "experiments/paper/strategies-gpt2-medium.yaml"
CLUSTERS = ["clusters/aws-v100.yaml", "clusters/aws-a100.yaml"]
WORKERS = [8, 16, 32, 64]
MICRO_ROWS = 4  # rows a worker computes at once
ZERO_LESS, ZERO_SLOWER = 0.42, 0.10  # the study's least ZeRO saving; the judge's speed allowance
DEGREES = [1, 2, 4, 8, 16]  # megatron's tensor-parallel degrees for the U


def spec_for(base: dict, strategy: dict, workers: int, accumulate: bool = True) -> config.ExperimentSpec | str:
    """The experiment with this strategy on `workers`, accumulating to micro-batches of MICRO_ROWS rows
    (data-parallel strategies; with `accumulate`), or why it cannot exist."""
    raw = {**base, "strategy": dict(strategy), "scaling": {**base["scaling"], "num_workers": workers},
           "train": dict(base["train"])}
    tensor, stages = strategy.get("tensor_parallel", 1), strategy.get("stages", 1)
    replicas = workers // (tensor * stages) if workers % (tensor * stages) == 0 else 0
    rows = base["train"]["global_batch_size"] // replicas if replicas else 0
    if accumulate and stages == 1 and rows > MICRO_ROWS:
        raw["train"]["gradient_accumulation_steps"] = rows // MICRO_ROWS
    try:
        return config.parse(raw)
    except ConfigError as e:
        return f"not possible: {e.field} ({e.problem})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/study_setting.json)")
    p.add_argument("--page", help="the docs page (default docs/study-setting.md)")
    a = p.parse_args(argv)
    made = provenance()
    experiment = load_experiment(EXPERIMENT, check_data=False)
    base = experiment.to_dict()
    base["sweep"] = None
    strategies = experiment.sweep["grid"]["strategy"]
    results, sections, findings = [], [], []
    for cluster in CLUSTERS:
        device, price, nodes = devices.cluster_device(cluster)
        rows = {}
        for strategy in strategies:
            for w in WORKERS:
                s = spec_for(base, strategy, w)
                key = (strategy_label(strategy), w)
                if isinstance(s, str):
                    rows[key] = {"note": s}
                    continue
                r = estimate.estimate(s, [s.strategy.name], [w], device)[0]
                rows[key] = ({"note": r.note} if r.note else
                             {"memory": r.device_bytes, "fits": r.device_bytes <= device.memory_bytes * estimate.HEADROOM,
                              "step_s": r.speed.step_s if r.speed else None,
                              "accumulation": s.train.gradient_accumulation_steps})
                print(f"{cluster} {key}: {rows[key]}", flush=True)
        u = {}
        for t in DEGREES:
            s = spec_for(base, {"name": "megatron", "tensor_parallel": t}, WORKERS[-1], accumulate=False)
            r = None if isinstance(s, str) else estimate.estimate(s, ["megatron"], [WORKERS[-1]], device)[0]
            u[t] = None if r is None or r.note else r.device_bytes
        results.append({"cluster": cluster, "device": device.name, "instance": nodes.instance,
                        "usd_per_gpu_hour": price, "rows": {f"{k[0]} x{k[1]}": v for k, v in rows.items()},
                        "megatron_memory_by_degree": u})
        sections.append(section(cluster, device, nodes, rows, strategies))
        findings += judge(device, rows, u)
    path = write_json("study_setting", {"clusters": results, "findings": findings}, a.out, made=made)
    print(f"written {path}")
    for f in findings:
        print(f)
    body = f"""
`{EXPERIMENT}` (GPT2-medium, {experiment.data.name} at {experiment.data.seq_len} tokens, global batch
{experiment.train.global_batch_size}, AdamW, {experiment.train.precision}) for every strategy of its sweep on
{', '.join(map(str, WORKERS))} GPUs of each cluster file's GPU machine, predicted by `raytrain-par estimate
--cluster FILE` ([step-time.md](step-time.md), [memory.md](memory.md)); nothing trained. A worker computes
at most {MICRO_ROWS} rows at once (gradient accumulation for the data-parallel strategies; the pipelines run
their own microbatches). "fits" leaves {1 - estimate.HEADROOM:.0%} of the GPU's memory to the CUDA context and
communication buffers. The steps to the target are the same for every strategy at this batch (each trains
as one process would, bit for bit), so the fastest step is the soonest to the target.

{chr(10).join(sections)}

## Which findings of the study the predictions reproduce

{chr(10).join(f'- {f}' for f in findings)}
"""
    page = write_page("study-setting", "The study's setting, predicted", body, a.page, made=made)
    print(f"written {page}")
    return 0


def strategy_label(strategy: dict) -> str:
    name = strategy["name"]
    if name == "megatron":
        return f"megatron T{strategy['tensor_parallel']}"
    if name in ("pipeline", "pipedream"):
        return f"{name} P{strategy['stages']}"
    return name


def section(cluster, device, nodes, rows, strategies) -> str:
    head = ["strategy"] + [f"{w} GPUs" for w in WORKERS]

    def cell(r):
        if "note" in r:
            return "-"
        step = "no step model" if r["step_s"] is None else f"{r['step_s']:.3g} s"
        return f"{size_text(r['memory'])}{'' if r['fits'] else ' (does not fit)'}, {step}"

    body = [[strategy_label(s)] + [cell(rows[(strategy_label(s), w)]) for w in WORKERS] for s in strategies]
    print_table(head, body)
    return (f"### {nodes.instance} ({device.name}, {nodes.gpus_per_node} a node; `{cluster}`)\n\n"
            f"Memory per GPU, step time:\n\n{markdown_table(head, body)}\n")


def judge(device, rows, u) -> list[str]:
    at = WORKERS[-1]
    out = []
    ddp = rows[("ddp", at)]
    zeros = [(n, rows[(n, at)]) for n in ("zero-1", "zero-2", "zero-3") if "memory" in rows[(n, at)]]
    best_name, best = min(zeros, key=lambda z: z[1]["memory"])
    less = 1 - best["memory"] / ddp["memory"]
    slower = best["step_s"] / ddp["step_s"] - 1
    held = less >= ZERO_LESS and slower <= ZERO_SLOWER
    out.append(f"ZeRO's memory on {device.name} at {at} GPUs: {best_name} holds {less:.0%} less per GPU than ddp "
               f"(study: 42-66%), its step {slower:+.0%} (allowed: +{ZERO_SLOWER:.0%}): "
               f"**{'held' if held else 'not held'}**")
    known = {t: m for t, m in u.items() if m is not None}
    low = min(known, key=known.get)
    inner = min(known) < low < max(known)
    curve = ", ".join(f"T{t} {size_text(m)}" for t, m in known.items())
    out.append(f"Megatron's U-shaped memory on {device.name} at {at} GPUs, no accumulation ({curve}): the least "
               f"at T{low}, {'an inner' if inner else 'an end'} degree: **{'held' if inner else 'not held'}**")
    timed = {k[0]: r["step_s"] for k, r in rows.items() if k[1] == at and r.get("step_s") is not None}
    fastest = min(timed, key=timed.get)
    tensor_data = fastest.startswith("megatron T") and fastest != "megatron T1"
    runner = min((k for k in timed if k != fastest), key=timed.get)
    out.append(f"Tensor x data parallel best at scale on {device.name} at {at} GPUs: the fastest step is {fastest} "
               f"({timed[fastest]:.3g} s; next {runner}, {timed[runner]:.3g} s): "
               f"**{'held' if tensor_data else 'not held'}**")
    return out


if __name__ == "__main__":
    sys.exit(main())
