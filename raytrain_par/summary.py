"""What a run (or a sweep) would do, worked out from the experiment alone, before anything starts:
`raytrain-par check` ends with it, and `check --json` gives it under `summary`.

Workers and their layout (pipeline x tensor x data, the sharding of the data-parallel replicas), the
rows each replica reads per step and per micro-batch, the steps and epochs, the evaluations and
checkpoints; for a sweep, its trials and how many run at once. Steps and epochs that depend on the
size of the data set are given where the data set is prepared already (`raytrain-par data FILE`), and
said to be unknown otherwise: counting them would mean preparing it.
"""

from __future__ import annotations

import os

import torch

from . import data as data_sets
from .config import ExperimentSpec


def run_summary(spec: ExperimentSpec) -> dict:
    s, t = spec.scaling, spec.train
    layout = spec.layout
    accumulation = t.gradient_accumulation_steps
    micro = spec.per_worker_batch // accumulation // (layout.microbatches if layout.pipeline > 1 else 1)
    info = data_sets.cached(spec.data, spec.data.cache_dir)
    per_epoch = info.num_train // t.global_batch_size if info is not None else None
    if t.max_steps is not None and t.epochs is None:
        steps = t.max_steps
    elif per_epoch:
        steps = spec.total_steps(per_epoch)
    else:
        steps = None
    out = {
        "workers": [s.min_workers, s.num_workers] if s.elastic else s.num_workers,
        "device": "cuda" if s.use_gpu else "cpu",
        "backend": s.effective_backend,
        "layout": {"pipeline": layout.pipeline, "tensor": layout.tensor, "data": layout.data,
                   "sharding": layout.sharding, "schedule": layout.schedule, "microbatches": layout.microbatches,
                   "virtual_stages": layout.virtual_stages, "text": layout.describe()},
        "global_batch_size": t.global_batch_size,
        "rows_per_replica": spec.per_worker_batch,
        "rows_per_microbatch": micro,
        "gradient_accumulation_steps": accumulation,
        "train_rows": info.num_train if info is not None else None,
        "steps_per_epoch": per_epoch,
        "steps": steps,
        "epochs": steps / per_epoch if steps is not None and per_epoch else None,
        "evaluations": None,
        "checkpoints": None,
        "keep_checkpoints": t.keep_checkpoints if t.checkpoint_every_evals else 0,
        "adaptive_batch": None,
    }
    if t.adaptive_batch is not None:
        a = t.adaptive_batch
        out["adaptive_batch"] = {"min": a.min_global_batch_size or t.global_batch_size,
                                 "max": a.max_global_batch_size, "lr_scaling": a.lr_scaling,
                                 "every_evals": a.every_evals}
    if steps is not None:
        out["evaluations"], out["checkpoints"] = _evaluations(spec, steps, per_epoch)
    return out


def _evaluations(spec: ExperimentSpec, steps: int, per_epoch: int | None) -> tuple[int | None, int | None]:
    """Evaluations and checkpoints of a run of `steps` steps, as the worker loop makes them: one before
    the first step (eval_at_start), one every eval_every_steps (else at the end of every epoch) and one
    after the last step; a checkpoint after every checkpoint_every_evals-th evaluation and the last."""
    t = spec.train
    every = t.eval_every_steps or per_epoch
    if not every:
        return None, None
    at = sorted({*range(every, steps + 1, every), steps})
    evals = int(t.eval_at_start) + len(at)
    if not t.checkpoint_every_evals:
        return evals, 0
    first = int(t.eval_at_start) + 1  # the number of the first evaluation after a step
    numbers = range(first, first + len(at))
    return evals, sum(1 for n in numbers if n % t.checkpoint_every_evals == 0 or n == numbers[-1])


def sweep_summary(plan, spec: ExperimentSpec) -> dict:
    """Trials of a sweep (grid x cases, times num_samples draws of its random keys) and how many run at
    once: sweep.max_concurrent_trials, else what the cluster's free CPUs (GPUs) hold, one CPU kept for
    Ray Data's reads; for the embedded local cluster that is this machine's."""
    sw = plan.sweep
    trials = len(plan.points) * (sw.num_samples if sw.random or sw.search == "optuna" else 1)
    cpus, gpus = os.cpu_count() or 1, torch.cuda.device_count()
    at_once = plan.trials_held({"CPU": cpus, "GPU": gpus})  # the rule `sweep` applies to the cluster's
    if sw.max_concurrent_trials:
        source = "sweep.max_concurrent_trials"
    else:
        source = (f"the free CPUs of the cluster; {at_once} on an embedded cluster on this machine ({cpus} CPUs"
                  + (f", {gpus} GPUs" if plan.trial_gpus else "") + ")")
    return {"search": sw.search, "trials": trials, "trials_upper_bound": sw.search == "goodput",
            "points": len(plan.points), "at_once": min(at_once, trials), "at_once_from": source,
            "trial_cpus": plan.trial_cpus, "trial_gpus": plan.trial_gpus}


def lines(summary: dict, sweep: dict | None = None) -> list[str]:
    """The summary as the lines `check` prints (YAML comments, so that its output stays a YAML file)."""
    s = summary
    workers = f"{s['workers'][0]} to {s['workers'][1]} (elastic)" if isinstance(s["workers"], list) else s["workers"]
    out = [f"workers: {workers} on {s['device']} ({s['backend']}); layout: {s['layout']['text']}",
           f"rows: global batch {s['global_batch_size']}, {s['rows_per_replica']} per replica and step, "
           f"{s['rows_per_microbatch']} per micro-batch" + (f" ({s['gradient_accumulation_steps']} accumulated)"
                                                           if s["gradient_accumulation_steps"] > 1 else "")]
    a = s.get("adaptive_batch")
    if a:
        out.append(f"adaptive batch: from {s['global_batch_size']}, within [{a['min']}, {a['max']}], chosen every "
                   f"{a['every_evals']} evaluation(s); lr scaled by {a['lr_scaling']}; steps below are of the "
                   "starting batch (progress)")
    if s["steps"] is None:
        out.append("steps: depend on the size of the data set, which is not prepared yet "
                   "(`raytrain-par data FILE` prepares it)")
    else:
        epochs = f", {s['epochs']:.2f} epochs of {s['steps_per_epoch']} steps" if s["epochs"] is not None else ""
        out.append(f"steps: {s['steps']}{epochs}")
    if s["evaluations"] is not None:
        kept = f", the last {s['keep_checkpoints']} kept" if s["checkpoints"] else ""
        out.append(f"evaluations: {s['evaluations']}; checkpoints: {s['checkpoints']}{kept}")
    if sweep:
        many = "at most " if sweep["search"] == "goodput" else ""
        out.append(f"sweep ({sweep['search']}): {many}{sweep['trials']} trial(s), {sweep['at_once']} at once "
                   f"({sweep['at_once_from']})")
    return ["# " + line for line in out]
