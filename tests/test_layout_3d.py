"""The parallel layout (strategies/layout.py) and megatron's tensor x pipeline x data layout against one
process, in gloo groups."""

import functools
import shutil
from pathlib import Path

import pytest
import torch

import engines
from engines import KJV, experiment, exported_val_loss, loop, train_steps
from raytrain_par import config, estimate
from raytrain_par.data.shards import DatasetInfo
from raytrain_par.errors import ConfigError
from raytrain_par.local_group import run_ranks
from raytrain_par.strategies.layout import Layout

STEPS = 3
# accumulation, clipping (one norm over every dimension), decay and a schedule
CLIP = {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1, "warmup_steps": 1,
        "lr_schedule": "cosine"}


PIPELINE_FSDP = {"name": "pipeline", "stages": 2, "microbatches": 2, "data_parallel_sharding": "fsdp"}


def three_d(stages=2, tensor=2, **more):
    return {"name": "megatron", "tensor_parallel": tensor, "stages": stages, "microbatches": 2, **more}


# -- the layout ------------------------------------------------------------------------------------

def test_rank_order_keeps_tensor_groups_adjacent():
    layout = Layout(pipeline=2, tensor=2, data=2)
    coords = [layout.coordinates(r) for r in range(8)]
    assert [layout.rank_of(*c) for c in coords] == list(range(8))
    assert [(c.pipeline, c.data, c.tensor) for c in coords[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert layout.readers(1) == [2, 3, 6, 7]  # both stages and both tensor ranks of replica 1


@pytest.mark.parametrize("strategy,workers,want", [
    ("ddp", 4, Layout(1, 1, 4)),
    ("zero-2", 4, Layout(1, 1, 4, "zero-2")),
    ({"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "fsdp"}, 4, Layout(1, 2, 2, "fsdp")),
    (three_d(), 8, Layout(2, 2, 2, schedule="1f1b", microbatches=2)),
    ({"name": "pipeline", "stages": 2, "microbatches": 2}, 4, Layout(2, 1, 2, schedule="1f1b", microbatches=2)),
    ({"name": "pipeline", "stages": 2, "microbatches": 2, "data_parallel_sharding": "fsdp"}, 4,
     Layout(2, 1, 2, "fsdp", "1f1b", 2)),
    ({"name": "pipeline", "stages": 2, "schedule": "interleaved-1f1b"}, 2,
     Layout(2, 1, 1, schedule="interleaved-1f1b", microbatches=8, virtual_stages=2)),
    ({"name": "pipedream", "stages": 2}, 4, Layout(2, 1, 2, schedule="pipedream", microbatches=1)),
])
def test_every_strategy_states_its_layout(strategy, workers, want):
    spec = config.parse(experiment(strategy=strategy, workers=workers, batch=16))
    assert spec.layout == want
    assert spec.per_worker_batch == 16 // want.data


def _groups(rank, world):
    """What this rank's placement holds, as rank lists (gloo groups cannot cross processes)."""
    import torch.distributed as dist

    from raytrain_par.strategies.layout import place

    ranks = lambda g: None if g is None else dist.get_process_group_ranks(g)  # noqa: E731
    data_only = place(Layout(1, 1, world, "zero-3"), rank, world, "cpu")
    grid = place(Layout(2, 2, 1, schedule="1f1b", microbatches=2), rank, world, "cpu")
    again = place(Layout(2, 2, 1, "none", "gpipe", 4), rank, world, "cpu")
    tie = grid.group_along("pp", [0, 1], tag="tie")
    return {"data_only": (ranks(data_only.dp_group), data_only.mesh_of("dp").size(), data_only.pp_group,
                          data_only.tp_group),
            "grid": [ranks(grid.pp_group), ranks(grid.dp_group), ranks(grid.tp_group)],
            "same_groups": again.pp_group is grid.pp_group and again.mesh is grid.mesh,
            "tie": ranks(tie), "tie_again": grid.group_along("pp", [0, 1], tag="tie") is tie,
            "loss": ranks(grid.group_along("pp", tag="loss")), "loss_is_pp": grid.group_along("pp", tag="loss")
            is grid.pp_group, "fsdp_mesh": ranks(grid.mesh_of("tp").get_group())}


def test_the_placement_owns_every_group():
    """One mesh per layout's degrees, built once per process: data parallel only, one dimension over
    every worker; otherwise (pp, dp, tp) groups, and groups of their own along a
    dimension (a tied weight's stages, a pipeline's loss) made for every rank alike."""
    out = run_ranks(4, _groups)
    for rank, got in enumerate(out):
        assert got["data_only"] == ([0, 1, 2, 3], 4, None, None)
        p, t = divmod(rank, 2)  # rank = p * T + t with D = 1
        assert got["grid"] == [[t, 2 + t], [rank], [2 * p, 2 * p + 1]]
        assert got["same_groups"] and got["tie_again"]
        assert got["tie"] == got["loss"] == [t, 2 + t] and not got["loss_is_pp"]
        assert got["fsdp_mesh"] == [2 * p, 2 * p + 1]


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,workers,field,words", [
    (three_d(), 6, "scaling.num_workers", "tensor_parallel x stages = 2 x 2"),
    (three_d(stages=5), 10, "strategy.stages", "has 4 layers"),
    (three_d(microbatches=3), 8, "strategy.microbatches", "does not divide the 8 rows"),
    (three_d(data_parallel_sharding="hsdp"), 8, "strategy.data_parallel_sharding", "supported layouts"),
    ({"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "zero-1"}, 4,
     "strategy.data_parallel_sharding", "ZeRO is a strategy of its own"),
    ({"name": "megatron", "tensor_parallel": 2, "microbatches": 4}, 2, "strategy.stages", "arrange pipeline stages"),
    ({"name": "pipeline", "stages": 2, "microbatches": 2, "data_parallel_sharding": "zero-3"}, 4,
     "strategy.data_parallel_sharding", "ZeRO is a strategy of its own"),
    (three_d(stages=0), 2, "strategy.stages", "must be >= 1"),
])
def test_bad_layouts_are_rejected_before_start(strategy, workers, field, words):
    with pytest.raises(ConfigError) as e:
        config.parse(experiment(data=KJV, strategy=strategy, workers=workers, batch=16))
    assert e.value.field == field and words in e.value.problem and e.value.fix


# -- tensor x pipeline x data against one process ----------------------------------------------------

def _run(rank, world, cases):
    return [train_steps(rank, world, *case) for case in cases]


@pytest.fixture(scope="module")
def kjv(info):
    return info(**KJV)


@pytest.fixture(scope="module")
def reference(kjv):
    (out,) = run_ranks(1, _run, [(experiment(data=KJV, workers=1, steps=STEPS, **CLIP), kjv, STEPS)])
    return out[0]


def _check(ranks, ref):
    assert ref["losses"][-1] < ref["losses"][0]
    for r in ranks:
        assert r[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    state = ranks[0][0]["state"]
    assert list(state) == list(ref["state"])  # transformers' names, in order
    for name, want in ref["state"].items():
        torch.testing.assert_close(state[name], want, atol=1e-4, rtol=1e-4, msg=name)


def test_tensor_by_pipeline_matches_one_process(kjv, reference):
    """T2 x P2 on 4 ranks (1F1B, 2 microbatches), with accumulation and clipping; in bf16 (autocast in
    each stage over fp32 weights) within bf16's rounding of the fp32 run."""
    spec = experiment(data=KJV, strategy=three_d(), workers=4, steps=STEPS, **CLIP)
    bf16 = experiment(data=KJV, strategy=three_d(), workers=4, steps=STEPS, precision="bf16", **CLIP)
    ranks = run_ranks(4, _run, [(spec, kjv, STEPS), (bf16, kjv, STEPS)])
    _check(ranks, reference)
    memory = ranks[0][0]["memory"]
    assert len(memory["stage_param_bytes"]) == 2  # per pipeline rank, as strategy pipeline records
    fp32, half = ranks[0][0]["losses"], ranks[0][1]["losses"]
    assert half == pytest.approx(fp32, rel=3e-2) and half != fp32


def test_tensor_by_pipeline_by_data_matches_one_process(kjv, reference, tmp_path):
    """Megatron-LM's 3D, T2 x P2 x D2 on 8 ranks, with the replicas holding whole shards (none) and with
    each stage's shard split over its 2 replicas by FSDP2 (fsdp), with accumulation and clipping: the
    losses and the gathered model of one process; under fsdp each rank holds half its stage's shard."""
    spec = experiment(data=KJV, strategy=three_d(), workers=8, steps=STEPS, **CLIP)
    sharded = experiment(data=KJV, strategy=three_d(data_parallel_sharding="fsdp"), workers=8, steps=STEPS, **CLIP)
    ranks = run_ranks(8, _run_and_resume, [(spec, kjv, STEPS), (sharded, kjv, STEPS)], sharded, kjv,
                      str(tmp_path))
    _check([r[0][:1] for r in ranks], reference)
    _check([r[0][1:] for r in ranks], reference)
    whole, half = ranks[0][0][0]["memory"]["mem_param_bytes"], ranks[0][0][1]["memory"]["mem_param_bytes"]
    assert half == pytest.approx(whole / 2, rel=0.02)
    info = DatasetInfo.from_json(kjv)
    for i, case in enumerate((spec, sharded)):  # each rank's model states as `raytrain-par estimate` predicts them
        layout, predicted = config.from_dict(case).layout, estimate.pipeline_ranks(config.from_dict(case), info)
        for rank, (cases, _) in enumerate(ranks):
            want = predicted[layout.coordinates(rank).pipeline].states.expected
            assert cases[i]["memory"]["mem_model_state_census_bytes"] == pytest.approx(want, rel=0.15), (i, rank)
    straight, resumed = ranks[0][1]
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    for was, now in zip(straight[2:], resumed):
        assert (now["train_loss"], now["val_loss"]) == pytest.approx((was["train_loss"], was["val_loss"]), rel=1e-6)


def _run_and_resume(rank, world, cases, spec, info, tmp):
    """The cases, then `spec` through the worker's loop for 4 steps with a checkpoint every 2 (gathered
    from the replicas' slices), and again from its step-2 checkpoint (sliced again on load)."""
    spec = {**spec, "train": {**spec["train"], "max_steps": 4, "eval_every_steps": 1, "checkpoint_every_evals": 2,
                              "eval_at_start": False}, "data": {**spec["data"], "max_val_samples": 16}}
    straight = loop(spec, info, Path(tmp) / "straight")
    torch.distributed.barrier()
    if rank == 0:
        shutil.copytree(Path(tmp) / "straight", Path(tmp) / "resumed")
        shutil.rmtree(sorted((Path(tmp) / "resumed").glob("checkpoint_*"))[-1])
    torch.distributed.barrier()
    resumed = loop(spec, info, Path(tmp) / "resumed", resume=True)
    return _run(rank, world, cases), (straight, resumed)


def test_pipeline_by_sharded_data_matches_one_process(kjv, reference):
    """P2 x D2 with each stage sharded over its replicas by FSDP2, with accumulation and clipping."""
    spec = experiment(data=KJV, strategy=PIPELINE_FSDP, workers=4, steps=STEPS, **CLIP)
    _check(run_ranks(4, _run, [(spec, kjv, STEPS)]), reference)


# -- through Ray Train -------------------------------------------------------------------------------

#: the 4-worker layouts, each trained through the worker's loop in one group of Ray Train workers:
#: (strategy, (pipeline, tensor, data) its records state)
THROUGH_RAY = {
    "tensor-by-pipeline": (three_d(), (2, 2, 1)),
    "pipeline-by-sharded-data": (PIPELINE_FSDP, (2, 1, 2)),
    "sharded-by-tensor": ({"name": "megatron", "tensor_parallel": 2, "data_parallel_sharding": "fsdp"}, (1, 2, 2)),
}
#: a checkpoint of every layout: the one format (strategies/state.py), every rank's pieces by name
FORMAT_FILES = {"index.json", *(f"pieces-rank{r}.{kind}" for r in range(4) for kind in ("json", "safetensors"))}


@pytest.mark.ray
def test_the_four_worker_layouts_through_ray_train(ray_cluster, kjv, reference, tmp_path):
    """T2 x P2, P2 x D2 with each stage sharded over its 2 replicas by FSDP2, and FSDP x T2, on 4 Ray
    Train workers, each through the worker's training loop in turn in one run (a run's start-up costs
    ~30 s on 2 cores; what a run adds around the loop, Ray Data and Ray's checkpoints, is the same for
    every strategy and is run by every other test of `raytrain-par run`): the per-step losses of one
    process, evaluation on split logits, a checkpoint of every rank's own pieces by name (nothing
    gathered), and `raytrain-par export` making a plain GPT-2 of it that scores the run's validation
    loss."""
    cases = {}
    for name, (strategy, _) in THROUGH_RAY.items():
        case = experiment(data={**KJV, "max_val_samples": 16}, strategy=strategy, workers=4, steps=STEPS,
                          eval_every_steps=1, **CLIP)
        cases[name] = {**case, "scaling": {**case["scaling"], "cpus_per_worker": 0.5}}
    trained = engines.in_ray_workers(functools.partial(engines.loop_records, root=str(tmp_path)), cases, kjv, tmp_path)
    for name, (strategy, layout) in THROUGH_RAY.items():
        records = trained[name]
        assert [r["train_loss"] for r in records if r["step"] > 0] == pytest.approx(reference["losses"], rel=1e-5,
                                                                                    abs=1e-6), name
        last = records[-1]
        assert (last["pipeline_parallel"], last["tensor_parallel"], last["data_parallel"]) == layout, name
        checkpoint = sorted((tmp_path / name).glob("checkpoint_*/"))[-1]
        assert {p.name for p in checkpoint.iterdir()} >= FORMAT_FILES, name
        assert exported_val_loss(tmp_path / name, kjv, 16) == pytest.approx(last["val_loss"], abs=1e-5), name
