"""The collectives of one training step, counted as the process groups run them (metrics/comm.py, a torch
dispatch mode on the c10d ops) against those predicted from the layout, on every rank, at 2 and 4 gloo
ranks."""

import itertools

import pytest
import torch

from engines import KJV, experiment
from raytrain_par.local_group import run_ranks
from raytrain_par.estimate import collective_step
from raytrain_par.metrics.comm import CountCollectives, predicted_step, totals

PIPELINE = {"name": "pipeline", "stages": 2, "microbatches": 2}
#: name -> (strategy, the worker counts it runs at)
CASES = {
    "ddp": ("ddp", (2, 4)),
    "fsdp": ("fsdp", (2, 4)),
    "pipeline P2": (PIPELINE, (2, 4)),  # at 4: P2 x D2
    "pipeline P2 gpipe, clipped": ({**PIPELINE, "schedule": "gpipe"}, (2,)),
    "pipeline P2 interleaved": ({**PIPELINE, "schedule": "interleaved-1f1b"}, (2,)),
    "pipeline P2 x fsdp": ({**PIPELINE, "data_parallel_sharding": "fsdp"}, (4,)),
    "pipeline P2 x fsdp, 2 accumulation steps": ({**PIPELINE, "data_parallel_sharding": "fsdp"}, (4,)),
    "megatron T2, 2 accumulation steps": ({"name": "megatron", "tensor_parallel": 2}, (4,)),
    "zero-1": ("zero-1", (2, 4)),
    "zero-2": ("zero-2", (2, 4)),
    "zero-3": ("zero-3", (2, 4)),
    "zero-1, 2 accumulation steps": ("zero-1", (2,)),
    "zero-2, 2 accumulation steps": ("zero-2", (2,)),
    "zero-3, 2 accumulation steps": ("zero-3", (2,)),
    "megatron T2": ({"name": "megatron", "tensor_parallel": 2}, (2, 4)),  # at 4: T2 x D2
    "megatron T2 x fsdp": ({"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "fsdp"}, (4,)),
    "megatron T2 x P2": ({"name": "megatron", "tensor_parallel": 2, "stages": 2, "microbatches": 2}, (4,)),
    # asynchronous: the tied embedding's halves sent to the first stage, the sum sent back, in steady state
    "pipedream P2": ({"name": "pipedream", "stages": 2, "microbatches": 2}, (2, 4)),  # at 4: P2 x D2
    "pipedream-2bw P2": ({"name": "pipedream", "stages": 2, "weight_versions": 2}, (2,)),
    # under bf16: row-parallel outputs, FSDP's gathered parameters and DeepSpeed's states in 16 bits
    **{f"{name}, bf16": (strategy, (2,)) for name, strategy in [
        ("ddp", "ddp"), ("fsdp", "fsdp"), ("zero-1", "zero-1"), ("zero-2", "zero-2"), ("zero-3", "zero-3"),
        ("megatron T2", {"name": "megatron", "tensor_parallel": 2}), ("pipeline P2", PIPELINE),
        ("pipedream P2", {"name": "pipedream", "stages": 2, "microbatches": 2})]},
    "megatron T2 x fsdp, bf16": ({"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "fsdp"}, (4,)),
    "pipeline P2 x fsdp, bf16": ({**PIPELINE, "data_parallel_sharding": "fsdp"}, (4,)),
}


def _count(rank, world, info_dict):
    from raytrain_par import config, models, strategies
    from raytrain_par.data.loader import MemoryLoader
    from raytrain_par.data.shards import DatasetInfo, read_split
    from raytrain_par.strategies import DistContext

    info = DatasetInfo.from_json(info_dict)
    out = {}
    for name, (strategy, worlds) in CASES.items():
        if world not in worlds:
            continue
        clip = 1.0 if "clipped" in name else 0.0
        accumulation = 2 if "accumulation" in name else 1
        spec = config.from_dict(experiment("gpt2-tiny", KJV, strategy=strategy, workers=world, batch=8, steps=4,
                                           grad_clip=clip, gradient_accumulation_steps=accumulation,
                                           precision="bf16" if "bf16" in name else "fp32"))
        model, task = models.build(spec.model, info, 0)
        plain, _ = models.build(spec.model, info, 0)  # the shapes before the engine wraps, splits or shards them
        ctx = DistContext.current(torch.device("cpu"))
        engine = strategies.build_engine(spec.strategy, model, task, spec.train, ctx, 4)
        loader = MemoryLoader(read_split(info, info.train_path), 8, engine.dp_rank, engine.dp_size, 0)
        batches = list(itertools.islice(loader.epoch(0), 4))
        for batch in batches[:2]:  # DDP rebuilds its buckets, and says so to every rank, in its second step
            engine.train_step(batch)
        with CountCollectives() as counted:
            engine.train_step(batches[2])
        if engine.layout.asynchronous:  # its last step drains the sends still in flight, before the next case
            engine.train_step(batches[3])
        step = collective_step(spec)
        assert step.measures_noise == engine.measures_noise
        zero = getattr(engine, "deepspeed_config", {}).get("zero_optimization")
        predicted = predicted_step(engine.layout, plain, step, rank, zero=zero)
        out[name] = (totals(counted.collectives), totals(predicted), len(counted.collectives))
    return out


@pytest.fixture(scope="module")
def counted(info):
    """The counts of every case at a worker count, each count's group spawned once."""
    cache = {}

    def at(world):
        if world not in cache:
            cache[world] = run_ranks(world, _count, info(**KJV))
        return cache[world]

    return at


@pytest.mark.parametrize("world, name", sorted((w, n) for n, (_, worlds) in CASES.items() for w in worlds))
def test_the_bytes_a_step_moves_are_the_predicted_ones(counted, world, name):
    ranks = counted(world)
    for rank, out in enumerate(ranks):
        seen, predicted, ops = out[name]
        assert seen == predicted, (world, rank)
        assert ops >= len(predicted)  # (buckets may cut one all-reduce into several)
    seen = set().union(*(out[name][0] for out in ranks))
    kinds = {op for op, _ in seen}
    if name == "ddp":  # every gradient once, and the noise scale's four scalars
        assert seen == {("all_reduce", world)}
    elif name.startswith("pipeline"):
        assert {"send", "recv", "broadcast"} <= kinds
    elif name.startswith("pipedream"):  # no flush: the tied embedding's sum too is a send and a receive
        assert {"send", "recv", "broadcast"} <= kinds and (world > 2 or "all_reduce" not in kinds)
    elif name.startswith("megatron"):
        assert ("all_reduce", 2) in seen  # the activations over the tensor-parallel pair
