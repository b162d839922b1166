"""Evaluation over a validation split whose rows do not divide by the data-parallel size: the sharded
engines (whose forward pass gathers parameters from every rank) still finish, and every engine's
metrics equal one process's over the same rows."""

import pytest
import torch

from engines import experiment
from raytrain_par import config, models, strategies
from raytrain_par.data.loader import eval_batches
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.local_group import run_ranks
from raytrain_par.strategies import DistContext

ROWS, BATCH, WORLD = 13, 4, 3  # ranks of 5, 4 and 4 rows: 2, 1 and 1 batches
LAYOUT_ROWS = 9  # two data-parallel replicas on 4 ranks: 5 and 4 rows, 2 and 1 batches
DATA = {"name": "kjv", "seq_len": 32, "vocab_size": 512}


def _evaluate(rank, world, cases, rows=ROWS):
    out = []
    for spec_dict, info_dict in cases:
        spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
        model, task = models.build(spec.model, info, spec.train.seed)
        engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")),
                                         total_steps=1)
        arrays = read_split(info, info.val_path)
        out.append(engine.evaluate(eval_batches(arrays, BATCH, engine.dp_rank, engine.dp_size, rows)))
    return out


@pytest.mark.timeout(240)  # without the padding passes, the sharded engines wait for each other for good
def test_uneven_validation_rows_evaluate_as_one_process(info):
    info_dict = info("kjv", seq_len=32, vocab_size=512)
    names = ["ddp", "fsdp", "zero-3"]
    one = _one_process(info_dict, ROWS)
    results = run_ranks(WORLD, _evaluate, [(experiment("gpt2-tiny", DATA, strategy=s, workers=WORLD, batch=12), info_dict)
                                           for s in names])
    for name, metrics in zip(names, results[0]):
        assert metrics["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), name
        assert metrics["val_accuracy"] == pytest.approx(one["val_accuracy"]), name


LAYOUTS = {
    "pipeline x fsdp": {"name": "pipeline", "stages": 2, "microbatches": 2, "data_parallel_sharding": "fsdp"},
    "pipeline x data": {"name": "pipeline", "stages": 2, "microbatches": 2},
    "fsdp x tensor": {"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "fsdp"},
}


@pytest.mark.timeout(240)
def test_uneven_validation_rows_under_the_composed_layouts(info):
    """Two data-parallel replicas of a pipeline or of tensor-parallel groups, one with a validation batch
    more than the other: every rank of the layout finishes, with one process's metrics."""
    info_dict = info("kjv", seq_len=32, vocab_size=512)
    one = _one_process(info_dict, LAYOUT_ROWS)
    results = run_ranks(4, _evaluate, [(experiment("gpt2-tiny", DATA, strategy=s, workers=4, batch=12), info_dict)
                                       for s in LAYOUTS.values()], LAYOUT_ROWS, timeout=120)
    for rank in results:
        for name, metrics in zip(LAYOUTS, rank):
            assert metrics["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5), name
            assert metrics["val_accuracy"] == pytest.approx(one["val_accuracy"]), name


def _one_process(info_dict, rows):
    spec = experiment("gpt2-tiny", DATA, strategy="ddp", batch=12)
    return run_ranks(1, _evaluate, [(spec, info_dict)], rows, group_of_one=True)[0][0]
