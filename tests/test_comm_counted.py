"""The collectives of one training step, counted as the process groups run them (metrics/comm.py, a torch
dispatch mode on the c10d ops) against those predicted from the layout, at 2 and 4 gloo ranks."""

import itertools

import pytest
import torch

from engines import KJV, experiment
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics.comm import CountCollectives, predicted_step, totals

STRATEGIES = ["ddp", "fsdp"]


def _count(rank, world, info_dict):
    from raytrain_par import config, models, strategies
    from raytrain_par.data.loader import MemoryLoader
    from raytrain_par.data.shards import DatasetInfo, read_split
    from raytrain_par.strategies import DistContext
    from raytrain_par.strategies.fsdp import shard_units

    info = DatasetInfo.from_json(info_dict)
    out = {}
    for name in STRATEGIES:
        spec = config.from_dict(experiment("gpt2-tiny", KJV, strategy=name, workers=world, batch=8, steps=4))
        model, task = models.build(spec.model, info, 0)
        plain, _ = models.build(spec.model, info, 0)  # the shapes before the engine wraps or shards them
        engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")),
                                         4)
        loader = MemoryLoader(read_split(info, info.train_path), 8, engine.dp_rank, engine.dp_size, 0)
        batches = list(itertools.islice(loader.epoch(0), 3))
        for batch in batches[:2]:  # DDP rebuilds its buckets, and says so to every rank, in its second step
            engine.train_step(batch)
        with CountCollectives() as counted:
            engine.train_step(batches[2])
        predicted = predicted_step(engine.layout, plain, shard_units(plain) if name == "fsdp" else None, 4, world,
                                   engine.measures_noise)
        out[name] = (totals(counted.collectives), totals(predicted), len(counted.collectives))
    return out


@pytest.fixture(scope="module", params=[2, 4])
def counted(request, info):
    return request.param, run_ranks(request.param, _count, info(**KJV))


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_bytes_a_step_moves_are_the_predicted_ones(counted, name):
    world, ranks = counted
    for rank, out in enumerate(ranks):
        seen, predicted, ops = out[name]
        assert seen == predicted, (world, rank)
        assert ops >= len(predicted)  # (buckets may cut one all-reduce into several)
    if name == "ddp":  # every gradient once, and the noise scale's four scalars
        assert set(seen) == {("all_reduce", world)}
    else:
        assert {op for op, _ in seen} == {"all_gather", "reduce_scatter", "all_reduce"}
