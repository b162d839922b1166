"""Helpers that train an engine for a few steps on one rank of a process group (see dist.py) and
return what parity tests compare: the global loss of every step and the final model."""

from __future__ import annotations

import torch

from raytrain_par import config, models, strategies
from raytrain_par.data.loader import MemoryLoader
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.strategies import DistContext


def experiment(model="gpt2-tiny", data="kjv", strategy="ddp", workers=1, batch=16, steps=4, **train) -> dict:
    spec = {"name": "parity", "model": model if isinstance(model, dict) else {"name": model},
            "data": data if isinstance(data, dict) else {"name": data},
            "strategy": strategy if isinstance(strategy, dict) else {"name": strategy},
            "scaling": {"num_workers": workers},
            "train": {"global_batch_size": batch, "max_steps": steps, "lr": 1e-3, **train}}
    return config.parse(spec).to_dict()


def train_steps(rank: int, world: int, spec_dict: dict, info_dict: dict, steps: int, distributed: bool = True) -> dict:
    """Train `steps` optimizer steps; returns {'losses': [global loss per step], 'state': full state dict,
    'memory': engine.memory()}. Not `distributed`: one process, outside the group this rank is in."""
    spec = config.from_dict(spec_dict)
    info = DatasetInfo.from_json(info_dict)
    arrays = read_split(info, info.train_path)  # before the engine, as in the worker loop: not model state
    model, task = models.build(spec.model, info, spec.train.seed)
    ctx = DistContext.current(torch.device("cpu")) if distributed else DistContext()
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, ctx, total_steps=steps)
    del model  # as the worker loop does: what an engine does not keep is freed
    loader = MemoryLoader(arrays, spec.train.global_batch_size, engine.dp_rank, engine.dp_size, spec.train.seed)
    losses = []
    for i, batch in zip(range(steps), loader.epoch(0)):
        local = engine.train_step(batch)
        losses.append(float(engine.dp_sum(local.clone())) / engine.dp_size)
    state = {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}
    return {"losses": losses, "state": state if rank == 0 else None, "memory": engine.memory()}


def train_cases(rank: int, world: int, cases: list[tuple[dict, dict, int]]) -> list[dict]:
    """train_steps for several (spec, info, steps) cases in one process group: spawning costs
    seconds, a case of a tiny model a fraction of that."""
    return [train_steps(rank, world, *case) for case in cases]


def loop(spec_dict, info_dict, root, resume=False) -> list[dict]:
    """The worker's training loop (LocalReporter: checkpoints under root), as Ray Train runs it;
    returns its records."""
    from raytrain_par.config import from_dict
    from raytrain_par.worker import LocalReporter, Trainer, memory_train_loader

    spec, info = from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    ctx = DistContext.current(torch.device("cpu"))
    reporter = LocalReporter(root, ctx.rank, ctx.world_size, resume=resume, log=lambda *_: None)
    trainer = Trainer(spec, info, ctx, reporter, memory_train_loader(spec, read_split(info, info.train_path)),
                      read_split(info, info.val_path), log=lambda *_: None)
    return trainer.run()


def exported_val_loss(run_dir, info_dict: dict, rows: int, model_spec=None) -> float:
    """`raytrain-par export` a language-model run; load the result with transformers'
    AutoModelForCausalLM (every key present) and score the first `rows` validation rows, as the run's
    evaluation does."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from raytrain_par.cli import main

    out = Path(run_dir).parent / f"{Path(run_dir).name}-exported"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    model, loading = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    data_info = DatasetInfo.from_json(info_dict)
    task = models.build(model_spec or config.ModelSpec.of("gpt2-tiny"), data_info, 0)[1]
    val = read_split(data_info, data_info.val_path)
    batch = {k: v[:rows] for k, v in val.items()}
    with torch.no_grad():
        sums = task.eval_sums(model.eval(), task.prepare(batch, torch.device("cpu")))
    return float(sums[0] / sums[1])


def in_ray_workers(loop_fn, spec, info_dict: dict, tmp_path, **loop_config) -> None:
    """One Ray Train run of `spec`'s workers, backend and resources, on the session's cluster, each
    worker running `loop_fn` (a loop of this module) with `loop_config` and `config["data"]`, without
    Ray datasets. (Ray's workers do not have tests/ on their path: this module goes to them pickled by
    value.)"""
    import sys

    from ray import cloudpickle
    from ray.train import DataConfig

    from raytrain_par.driver import make_trainer

    here = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(here)
    try:
        make_trainer(spec, DatasetInfo.from_json(info_dict), tmp_path, name="in-ray-workers", loop=loop_fn,
                     loop_config=loop_config, datasets=({}, DataConfig(datasets_to_split=[]))).fit()
    finally:
        cloudpickle.unregister_pickle_by_value(here)


def loops_in_ray(config: dict) -> None:
    """Ray Train loop: the worker's training loop (`loop`: evaluation, checkpoints under
    `config["root"]`/NAME) for each of `config["cases"]` (name -> experiment dict) in turn, in this one
    worker group; rank 0 writes the records per case as JSON to `config["out"]`."""
    import json
    from pathlib import Path

    torch.set_num_threads(1)
    records = {name: loop(spec, config["data"], Path(config["root"]) / name) for name, spec in config["cases"].items()}
    if torch.distributed.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(records, f, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def train_steps_in_ray(config: dict) -> None:
    """Ray Train loop: each of `config["cases"]` (name -> experiment dict) trains `config["steps"]`
    steps in this worker group, as train_steps does in a plain one; rank 0 writes the losses per case
    as JSON to `config["out"]` (a path on this machine)."""
    import json

    import ray.train

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    losses = {name: train_steps(rank, world, spec, config["data"], config["steps"])["losses"]
              for name, spec in config["cases"].items()}
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(losses, f)
