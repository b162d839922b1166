"""Pipeline engines (strategies pipeline and pipedream) in gloo process groups.

Each spawned function trains several engines from one model build (spawning and importing cost
seconds; training these tiny models costs less) and returns what the tests compare.
"""

import copy
import gc
import itertools

import pytest
import torch

from raytrain_par.local_group import run_ranks
from engines import KJV, experiment
from raytrain_par import config, models, strategies
from raytrain_par.data.loader import MemoryLoader, eval_batches
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.errors import ConfigError
from raytrain_par.strategies import DistContext
from raytrain_par.strategies import state as one_format
from raytrain_par.strategies.pipedream import staleness_theory
from raytrain_par.strategies.stages import partition

GPT = "gpt2-tiny"
VGG = {"name": "vgg11", "width": 0.125, "dropout": 0.0}
SYNC = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]


@pytest.fixture(scope="module")
def kjv(info):
    return info(**KJV)


# -- helpers that run inside the spawned ranks -----------------------------------------------------

class Run:
    """One rank's view of an experiment: the model built once, engines trained from copies of it."""

    def __init__(self, spec_dict, info_dict):
        self.spec = config.from_dict(spec_dict)
        self.info = DatasetInfo.from_json(info_dict)
        self.model, self.task = models.build(self.spec.model, self.info, self.spec.train.seed)
        self.train = read_split(self.info, self.info.train_path)

    def engine(self, spec_dict, total_steps, distributed=True):
        spec = config.from_dict(spec_dict)
        ctx = DistContext.current(torch.device("cpu")) if distributed else DistContext()
        return spec, strategies.build_engine(spec.strategy, copy.deepcopy(self.model), self.task, spec.train, ctx,
                                             total_steps)

    def steps(self, spec, engine, first, count):
        loader = MemoryLoader(self.train, spec.train.global_batch_size, engine.dp_rank, engine.dp_size,
                              spec.train.seed)
        return [float(engine.dp_sum(engine.train_step(b).clone())) / engine.dp_size
                for b in itertools.islice(loader.epoch(0, first), count)]

    def validation(self, spec, engine, rows=64):
        val = read_split(self.info, self.info.val_path)
        return engine.evaluate(eval_batches(val, 16, engine.dp_rank, engine.dp_size, rows))["val_loss"]


def _state_diff(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _parity(rank, world, cases, info_dict, steps):
    """For each (pipeline spec, single-process spec): both runs' per-step losses, every rank's, and the
    largest difference of their final weights. The reference runs on rank 0 only."""
    out = []
    run = None
    for spec_dict, reference_dict in cases:
        if run is None or run.spec.model != config.from_dict(spec_dict).model:
            run = Run(spec_dict, info_dict)
        reference = None
        if rank == 0:
            spec, engine = run.engine(reference_dict, steps, distributed=False)
            reference = (run.steps(spec, engine, 0, steps), engine.full_state_dict())
        spec, engine = run.engine(spec_dict, steps)
        losses = run.steps(spec, engine, 0, steps)
        state = engine.full_state_dict()
        memory = engine.memory()
        out.append({"losses": losses, "memory": memory,
                    "reference": reference and reference[0],
                    "weights_diff": reference and _state_diff(state, reference[1])})
    return out


def _vgg_cases(workers):
    train = {"batch": 32, "optimizer": "adamw", "lr": 1e-3}
    return [(experiment(VGG, "digits", strategy={"name": "pipeline", "schedule": "1f1b", "balance": "params"},
                        workers=workers, **train),
             experiment(VGG, "digits", workers=1, **train))]


def _two_ranks(rank, world, info_dict, info_dict_images, checkpoint_dir):
    """Everything the 2-rank tests need from one spawn."""
    out = {"parity": _parity(rank, world, _sync_cases(2), info_dict, 3)
           + _parity(rank, world, _vgg_cases(2), info_dict_images, 3)}
    run = Run(experiment(GPT, KJV, strategy="pipeline", workers=2), info_dict)

    # Activations held per schedule: GPipe keeps all M microbatches, 1F1B at most P - p on stage p. (The
    # record after the second step: torch's schedules infer shapes in the first.)
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        spec, engine = run.engine(experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": schedule,
                                                                 "microbatches": 4}, workers=2), 2)
        run.steps(spec, engine, 0, 1)
        engine.memory()
        run.steps(spec, engine, 1, 1)
        memory[schedule] = engine.memory()
    out["memory"] = memory

    # Resume: 2 steps, checkpoint, a fresh engine loads it and takes 2 more == 4 steps straight.
    spec_dict = experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": "1f1b"}, workers=2, steps=4,
                           lr_schedule="cosine", warmup_steps=1, grad_clip=1.0)
    spec, straight = run.engine(spec_dict, 4)
    straight_losses = run.steps(spec, straight, 0, 4)
    spec, first = run.engine(spec_dict, 4)
    resumed_losses = run.steps(spec, first, 0, 2)
    one_format.save(first, checkpoint_dir, 2)
    torch.distributed.barrier()
    spec, second = run.engine(spec_dict, 4)
    one_format.load(second, checkpoint_dir)
    resumed_losses += run.steps(spec, second, 2, 2)
    out["resume"] = {"straight": straight_losses, "resumed": resumed_losses,
                     "weights_diff": _state_diff(straight.full_state_dict(), second.full_state_dict())}

    # PipeDream against the synchronous pipeline from the same weights and batches.
    pipedream = {}
    for name, options in [("stash", {}), ("stash-3", {"microbatches": 3}), ("2bw", {"weight_versions": 2})]:
        spec_dict = experiment(GPT, KJV, strategy={"name": "pipedream", **options}, workers=2, batch=24, steps=6)
        spec, engine = run.engine(spec_dict, 6)
        before = run.validation(spec, engine)
        losses = run.steps(spec, engine, 0, 6)
        pipedream[name] = {"losses": losses, "val": (before, run.validation(spec, engine)),
                           "staleness": list(engine.staleness), "lag": engine.lag, "m": engine.m,
                           "two_versions": engine.two_versions, "memory": engine.memory(),
                           "tied_equal": _tied_equal(engine.full_state_dict())}
    spec_dict = experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": "gpipe", "microbatches": 1}, workers=2,
                           batch=24, steps=6)
    spec, engine = run.engine(spec_dict, 6)
    pipedream["gpipe"] = {"losses": run.steps(spec, engine, 0, 6)}
    out["pipedream"] = pipedream
    out["bf16"] = _bf16(rank, info_dict, info_dict_images)
    return out


def _bf16_cases():
    """(name, model, data, strategy, train) trained in bf16 and in fp32, 8 steps each."""
    gpt = [(schedule, GPT, KJV, {"name": "pipeline", "schedule": schedule}, {})
           for schedule in [*SYNC, "zbv"]]
    gpt += [("pipedream", GPT, KJV, {"name": "pipedream"}, {}),
            ("pipedream-2bw", GPT, KJV, {"name": "pipedream", "weight_versions": 2}, {})]
    vgg = [("vgg-1f1b", VGG, "digits", {"name": "pipeline", "schedule": "1f1b", "balance": "params"},
            {"batch": 32, "optimizer": "adamw", "lr": 1e-3})]
    return gpt + vgg


def _bf16(rank, info_dict, info_dict_images, steps=8):
    """Each case in bf16 and in fp32 (losses, validation loss, dtypes, model-state bytes); and, on rank 0,
    single-process ddp in bf16, to set against a bf16 pipeline of 8 microbatches (1F1B) and of 1 (GPipe)."""
    out, runs = {}, {}

    def train(run, spec_dict, distributed=True):
        spec, engine = run.engine(spec_dict, steps, distributed)
        losses = run.steps(spec, engine, 0, steps)
        memory = engine.memory()
        optimizers = [engine.optimizer, getattr(engine, "tied_optimizer", None)]
        states = [t for o in optimizers if o is not None for state in o.state.values() for t in state.values()]
        result = {"losses": losses, "val": run.validation(spec, engine),
                  "dtypes": {str(t.dtype) for t in [*engine.full_state_dict().values(), *states]
                             if t.is_floating_point()},
                  "state": {k: memory[k] for k in ("mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes")}}
        del engine  # freed before the next engine counts what it holds
        gc.collect()
        return result

    for name, model, data_, strategy, options in _bf16_cases():
        key = "gpt" if model == GPT else "vgg"
        if key not in runs:
            runs[key] = Run(experiment(model, data_, strategy=strategy, workers=2, **options),
                            info_dict if key == "gpt" else info_dict_images)
        for precision in ("bf16", "fp32"):
            out[name, precision] = train(runs[key], experiment(model, data_, strategy=strategy, workers=2,
                                                               steps=steps, precision=precision, **options))
    out["gpipe-1", "bf16"] = train(runs["gpt"], experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": "gpipe",
                                                                              "microbatches": 1},
                                                           workers=2, steps=steps, precision="bf16"))
    if rank == 0:
        out["ddp", "bf16"] = train(runs["gpt"], experiment(GPT, KJV, workers=1, steps=steps, precision="bf16"),
                                   distributed=False)
    return out


def _tied_equal(state):
    return bool(torch.equal(state["transformer.wte.weight"], state["lm_head.weight"]))


def _sync_cases(workers):
    cases = []
    for schedule in SYNC:
        cases.append((experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": schedule}, workers=workers),
                      experiment(GPT, KJV, workers=1)))
    train = {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "warmup_steps": 2, "lr_schedule": "cosine",
             "weight_decay": 0.1}
    cases.append((experiment(GPT, KJV, strategy={"name": "pipeline", "schedule": "1f1b", "microbatches": 2},
                             workers=workers, **train),
                  experiment(GPT, KJV, workers=1, **train)))
    return cases


def _four_ranks(rank, world, info_dict):
    """P = 2 x D = 2 for the synchronous schedules and PipeDream, and PipeDream over 4 stages (one GPT-2
    layer each)."""
    out = {"parity": _parity(rank, world, _sync_cases(4)[:3], info_dict, 3)}
    run = Run(experiment(GPT, KJV, workers=4), info_dict)
    deep = {}
    for name, options in [("stash", {"stages": 4}), ("2bw", {"stages": 4, "weight_versions": 2, "microbatches": 4}),
                          ("2x2", {"stages": 2, "microbatches": 2})]:
        spec_dict = experiment(GPT, KJV, strategy={"name": "pipedream", **options}, workers=4, steps=8)
        spec, engine = run.engine(spec_dict, 8)
        engine_losses = run.steps(spec, engine, 0, 8)
        deep[name] = {"staleness": list(engine.staleness), "lag": engine.lag, "m": engine.m,
                      "two_versions": engine.two_versions, "memory": engine.memory(),
                      "tied_equal": _tied_equal(engine.full_state_dict()), "losses": engine_losses}
    out["pipedream"] = deep
    return out


# -- the tests ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(kjv, info, tmp_path_factory):
    return run_ranks(2, _two_ranks, kjv, info("digits"), tmp_path_factory.mktemp("pipeline-checkpoint"))


@pytest.fixture(scope="module")
def four_ranks(kjv):
    return run_ranks(4, _four_ranks, kjv)


def _check_parity(results, cases):
    for case, ranks in zip(cases, zip(*[r["parity"] for r in results])):
        strategy = config.parse(case[0]).strategy
        what = f"{strategy.name} {strategy.options}"
        for r in ranks[1:]:
            assert r["losses"] == ranks[0]["losses"], what  # every rank returns the pipeline's loss
        assert ranks[0]["losses"] == pytest.approx(ranks[0]["reference"], abs=1e-5, rel=1e-5), what
        # Weights after a few AdamW steps (lr 1e-3): its normalised step turns a rounding difference in
        # a near-zero gradient into a difference of a fraction of lr in that one weight (1.3e-5 seen
        # for gpipe on a CPU with other matmul kernels), so the bound is a tenth of lr.
        assert ranks[0]["weights_diff"] < 1e-4, what
        assert len(set(ranks[0]["reference"])) == len(ranks[0]["reference"])  # and the model changes


def test_synchronous_schedules_match_one_process(two_ranks):
    """GPipe, 1F1B, interleaved 1F1B and zero-bubble on 2 stages: the losses and final weights of the
    plain model trained in one process on the whole batch (also with accumulation and clipping)."""
    _check_parity(two_ranks, _sync_cases(2) + _vgg_cases(2))


def test_pipeline_times_data_parallel_matches_one_process(four_ranks):
    """2 stages x 2 replicas: each stage's gradients averaged over its replicas."""
    _check_parity(four_ranks, _sync_cases(4)[:3])
    memory = four_ranks[0]["parity"][0]["memory"]
    assert len(memory["stage_param_bytes"]) == 2 and memory["mem_param_bytes"] == memory["stage_param_bytes"][0]


def test_activation_memory_follows_the_schedule(two_ranks):
    """Per microbatch, each stage keeps the same activations; GPipe keeps all M = 4 of them, 1F1B at most
    P - p on stage p."""
    gpipe, one = two_ranks[0]["memory"]["gpipe"], two_ranks[0]["memory"]["1f1b"]
    per_microbatch = [b / 4 for b in gpipe["stage_activation_bytes"]]
    for p, held in enumerate(one["stage_activation_bytes"]):
        assert held == pytest.approx(min(4, 2 - p) * per_microbatch[p], rel=0.01)
    assert sum(gpipe["stage_param_bytes"]) > gpipe["stage_param_bytes"][0] > 0
    assert gpipe["bubble_fraction"] is not None and 0 <= gpipe["bubble_fraction"] < 1
    assert gpipe["bubble_theory"] == pytest.approx((2 - 1) / (4 + 2 - 1))  # (P - 1) / (M + P - 1)


@pytest.mark.parametrize("schedule, virtual, theory", [
    ("gpipe", None, 3 / 19), ("1f1b", None, 3 / 19), ("interleaved-1f1b", 2, 3 / 35),
    ("interleaved-1f1b", 4, 3 / 67), ("zero-bubble", 2, None), ("zbv", None, None)])
def test_bubble_theory_of_each_schedule(schedule, virtual, theory):
    """P = 4 workers, M = 16 microbatches: (P - 1) / (V M + P - 1), V stages per worker."""
    from raytrain_par.strategies.pipeline import Options

    got = Options(stages=4, schedule=schedule, microbatches=16, virtual_stages=virtual).bubble_theory()
    assert got == (None if theory is None else pytest.approx(theory))


def test_resumed_pipeline_equals_uninterrupted(two_ranks):
    resume = two_ranks[0]["resume"]
    assert resume["resumed"] == pytest.approx(resume["straight"], abs=0)
    assert resume["weights_diff"] == 0


def test_pipedream_trains_with_the_staleness_of_its_schedule(two_ranks):
    runs = two_ranks[0]["pipedream"]
    gpipe = runs["gpipe"]["losses"]
    for name in ("stash", "stash-3", "2bw"):
        run = runs[name]
        before, after = run["val"]
        assert after < before - 0.1, name  # validation loss falls
        # measured staleness of every microbatch = updates between its forward and backward in 1F1B order
        for j, measured in run["staleness"]:
            assert measured == staleness_theory(j, run["lag"], run["m"], run["two_versions"]), (name, j)
        assert run["tied_equal"], name  # embedding and LM head copies took the same updates
        for r in two_ranks:
            assert r["pipedream"][name]["losses"] == run["losses"]
    stash = runs["stash"]
    assert [s for _, s in stash["staleness"]][2:] == [1] * 4  # stage 0 of 2: one update stale
    assert stash["memory"]["stage_staleness_theory"] == [1.0, 0.0]
    assert stash["losses"][0] == pytest.approx(gpipe[0], abs=1e-6)  # the same first step ...
    assert all(abs(a - b) > 1e-4 for a, b in zip(stash["losses"][2:], gpipe[2:]))  # ... then stale weights
    # Stage 0 stashes one version besides its weights; the last stage none.
    assert stash["memory"]["stage_stash_bytes"] == [stash["memory"]["stage_param_bytes"][0], 0]


def test_pipedream_four_stages(four_ranks):
    """Staleness P - 1 - p on stage p with weight stashing, P - 1 - p stashed versions; 2BW: one of each.
    And 2 stages x 2 replicas: every rank returns the mean loss over both replicas' rows."""
    for r in four_ranks:
        for name, run in r["pipedream"].items():
            for j, measured in run["staleness"]:
                assert measured == staleness_theory(j, run["lag"], run["m"], run["two_versions"]), (name, j)
            assert run["tied_equal"], name
            assert run["losses"] == four_ranks[0]["pipedream"][name]["losses"], name
    assert four_ranks[0]["pipedream"]["2x2"]["memory"]["stage_staleness_theory"] == [0.5, 0.0]
    stash, two = four_ranks[0]["pipedream"]["stash"]["memory"], four_ranks[0]["pipedream"]["2bw"]["memory"]
    assert stash["stage_staleness_theory"] == [3.0, 2.0, 1.0, 0.0]
    assert two["stage_staleness_theory"] == [1.0, 1.0, 1.0, 0.0]
    params = stash["stage_param_bytes"]
    assert stash["stage_stash_bytes"] == [(3 - p) * params[p] for p in range(4)]
    assert two["stage_stash_bytes"] == [params[p] if p < 3 else 0 for p in range(4)]


def test_bf16_trains_like_fp32(two_ranks):
    """bf16 (autocast over fp32 weights) under every schedule and PipeDream, GPT-2 and VGG: each step's
    loss within 3e-2 relative of the same run in fp32 (bf16's 8-bit mantissa moves a GPT-2 loss of ~6 by
    ~2e-5 relative here), yet not equal to it (autocast did compute in bf16); evaluation likewise; the
    weights and optimizer state stay fp32, holding the bytes they hold in fp32."""
    runs = two_ranks[0]["bf16"]
    for name, model, *_ in _bf16_cases():
        bf16, fp32 = runs[name, "bf16"], runs[name, "fp32"]
        assert bf16["losses"] == pytest.approx(fp32["losses"], rel=3e-2), name
        assert bf16["losses"] != fp32["losses"], name
        assert bf16["val"] == pytest.approx(fp32["val"], rel=3e-2) and bf16["val"] != fp32["val"], name
        assert bf16["dtypes"] == {"torch.float32"}, name
        assert bf16["state"] == fp32["state"], name
        if model == GPT:  # (VGG barely moves from ln 10 in 8 steps)
            assert bf16["losses"][-1] < bf16["losses"][0] - 0.2, name
        for r in two_ranks[1:]:
            assert r["bf16"][name, "bf16"]["losses"] == bf16["losses"], name


def test_bf16_pipeline_matches_bf16_ddp(two_ranks):
    """A bf16 pipeline computes what autocast computes in one process (ddp): the same ops in bf16, fp32
    between stages as GPT-2's residual stream is under autocast. With one microbatch (the same rows in
    every matmul) the losses agree to 1e-6. With 8 microbatches of 2 rows the matmuls sum in another
    order, and a bf16 rounding that flips on the difference moves the loss by about as much as bf16
    moves it from fp32 (~2e-5 relative): bound 1e-4."""
    runs = two_ranks[0]["bf16"]
    ddp = runs["ddp", "bf16"]
    one, eight = runs["gpipe-1", "bf16"], runs["1f1b", "bf16"]
    assert one["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=0)
    assert one["val"] == pytest.approx(ddp["val"], rel=1e-6, abs=0)
    assert eight["losses"] == pytest.approx(ddp["losses"], rel=1e-4, abs=0)
    assert eight["val"] == pytest.approx(ddp["val"], rel=1e-4, abs=0)


def test_split_balances_and_follows_split_points(info):
    costs = [0.0, 3.0, 3.0, 3.0, 3.0, 9.0]
    points = partition(costs, 3)
    best = min(max(sum(costs[a:b]) for a, b in zip([0, *s], [*s, len(costs)]))
               for s in itertools.combinations(range(1, len(costs)), 2))
    assert max(sum(costs[a:b]) for a, b in zip([0, *points], [*points, len(costs)])) == best
    assert len(points) == 2 and points == sorted(points)


@pytest.mark.parametrize("strategy,overrides,field,words", [
    ({"name": "pipeline", "stages": 5}, {"workers": 5}, "strategy.stages", "4 layers"),
    ({"name": "pipeline", "schedule": "interleaved-1f1b", "stages": 2, "virtual_stages": 3}, {}, "strategy.stages",
     "6 stages"),
    ({"name": "pipeline", "microbatches": 3}, {}, "strategy.microbatches", "does not divide the 16 rows"),
    ({"name": "pipeline", "schedule": "1f1b-interleaved"}, {}, "strategy.schedule", "did you mean 'interleaved-1f1b'"),
    ({"name": "pipeline", "stages": 2}, {"workers": 3}, "scaling.num_workers", "pipelines of 2 stages"),
    ({"name": "pipeline", "split_points": [0, 2]}, {}, "strategy.split_points", "1 increasing layer indices"),
    ({"name": "pipeline", "schedule": "gpipe", "virtual_stages": 2}, {}, "strategy.virtual_stages", "one stage"),
    ({"name": "pipeline", "schedule": "1f1b", "microbatches": 1}, {}, "strategy.microbatches", "at least"),
    ({"name": "pipeline", "stages": 1}, {"workers": 1}, "strategy.stages", "at least 2 stages"),
    ({"name": "pipedream"}, {"grad_clip": 1.0}, "train.grad_clip", "never known"),
    ({"name": "pipedream"}, {"gradient_accumulation_steps": 2}, "train.gradient_accumulation_steps",
     "strategy.microbatches: 2"),
    ({"name": "pipedream", "stages": 4, "weight_versions": 2, "microbatches": 2}, {"workers": 4},
     "strategy.microbatches", "two weight versions"),
    ({"name": "pipedream", "weight_versions": 3}, {}, "strategy.weight_versions", "not one of"),
    ({"name": "pipeline"}, {"precision": "fp16", "use_gpu": True}, "train.precision", "no loss scaler"),
    ({"name": "pipedream"}, {"precision": "fp16", "use_gpu": True}, "train.precision", "no loss scaler"),
])
def test_bad_options_are_rejected_before_start(strategy, overrides, field, words):
    train = dict(overrides)
    scaling = {"num_workers": train.pop("workers", 2), "use_gpu": train.pop("use_gpu", False)}
    raw = {"name": "bad", "model": {"name": GPT}, "data": KJV, "strategy": strategy,
           "scaling": scaling, "train": {"global_batch_size": 16, "max_steps": 4, **train}}
    with pytest.raises(ConfigError) as e:
        config.parse(raw)
    assert e.value.field == field and words in str(e.value), str(e.value)
    assert "fix:" in str(e.value)
    if field == "train.precision":
        assert "use train.precision: bf16" in str(e.value)


def test_strategy_set_from_the_command_line():
    """Each strategy variant of an experiment file runs with --set overrides."""
    from raytrain_par.config import load_experiment
    from conftest import experiment_file

    path = experiment_file("pipeline-staleness.yaml")
    spec = load_experiment(path, ["strategy={name: pipeline, stages: 2, schedule: gpipe}"], check_data=False)
    assert spec.strategy.name == "pipeline" and spec.strategy.options.schedule == "gpipe"
    spec = load_experiment(path, ["strategy.name=pipedream", "strategy.stages=2"], check_data=False)
    assert spec.strategy.name == "pipedream" and spec.data_parallel_size == spec.scaling.num_workers // 2
    for variant in spec.sweep["grid"]["strategy"]:
        assert load_experiment(path, [f"strategy={variant}"], check_data=False).strategy.name == variant["name"]
