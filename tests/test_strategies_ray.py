"""experiments/strategies.yaml's sweep through Ray Tune, over two engines no other test trains through
Ray: zero-1 and fsdp. ddp and zero-3 train through Ray in tests/test_failures.py, megatron with
tensor_parallel 2 in tests/test_causal_lm.py, megatron and the pipeline engine's 1f1b in the 4-worker
layouts of tests/test_layout_3d.py and PipeDream in tests/test_pipeline_ray.py. The engines and
schedules left (zero-2, gpipe, interleaved-1f1b, zero-bubble, zbv) differ from those only inside the
engine: each trains a few steps in one Ray Train worker group, all in one run. Each engine and schedule is compared with one process in plain process
groups by tests/test_zero.py, tests/test_megatron.py and tests/test_pipeline.py. Every engine also
trains in bf16 in one Ray Train run."""

import functools

import pytest

import engines
from conftest import experiment_file
from engines import train_steps
from raytrain_par.config import load_experiment
from raytrain_par.local_group import run_ranks
from raytrain_par.tuning import run_sweep

pytestmark = pytest.mark.ray

STRATEGIES = ["{name: zero-1}", "{name: fsdp}"]
COMMON = ["train.max_steps=2", "train.warmup_steps=0", "sweep=null"]


@pytest.fixture(scope="module")
def one_process(info):
    """The losses of one ddp process, two steps on strategies.yaml's global batches, and the data set."""
    one = load_experiment(experiment_file("strategies.yaml"), [*COMMON, "scaling.num_workers=1"])
    data = info("kjv", seq_len=one.data.seq_len, vocab_size=one.data.vocab_size)
    return run_ranks(1, train_steps, one.to_dict(), data, 2)[0]["losses"], data


def test_strategies_sweep_trains_every_engine_as_one_ddp_process_does(ray_cluster, tmp_path, one_process):
    """Every trial completes, two steps each, with the losses of one ddp process on the same global
    batches."""
    common = ["train.max_steps=2", "train.eval_every_steps=1", "train.warmup_steps=0", "train.checkpoint_every_evals=0",
              "data.max_val_samples=16"]
    # both trials at once: the shared cluster holds their 2 x 2 workers, and one's start-up overlaps the other's
    spec = load_experiment(experiment_file("strategies.yaml"), [
        *common, f"output_dir={tmp_path}", f"sweep.grid.strategy=[{', '.join(STRATEGIES)}]",
        "sweep.max_concurrent_trials=2"])
    result = run_sweep(spec, log=lambda *_: None)
    assert len(result.trials) == len(STRATEGIES) and all(t["status"] == "completed" for t in result.trials)
    reference, _ = one_process
    for t in result.trials:
        losses = [r["train_loss"] for r in result.records if r["trial"] == t["trial"] and r["step"] > 0]
        assert losses == pytest.approx(reference, rel=1e-5), t["trial"]


ENGINES = {"zero-2": "{name: zero-2}",
           **{s: f"{{name: pipeline, stages: 2, schedule: {s}}}"
              for s in ("gpipe", "interleaved-1f1b", "zero-bubble", "zbv")}}


def test_the_other_engines_train_in_ray_train_workers_as_one_ddp_process_does(ray_cluster, tmp_path, one_process):
    """zero-2 and the gpipe, interleaved-1f1b, zero-bubble and zbv (two stages per worker, in a V; a
    split backward) schedules, two steps each in one group of 2 Ray Train workers (one run rather than
    one each: Ray's start-up of a run costs ~30 s on 2 cores), train the losses of one ddp process on
    the same global batches."""
    reference, data = one_process
    cases = {name: load_experiment(experiment_file("strategies.yaml"), [*COMMON, f"strategy={s}"]).to_dict()
             for name, s in ENGINES.items()}
    trained = engines.in_ray_workers(functools.partial(engines.step_losses, steps=2), cases, data, tmp_path)
    assert set(trained) == set(ENGINES)
    for name, losses in trained.items():
        assert losses == pytest.approx(reference, rel=1e-5), name


BF16 = {"ddp": "{name: ddp}", "zero-1": "{name: zero-1}", "zero-2": "{name: zero-2}", "zero-3": "{name: zero-3}",
        "fsdp": "{name: fsdp}", "megatron": "{name: megatron, tensor_parallel: 2}",
        "pipeline": "{name: pipeline, stages: 2, schedule: 1f1b}"}
SMALL = [*COMMON, "train.global_batch_size=8"]  # bf16 matmuls are emulated on CPUs without bf16 units


def test_every_engine_trains_in_bf16_in_ray_train_workers(ray_cluster, tmp_path, one_process):
    """Each engine that trains in bf16 (PipeDream's in tests/test_pipeline_ray.py), two steps in one group
    of 2 Ray Train workers, within bf16's precision (3e-2 relative) of one fp32 ddp process on the same
    global batches; every engine's bf16 run is compared with its own fp32 run over 8 steps in
    tests/test_bf16.py and tests/test_pipeline.py."""
    _, data = one_process
    one = load_experiment(experiment_file("strategies.yaml"), [*SMALL, "scaling.num_workers=1"])
    reference = run_ranks(1, train_steps, one.to_dict(), data, 2)[0]["losses"]
    cases = {name: load_experiment(experiment_file("strategies.yaml"),
                                   [*SMALL, f"strategy={s}", "train.precision=bf16"]).to_dict()
             for name, s in BF16.items()}
    trained = engines.in_ray_workers(functools.partial(engines.step_losses, steps=2), cases, data, tmp_path)
    assert set(trained) == set(BF16)
    for name, losses in trained.items():
        assert losses == pytest.approx(reference, rel=3e-2), name
        assert losses != pytest.approx(reference, rel=1e-6), f"{name}: the same losses as fp32; not bf16?"
