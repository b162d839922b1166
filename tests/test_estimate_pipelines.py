"""`raytrain-par estimate` for the pipeline engines (pipeline, pipedream, megatron with stages, pipeline
with FSDP-sharded stages): each pipeline rank's model states and saved activations against what the
engines measure, in gloo groups."""

import pytest

import torch

from engines import KJV, experiment
from raytrain_par import models, strategies
from raytrain_par.data.loader import MemoryLoader
from raytrain_par.data.shards import read_split
from raytrain_par.strategies import DistContext
from raytrain_par import config, estimate
from raytrain_par.data.shards import DatasetInfo
from raytrain_par.local_group import run_ranks

# ~7M parameters: model states well above what the runtime itself allocates, steps of a fraction of a second
MODEL = {"name": "gpt2-mini", "n_layer": 4, "n_embd": 384, "n_head": 6}
STEPS = 2  # pipedream reaches its steady state (microbatches in flight, a stashed version) in the second


def _cases(workers: int, strategies: list[dict]) -> list[dict]:
    return [experiment(MODEL, KJV, strategy=s, workers=workers, batch=4, steps=STEPS) for s in strategies]


TWO = _cases(2, [{"name": "pipeline", "schedule": "gpipe", "microbatches": 4},
                 {"name": "pipeline", "schedule": "1f1b", "microbatches": 4},
                 {"name": "pipedream"},
                 {"name": "pipeline", "schedule": "interleaved-1f1b", "microbatches": 4},
                 {"name": "pipeline", "schedule": "zero-bubble", "microbatches": 4},
                 {"name": "pipeline", "schedule": "zbv", "microbatches": 4}])
FOUR = _cases(4, [{"name": "megatron", "tensor_parallel": 2, "stages": 2, "microbatches": 2},
                  {"name": "pipeline", "stages": 2, "microbatches": 2, "data_parallel_sharding": "fsdp"}]) + [
    # 6 blocks in 8 stages: the last holds only the final norm and the LM head, and, narrower than the
    # vocabulary, most of what it saves is the loss's, which the input half of its backward frees
    experiment({**MODEL, "n_layer": 6, "n_embd": 64, "n_head": 4}, KJV, strategy={"name": "pipeline", "stages": 4, "schedule": "zero-bubble",
                                                       "microbatches": 16}, workers=4, batch=16, steps=STEPS)]


def _second_step_memory(rank, world, cases):
    """Each engine's memory record over its second step (torch's schedules infer shapes in the first)."""
    out = []
    for spec_dict, info_dict in cases:
        spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
        arrays = read_split(info, info.train_path)
        model, task = models.build(spec.model, info, spec.train.seed)
        engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")),
                                         total_steps=STEPS)
        del model
        loader = MemoryLoader(arrays, spec.train.global_batch_size, engine.dp_rank, engine.dp_size, spec.train.seed)
        for i, batch in zip(range(STEPS), loader.epoch(0)):
            engine.train_step(batch)
            memory = engine.memory()
        out.append(memory)
        del engine
    return out


@pytest.fixture(scope="module")
def kjv(info):
    return info(**KJV)


@pytest.mark.parametrize("world, specs", [(2, TWO), (4, FOUR)], ids=["two-stages", "four-workers"])
def test_estimate_predicts_what_each_pipeline_rank_holds(kjv, world, specs):
    """Per pipeline rank, the estimate's model states (with pipedream's stashed weight versions) within
    15% of the live tensors' census plus the stash, and its activations (the microbatches the schedule keeps in flight)
    within 15% of the saved-activation tracker's peak."""
    ranks = run_ranks(world, _second_step_memory, [(spec, kjv) for spec in specs])
    info = DatasetInfo.from_json(kjv)
    for i, spec_dict in enumerate(specs):
        spec = config.from_dict(spec_dict)
        predicted = estimate.pipeline_ranks(spec, info)
        for rank, out in enumerate(ranks):
            p = spec.layout.coordinates(rank).pipeline
            measured, want = out[i], predicted[p]
            what = f"{spec.strategy.name} {spec.strategy.options} rank {rank}"
            # the tensors the engine names (parameters, gradients, optimizer state) and pipedream's stash;
            # (the allocator's count also holds the schedule's message buffers, and, for engines built one
            # after another in a process, moves with what the earlier ones freed)
            held = measured["mem_model_state_census_bytes"] + measured.get("mem_stash_bytes", 0)
            assert held == pytest.approx(want.states.expected, rel=0.15), what
            assert measured["mem_activation_bytes"] == pytest.approx(want.activations, rel=0.15), what
    if world == 2:  # the schedule decides: GPipe keeps all 4 microbatches on the first stage, 1F1B two
        gpipe, one = (estimate.pipeline_ranks(config.from_dict(s), info)[0].activations for s in specs[:2])
        assert gpipe == pytest.approx(2 * one, rel=0.01)


def test_a_split_backward_frees_the_loss_at_its_input_half():
    """On the last stage (1), a microbatch's loss goes with the input half (I) of its backward and the
    rest of the stage's activations with the weight half (W); a full backward (B) frees both."""
    from raytrain_par.strategies.pipeline import held_activations

    micro, loss = {0: 3.0, 1: 10.0}, 8.0
    split = [(1, "F"), (1, "I"), (1, "F"), (1, "I"), (1, "W"), (1, "W")]
    assert held_activations(split, micro, loss) == 12.0  # 2 + 10: one loss at a time
    assert held_activations(split, micro) == 20.0  # without the loss told apart, both microbatches whole
    assert held_activations([(0, "F"), (0, "I"), (0, "F"), (0, "W"), (0, "W")], micro, loss) == 6.0
    assert held_activations([(1, "F"), (1, "B"), (1, "F"), (1, "B")], micro, loss) == 10.0
