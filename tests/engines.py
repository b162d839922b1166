"""Helpers that train an engine for a few steps on one rank of a process group (see dist.py) and
return what parity tests compare: the global loss of every step and the final model."""

from __future__ import annotations

import functools

import torch

from raytrain_par import config, models, strategies
from raytrain_par.data.loader import MemoryLoader, StreamLoader
from raytrain_par.data.shards import DatasetInfo, decode, read_split
from raytrain_par.strategies import DistContext

#: The Bible on short rows of a small vocabulary: cheap steps through every piece of a GPT-2 (embeddings
#: tied to the LM head, blocks, causal attention), for tests whose property does not depend on its size.
KJV = {"name": "kjv", "seq_len": 32, "vocab_size": 512}


def experiment(model="gpt2-tiny", data="kjv", strategy="ddp", workers=1, batch=16, steps=4, **train) -> dict:
    spec = {"name": "parity", "model": model if isinstance(model, dict) else {"name": model},
            "data": data if isinstance(data, dict) else {"name": data},
            "strategy": strategy if isinstance(strategy, dict) else {"name": strategy},
            "scaling": {"num_workers": workers},
            "train": {"global_batch_size": batch, "max_steps": steps, "lr": 1e-3, **train}}
    return config.parse(spec).to_dict()


def train_steps(rank: int, world: int, spec_dict: dict, info_dict: dict, steps: int, distributed: bool = True) -> dict:
    """Train `steps` optimizer steps (with the experiment's loader); returns {'losses': [global loss per step], 'state': full state dict,
    'memory': engine.memory()}. Not `distributed`: one process, outside the group this rank is in."""
    spec = config.from_dict(spec_dict)
    info = DatasetInfo.from_json(info_dict)
    streamed = spec.data.effective_loader == "stream"
    # before the engine, as in the worker loop: not model state
    arrays = None if streamed else read_split(info, info.train_path)
    ctx = DistContext.current(torch.device("cpu")) if distributed else DistContext()
    engine, _ = strategies.start_engine(spec, info, ctx, total_steps=steps)  # as the worker loop does
    if streamed:
        loader = StreamLoader(info.train_path, functools.partial(decode, info), spec.train.global_batch_size,
                              engine.dp_rank, engine.dp_size, spec.train.seed)
    else:
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


def in_ray_workers(each, cases: dict, info_dict: dict, tmp_path) -> dict:
    """`each(rank, world, spec_dict, info_dict, name)` for each of `cases` (name -> experiment dict) in
    turn, in one Ray Train run of the first case's workers, backend and resources on the session's
    cluster, without Ray datasets; returns what rank 0's calls returned, by case name (JSON, through a
    file on this machine). (Ray's workers do not have tests/ on their path: this module goes to them
    pickled by value, and `each` is a function of it.)"""
    import json
    import sys
    from pathlib import Path

    from ray import cloudpickle
    from ray.train import DataConfig

    from raytrain_par.driver import make_trainer

    out = Path(tmp_path) / "in-ray-workers.json"
    here = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(here)
    try:
        make_trainer(config.from_dict(next(iter(cases.values()))), DatasetInfo.from_json(info_dict), tmp_path,
                     name="in-ray-workers", loop=_cases_in_ray,
                     loop_config={"each": each, "cases": cases, "out": str(out)},
                     datasets=({}, DataConfig(datasets_to_split=[]))).fit()
    finally:
        cloudpickle.unregister_pickle_by_value(here)
    return json.loads(out.read_text())


def _cases_in_ray(config: dict) -> None:
    """Ray Train loop of in_ray_workers."""
    import json

    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {name: config["each"](rank, world, spec, config["data"], name) for name, spec in config["cases"].items()}
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(results, f, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def step_losses(rank: int, world: int, spec_dict: dict, info_dict: dict, name: str, steps: int) -> list[float]:
    """in_ray_workers' `each`: train_steps' global loss per step."""
    return train_steps(rank, world, spec_dict, info_dict, steps)["losses"]


def loop_records(rank: int, world: int, spec_dict: dict, info_dict: dict, name: str, root: str) -> list[dict]:
    """in_ray_workers' `each`: the worker's training loop (evaluation, checkpoints under root/NAME); its records."""
    from pathlib import Path

    return loop(spec_dict, info_dict, Path(root) / name)


def written_checkpoint(run_dir, spec_dict: dict):
    """A checkpoint of `spec_dict` in `run_dir` with no tensors (for the checks made before a resume starts):
    its loop state, the one format's index and one rank's empty pieces, a manifest; returns run_dir."""
    import json
    from pathlib import Path

    from raytrain_par import checkpoints
    from raytrain_par.strategies import state

    ckpt = Path(run_dir) / "checkpoint_2026-01-01_00-00-00"
    ckpt.mkdir(parents=True)
    (ckpt / "loop.json").write_text(json.dumps({"experiment": spec_dict}))
    state.write_parts(ckpt, state.Parts([], {}, {}, {"optimizer": "AdamW", "scheduler": {}}), 2, rank=0)
    checkpoints.write_manifest(ckpt, 0, 1, 2)
    return Path(run_dir)
