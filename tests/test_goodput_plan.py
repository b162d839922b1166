"""`raytrain-par plan`: steps to the target from one reference run's noise scale, the prediction of
every sweep point, bad input refused before start, and one plan end to end on the shared Ray cluster."""

import json
import os
import re

import pytest
import yaml
from engines import experiment

from raytrain_par import cli, config, driver
from raytrain_par.errors import ConfigError
from raytrain_par.goodput import predict, strategy_key
from raytrain_par.metrics.goodput import Reference, fit_reference
from raytrain_par.metrics.throughput import StepTimeModel, ThroughputModel
from raytrain_par.sweep import check_goodput, plan

BASE = {"name": "g", "model": "gpt2-tiny", "data": {"name": "kjv", "seq_len": 32, "vocab_size": 512},
        "scaling": {"num_workers": 2}, "train": {"global_batch_size": 16, "max_steps": 10, "lr": 1e-3},
        "target": "val_loss <= 3.0"}


def records(noise, every=64, batch=32, start=10.0, slope=0.01):
    """Evaluations every `every` steps of a loss falling linearly; `noise[i]` measured over interval i."""
    out = [{"step": 0, "global_batch_size": batch, "val_loss": start, "grad_noise_scale": None}]
    for i, b in enumerate(noise, 1):
        out.append({"step": i * every, "global_batch_size": batch, "val_loss": start - slope * i * every,
                    "grad_noise_scale": b})
    return out


def test_a_constant_noise_scale_gives_back_s_min_and_the_efficiency():
    # the target (loss 7.4375) is crossed at step 256.25 = S_min (1 + B / M0) with S_min 100, B 50, M0 32
    ref = fit_reference(records([50.0] * 6), "val_loss", 10 - 0.01 * 256.25, "min")
    assert (ref.batch, ref.steps) == (32, pytest.approx(256.25))
    assert (ref.min_steps, ref.noise_scale) == (pytest.approx(100.0), pytest.approx(50.0))
    assert ref.steps_to_target(32) == pytest.approx(256.25)
    assert ref.steps_to_target(64) == pytest.approx(100 * (1 + 50 / 64))
    assert ref.efficiency(32) == 1.0 and ref.efficiency(64) == pytest.approx(82 / 114)


def test_a_noise_scale_that_grows_weighs_each_interval_by_its_steps():
    ref = fit_reference(records([10.0, 90.0]), "val_loss", 10 - 0.01 * 128, "min")
    # each interval of 64 steps at M0 = 32 scales on its own: 64 (1 + B/M) / (1 + B/32)
    for m in (8, 32, 128):
        assert ref.steps_to_target(m) == pytest.approx(64 * (1 + 10 / m) / (1 + 10 / 32)
                                                       + 64 * (1 + 90 / m) / (1 + 90 / 32))
    assert fit_reference(records([10.0]), "val_loss", 1.0, "min") is None  # never reached
    missing = records([None, None])
    with pytest.raises(ValueError, match="no gradient noise scale recorded at or after step 64"):
        fit_reference(missing, "val_loss", 9.0, "min")


def test_a_learning_rate_that_limits_progress_costs_steps_beyond_the_noise_scale():
    # two intervals of 64 steps at M0 = 32 and lr0 = 2e-3, noise scales 2 and 90 (records with warm-up)
    recs = records([2.0, 90.0])
    for r in recs:
        r["lr"] = 2e-4 if r["step"] == 0 else 2e-3
    ref = fit_reference(recs, "val_loss", 10 - 0.01 * 128, "min")
    assert ref.lr == 2e-3  # the peak the records show
    noise = [(1 + b / 8) / (1 + b / 32) for b in (2.0, 90.0)]
    # batch 8 at half the lr (sqrt scaling): where the noise scale is small the learning rate limits,
    # as lr0 / lr for SGD and that times the root of the noise's ratio for Adam
    # (for Adam under sqrt scaling the learning rate's ratio is the larger at every smaller batch)
    assert ref.steps_to_target(8, 1e-3, "adamw") == pytest.approx(64 * 2 * noise[0] ** 0.5 + 64 * 2 * noise[1] ** 0.5)
    assert ref.steps_to_target(8, 1e-3, "sgd") == pytest.approx(64 * 2 + 64 * noise[1])  # one interval each way
    # a learning rate that suits the batch: the noise scale's steps alone, the fewest any lr gives
    assert ref.steps_to_target(8) == pytest.approx(64 * noise[0] + 64 * noise[1])
    assert ref.steps_to_target(8, 1e-3) > ref.steps_to_target(8)
    # a larger batch at a larger lr: no fewer steps than the noise scale allows
    big = [(1 + b / 128) / (1 + b / 32) for b in (2.0, 90.0)]
    assert ref.steps_to_target(128, 8e-3, "adamw") == pytest.approx(64 * big[0] + 64 * big[1])
    assert ref.steps_to_target(32, 2e-3, "adamw") == pytest.approx(128)  # the reference itself
    assert fit_reference(recs, "val_loss", 10 - 0.01 * 128, "min", lr=1e-3).lr == 1e-3


def test_every_point_is_predicted_ranked_and_sized():
    spec = config.parse({**BASE, "sweep": {"grid": {"scaling.num_workers": [1, 2], "train.global_batch_size": [8, 32],
                                                    "strategy": [{"name": "ddp"}, {"name": "fsdp"}]},
                                           "lr_scaling": "sqrt"}})
    p = plan(spec)
    ref = Reference(batch=16, steps=300.0, min_steps=100.0, noise_scale=32.0)
    times = {"ddp": StepTimeModel(0.1, 0.01, 0.05, 0.0), "fsdp": StepTimeModel(0.1, 0.01, 0.2, 0.0)}
    model = ThroughputModel({strategy_key(p.trial_spec(pt)): times[p.trial_spec(pt).strategy.name]
                             for pt in p.points})
    rows = predict(p, ref, model, device_memory=2**40)
    assert len(rows) == 8 and [r["rank"] for r in rows] == list(range(1, 9))
    by = {(r["strategy"], r["num_workers"], r["global_batch_size"]): r for r in rows}
    r = by[("ddp", 2, 32)]
    assert r["per_worker_batch"] == 16 and r["lr"] == pytest.approx(1e-3 * 2 ** 0.5)  # as the trial runs it
    assert r["predicted_steps_to_target"] == pytest.approx(100 * (1 + 32 / 32))
    assert r["predicted_step_time_s"] == pytest.approx(0.1 + 16 * 0.01 + 0.05)
    assert r["predicted_time_to_target_s"] == pytest.approx(200 * 0.31)
    assert r["statistical_efficiency"] == pytest.approx(48 / 64) and r["fits"] is True
    # memory from `estimate`: a worker of two computes half the rows of one alone
    assert 0 < r["memory_per_worker_bytes"] < by[("ddp", 1, 32)]["memory_per_worker_bytes"]
    times_ = [r["predicted_time_to_target_s"] for r in rows]
    assert times_ == sorted(times_)
    # a device too small for any of them: all flagged, still ranked by time
    assert all(r["fits"] is False for r in predict(p, ref, model, device_memory=1024))


def test_unprobed_worker_counts_take_the_step_model_calibrated_on_the_probes():
    """Probes at one worker measure each strategy's achievable fraction; a point at two workers takes
    estimate's step on the device at that fraction: what the probe measured, scaled by the model."""
    from dataclasses import replace

    from raytrain_par import devices, estimate
    from raytrain_par.goodput import Calibrated, probed_only

    spec = config.parse({**BASE, "sweep": {"grid": {"scaling.num_workers": [1, 2], "train.global_batch_size": [8, 32],
                                                    "strategy": [{"name": "ddp"}, {"name": "zero-2"}]},
                                           "lr_scaling": "sqrt"}})
    p = plan(spec)
    specs = [p.trial_spec(pt) for pt in p.points]
    one = probed_only(specs, [1])
    assert {s.scaling.num_workers for s in one} == {1} and len(one) == 4
    device = devices.device("a100-80gb", {"achievable": "1"})
    truth = {"ddp": 0.3, "zero-2": 0.2}  # the fractions the "measured" probes reach
    overhead = {"ddp": 0.004, "zero-2": 0.0}  # and what each step takes beside its FLOPs

    def measured(s):
        return estimate.step_time(s, replace(device, achievable=truth[s.strategy.name],
                                             step_overhead_s=overhead[s.strategy.name])).step_s

    calibrated = Calibrated([(s, measured(s)) for s in one], device)
    for s in specs:
        assert calibrated.achievable[strategy_key(s)] == pytest.approx(truth[s.strategy.name])
        assert calibrated.overhead_s[strategy_key(s)] == pytest.approx(overhead[s.strategy.name], abs=1e-9)
        assert calibrated.step_time(s) == pytest.approx(measured(s))
    # a fraction alone, from probes at one batch, charges the overhead to the FLOPs
    at_8 = [s for s in one if s.train.global_batch_size == 8]
    alone = Calibrated([(s, measured(s)) for s in at_8], device)
    ddp = [s for s in specs if s.strategy.name == "ddp"]
    assert all(v == 0.0 for v in alone.overhead_s.values())
    assert alone.step_time(ddp[-1]) > measured(ddp[-1]) * 1.01
    ref = Reference(batch=16, steps=300.0, min_steps=100.0, noise_scale=32.0)
    probed = {(strategy_key(s), 1, s.per_worker_batch, 1): measured(s) for s in one}
    rows = predict(p, ref, ThroughputModel({}), probed=probed, calibrated=calibrated)
    for r in rows:
        assert r["step_time_from"] == ("probed" if r["num_workers"] == 1 else "model")
        s = next(s for s in specs if (s.strategy.name, s.scaling.num_workers, s.train.global_batch_size)
                 == (r["strategy"], r["num_workers"], r["global_batch_size"]))
        assert r["predicted_step_time_s"] == pytest.approx(measured(s))
    with pytest.raises(ConfigError, match="no point on 4 worker"):
        probed_only(specs, [4])
    only_ddp = [s for s in specs if s.strategy.name == "ddp" and s.scaling.num_workers == 1]
    with pytest.raises(ConfigError, match="no point of zero-2"):
        probed_only(only_ddp + [s for s in specs if s.strategy.name == "zero-2" and s.scaling.num_workers == 2], [1])


@pytest.mark.parametrize("changes,field,words", [
    ({"target": None}, "target", "the experiment has none"),
    ({"sweep": {"grid": {"scaling.num_workers": [1, 2]}}}, "sweep.grid.train.global_batch_size",
     "the search space has one"),
    ({"sweep": {"grid": {"train.global_batch_size": [8, 16]}, "random": {"train.lr": [1e-3, 2e-3]}}},
     "sweep.random", "samples nothing"),
])
def test_what_a_prediction_needs_is_checked_before_start(changes, field, words):
    spec = config.parse({**BASE, "sweep": {"grid": {"train.global_batch_size": [8, 16]}}, **changes})
    with pytest.raises(ConfigError) as err:
        check_goodput(plan(spec), "raytrain-par plan")
    assert err.value.field == field and words in str(err.value) and "fix:" in str(err.value)


@pytest.mark.parametrize("strategy,workers,precision,trained", [
    ({"name": "zero-2"}, 2, "bf16", ("zero-2", 2, "bf16")),
    ({"name": "fsdp"}, 4, "fp32", ("fsdp", 4, "fp32")),
    ({"name": "megatron", "tensor_parallel": 2}, 4, "fp32", ("megatron", 4, "fp32")),
    ({"name": "megatron", "tensor_parallel": 2}, 2, "fp32", ("ddp", 2, "fp32")),  # one data-parallel replica
    ({"name": "pipeline", "stages": 2}, 4, "fp32", ("pipeline", 4, "fp32")),
    ({"name": "pipeline", "stages": 2, "data_parallel_sharding": "fsdp"}, 4, "bf16", ("ddp", 4, "bf16")),
    ({"name": "megatron", "tensor_parallel": 2, "stages": 2}, 8, "fp32", ("megatron", 8, "fp32")),
    ({"name": "pipeline", "stages": 2}, 2, "fp32", ("ddp", 2, "fp32")),  # one data-parallel replica
    ({"name": "pipedream", "stages": 2}, 4, "fp32", ("ddp", 4, "fp32")),
    ({"name": "ddp"}, 1, "fp32", ("ddp", 2, "fp32")),
    ({"name": "zero-1"}, 2, "fp16", ("ddp", 2, "fp32")),  # loss-scaled gradients
], ids=["zero-2", "fsdp", "megatron-t2-d2", "megatron-t2-d1", "pipeline-p2-d2", "pipeline-fsdp-p2-d2",
        "megatron-t2-p2-d2", "pipeline-p2-d1", "pipedream", "ddp-alone", "zero-1-fp16"])
def test_the_reference_trains_the_experiments_own_strategy_where_it_measures_the_noise_scale(
        strategy, workers, precision, trained):
    from raytrain_par.goodput import reference_spec

    scaling = {"num_workers": workers, "use_gpu": precision == "fp16"}  # fp16 trains on GPUs only
    spec = config.parse({**BASE, "strategy": strategy, "scaling": scaling,
                         "train": {**BASE["train"], "precision": precision}})
    ref, note = reference_spec(spec)
    assert (ref.strategy.name, ref.scaling.num_workers, ref.train.precision) == trained
    assert ref.train.stop_at_target and ref.train.global_batch_size == spec.train.global_batch_size
    if trained == (spec.strategy.name, workers, precision):
        assert note is None and ref.strategy.options == spec.strategy.options
    else:
        assert f"{spec.strategy.name} on {workers} worker(s)" in note and "does not measure" in note


@pytest.mark.parametrize("override,words", [
    ("target=null", "the experiment has none"),
    ("sweep={grid: {scaling.num_workers: [1, 2]}}", "the search space has one"),
    ("sweep={grid: {train.global_batch_size: [8, 16]}, metric: throughput}", "sweep.metric = 'throughput'"),
])
def test_cli_plan_refuses_before_a_cluster_starts(override, words, monkeypatch, tmp_path, capsys):
    def no_cluster(*a, **k):
        raise AssertionError("a Ray cluster was started for a bad plan")

    monkeypatch.setattr(driver, "ray_cluster", no_cluster)
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "results"),
                                 "sweep": {"grid": {"train.global_batch_size": [8, 16]}}}))
    assert cli.main(["plan", str(f), "--set", override]) == 2
    err = capsys.readouterr().err
    assert words in err and "fix:" in err
    assert not (tmp_path / "results").exists()


def _rows(*points, fits=True):
    """Plan rows of (predicted seconds to target, global batch) points, in predicted order: that many
    predicted steps at a predicted second each."""
    return [{"trial": f"p{i}", "overrides": json.dumps({"train.global_batch_size": batch, "train.seed": i}),
             "rank": i + 1, "global_batch_size": batch, "predicted_time_to_target_s": t,
             "predicted_steps_to_target": t, "predicted_step_time_s": 1.0, "fits": fits}
            for i, (t, batch) in enumerate(points)]


def _reach(searcher, trial_id, steps, step_s=1.0, every=5):
    """Evaluations of one trial every `every` steps (`step_s` seconds each) whose loss crosses 3.0 at
    step `steps`."""
    t = every
    while True:
        loss = 3.0 - (t - steps) / every * 0.5
        searcher.on_trial_result(trial_id, {"step": t, "wall_time_s": t * step_s, "val_loss": loss})
        if loss <= 3.0:
            return
        t += every


def test_the_searcher_trains_in_predicted_order_and_stops_once_the_leader_is_confirmed():
    from ray.tune.search import Searcher

    from raytrain_par.goodput import GoodputSearcher, GoodputStopper

    rows = _rows((10.0, 8), (12.0, 16), (30.0, 8), (40.0, 32)) + [{**_rows((5.0, 8))[0], "trial": "too-big", "fits": False}]
    s = GoodputSearcher(rows, "val_loss", "min", 3.0, min_trials=2, log=lambda *_: None)
    stop = GoodputStopper(s)
    assert s.suggest("t1")["point"]["train.global_batch_size"] == 8  # the leader; the 5 s one does not fit
    assert s.suggest("t2")["point"]["train.global_batch_size"] == 16  # min_trials: the runner-up too
    assert s.suggest("t3") is None  # nothing measured yet to decide on: wait
    _reach(s, "t1", 20)
    s.on_trial_complete("t1")
    assert s.best() == pytest.approx(20.0)
    assert s.steps_factor(8) == pytest.approx(2.0) and s.steps_factor(32) == 1.0 and s.step_time_factor() == 1.0
    # t2 has trained longer than the best time to target without reaching it: it cannot win
    assert not stop("t2", {"wall_time_s": 15.0}) and stop("t2", {"wall_time_s": 25.0})
    assert s.stopped == {"t2"}
    s.on_trial_complete("t2")
    # batch 8 takes twice the predicted steps: 30 x 2 > 20; batch 32 is unmeasured: 40 > 20. Done.
    assert s.suggest("t3") == Searcher.FINISHED


def test_each_batch_size_is_corrected_by_its_own_trials():
    """The predictions of batch 8 were 1.5x optimistic; that says nothing of batch 16's, whose leader is
    trained and wins (a correction shared by every batch would have stopped before it)."""
    from ray.tune.search import Searcher

    from raytrain_par.goodput import GoodputSearcher

    s = GoodputSearcher(_rows((10.0, 8), (11.0, 8), (14.0, 16), (20.0, 16)), "val_loss", "min", 3.0, min_trials=2,
                        log=lambda *_: None)
    for trial, steps in (("t1", 15), ("t2", 16.5)):
        assert s.suggest(trial)["point"]["train.global_batch_size"] == 8
        _reach(s, trial, steps)
        s.on_trial_complete(trial)
    assert s.best() == pytest.approx(15.0) and s.steps_factor(8) == pytest.approx(1.5)
    assert s.suggest("t3")["point"]["train.global_batch_size"] == 16  # 14 < 15
    _reach(s, "t3", 13)
    s.on_trial_complete("t3")
    assert s.steps_factor(16) == pytest.approx(13 / 14)
    assert s.suggest("t4") == Searcher.FINISHED  # 20 x 13/14 > 13


def test_a_point_that_cannot_win_does_not_hide_a_later_one_that_can():
    """Batch 8 measured 2x its predicted steps, so its next point (predicted 9 s) cannot beat the best
    (16 s) while batch 16's (predicted 12 s, not yet corrected) can: that one is trained. Once it ends
    short of the target at step 20, its batch needs at least 20 / 12 of its predicted steps and its
    last point (13 s) is not trained either."""
    from ray.tune.search import Searcher

    from raytrain_par.goodput import GoodputSearcher, GoodputStopper

    s = GoodputSearcher(_rows((8.0, 8), (9.0, 8), (12.0, 16), (13.0, 16)), "val_loss", "min", 3.0, min_trials=1,
                        log=lambda *_: None)
    stop = GoodputStopper(s)
    assert s.suggest("t1")["point"]["train.global_batch_size"] == 8
    _reach(s, "t1", 16)
    s.on_trial_complete("t1")
    assert s.steps_factor(8) == pytest.approx(2.0)
    t2 = s.suggest("t2")["point"]
    assert t2["train.global_batch_size"] == 16 and t2["train.seed"] == 2  # skipped 9 x 2 = 18 > 16
    assert s.suggest("t3") is None  # batch 16's second point waits for the first's correction
    for step in (5, 10, 15, 20):  # never reaches the target; the stopper ends it past the best 16 s
        s.on_trial_result("t2", {"step": step, "wall_time_s": float(step), "val_loss": 4.0})
    assert stop("t2", {"wall_time_s": 20.0})
    s.on_trial_complete("t2")
    assert s.steps_factor(16) == pytest.approx(20 / 12)
    assert s.suggest("t3") == Searcher.FINISHED  # 13 x 20/12 > 16, 9 x 2 > 16


def test_slower_steps_than_probed_correct_every_point_and_a_margin_keeps_the_search_going():
    from ray.tune.search import Searcher

    from raytrain_par.goodput import GoodputSearcher

    s = GoodputSearcher(_rows((10.0, 8), (12.0, 16), (13.0, 24), (30.0, 32)), "val_loss", "min", 3.0, min_trials=1,
                        margin=0.5, log=lambda *_: None)
    s.suggest("t1")
    _reach(s, "t1", 10, step_s=2.0)  # the predicted steps, each twice as long as the probe said
    s.on_trial_complete("t1")
    assert s.best() == pytest.approx(20.0) and s.step_time_factor() == pytest.approx(2.0)
    # 12 x 2 = 24 < 20 x 1.5 and 13 x 2 = 26 < 30 are worth training; 30 x 2 is not
    assert s.suggest("t2")["point"]["train.global_batch_size"] == 16
    _reach(s, "t2", 12, step_s=2.0)
    s.on_trial_complete("t2")
    assert s.suggest("t3")["point"]["train.global_batch_size"] == 24
    _reach(s, "t3", 13, step_s=2.0)
    s.on_trial_complete("t3")
    assert s.suggest("t4") == Searcher.FINISHED


@pytest.mark.parametrize("sweep,field,words", [
    ({"search": "goodput", "grid": {"train.global_batch_size": [8, 16]}, "goodput": {"min_trials": 0}},
     "sweep.goodput.min_trials", "must be >= 1"),
    ({"search": "goodput", "grid": {"train.global_batch_size": [8, 16]}, "num_samples": 2},
     "sweep.num_samples", "trains each grid point once"),
    ({"search": "goodput", "grid": {"train.global_batch_size": [8, 16]}, "early_stopping": {}},
     "sweep.early_stopping", "stops every trial"),
    ({"grid": {"train.global_batch_size": [8, 16]}, "goodput": {"margin": 0.1}}, "sweep.goodput", "search: goodput"),
    ({"search": "goodput", "grid": {"scaling.num_workers": [1, 2]}}, "sweep.grid.train.global_batch_size",
     "the search space has one"),
])
def test_a_goodput_search_is_checked_before_start(sweep, field, words):
    with pytest.raises(ConfigError) as err:
        plan(config.parse({**BASE, "sweep": sweep}))
    assert err.value.field == field and words in str(err.value) and "fix:" in str(err.value)


def test_a_goodput_search_without_a_target_is_refused_by_check(tmp_path, capsys):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "target": None,
                                 "sweep": {"search": "goodput", "grid": {"train.global_batch_size": [8, 16]}}}))
    assert cli.main(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert "sweep.search: goodput predicts the time to reach a target" in err and "fix:" in err


@pytest.mark.ray
def test_goodput_search_end_to_end(ray_cluster, tmp_path):
    """`sweep` with search: goodput: the plan (the reference trains to the target measuring the noise
    scale; one probe run times the per-worker batch it did not; every point gets a prediction), then the
    predicted leader is trained first (min_trials 1), its measured time beside the prediction, and the other
    point only where its prediction, corrected by what the leader measured, could still beat the leader."""
    from raytrain_par.metrics.records import read_records
    from raytrain_par.report import write_report
    from raytrain_par.tuning import run_sweep

    raw = {**BASE, "data": {**BASE["data"], "max_val_samples": 16}, "output_dir": str(tmp_path),
           "train": {"global_batch_size": 16, "max_steps": 15, "eval_every_steps": 3, "lr": 3e-3,
                     "checkpoint_every_evals": 0},
           "target": "val_loss <= 5.4", "sweep": {"grid": {"train.global_batch_size": [8, 16]}, "lr_scaling": "sqrt",
                                                  "search": "goodput", "goodput": {"min_trials": 1}}}
    lines = []
    result = run_sweep(config.parse(raw), log=lambda m: (lines.append(str(m)), print(m)))
    ref = read_records(tmp_path / "g" / "plan" / "reference" / "metrics.parquet")
    assert ref[-1]["target_met"] and all(r["grad_noise_scale"] > 0 for r in ref if r["step"] > 0)
    rows = read_records(tmp_path / "g" / "plan.parquet")
    assert len(rows) == 2 and rows[0]["predicted_time_to_target_s"] <= rows[1]["predicted_time_to_target_s"]
    by = {r["trial"]: r for r in rows}
    for r in rows:
        assert r["predicted_time_to_target_s"] == pytest.approx(r["predicted_steps_to_target"]
                                                                * r["predicted_step_time_s"])
        assert r["step_time_probed"] and r["memory_per_worker_bytes"] > 0
    # one probe run on two workers times the smallest and largest per-worker batch; the fit lies between
    written = json.loads((tmp_path / "g" / "plan" / "probes" / "probe-w2.json").read_text())
    probed, busy = written["step_times"], written["background_cores"]
    assert sorted(probed) == ["ddp-w2-local4", "ddp-w2-local8"] and min(probed.values()) > 0
    assert sorted(busy) == sorted(probed) and all(0 <= b <= os.cpu_count() for b in busy.values())
    for r in rows:
        assert min(probed.values()) - 1e-9 <= r["predicted_step_time_s"] <= max(probed.values()) + 1e-9
    # the reference's batch: its own steps, efficiency 1; a smaller batch: more steps, each row worth more
    reference_steps = ref[-1]["step"]
    assert ref[-2]["step"] < by["b16"]["predicted_steps_to_target"] <= reference_steps
    assert by["b16"]["statistical_efficiency"] == 1.0 < by["b8"]["statistical_efficiency"]
    assert by["b8"]["predicted_steps_to_target"] > by["b16"]["predicted_steps_to_target"]
    # the leader trained first, to its target and no further; the other point trained only where its
    # corrected prediction (both points' seconds per step scale by what the leader's steps took, on this
    # machine often several times the probe's) is below the leader's measured time, else it is in
    # trials.parquet, untrained
    trials = {r["trial"].split("-", 1)[-1]: r for r in read_records(tmp_path / "g" / "trials.parquet")}
    leader, other = rows[0]["trial"], rows[1]["trial"]
    assert trials[leader]["target_reached"] and trials[leader]["time_to_target_s"] > 0
    assert trials[leader]["predicted_time_to_target_s"] == pytest.approx(rows[0]["predicted_time_to_target_s"])
    assert trials[leader]["predicted_rank"] == 1 and trials[other]["predicted_rank"] == 2
    started = [m for m in lines if m.startswith("goodput search: training ")]
    assert started[0].startswith(f"goodput search: training {leader} ")
    if len(started) == 1:
        assert trials[other]["status"] == "not trained: predicted slower than the best"
        assert {r["trial"] for r in result.records} == {trials[leader]["trial"]}
    else:
        corrected = float(re.search(r"([0-9.]+) s corrected", started[1]).group(1))
        assert started[1].startswith(f"goodput search: training {other} ")
        assert corrected <= round(trials[leader]["time_to_target_s"], 1) and trials[other]["status"] == "completed"
    files = write_report(tmp_path / "g")
    assert (tmp_path / "g" / "predicted_vs_measured.png") in files
    assert "Predicted (`search: goodput`) against measured" in (tmp_path / "g" / "summary.md").read_text()


@pytest.mark.ray
def test_a_plan_probing_one_worker_models_the_two_worker_points(ray_cluster, tmp_path):
    """`plan --probe-workers 1`: one probe run on one worker only; the two-worker points take the step model
    calibrated on it (each strategy's achievable fraction, the machine's other processes' cores), as
    Calibrated says, and the one-worker points their probed steps."""
    from raytrain_par.goodput import make_plan

    raw = {**BASE, "data": {**BASE["data"], "max_val_samples": 16}, "output_dir": str(tmp_path),
           "train": {"global_batch_size": 16, "max_steps": 15, "eval_every_steps": 3, "lr": 3e-3,
                     "checkpoint_every_evals": 0},
           "target": "val_loss <= 5.4",
           "sweep": {"grid": {"scaling.num_workers": [1, 2], "train.global_batch_size": [8, 16]}, "lr_scaling": "sqrt"}}
    result = make_plan(config.parse(raw), probe_workers=[1], log=print)
    assert sorted(p.name for p in (tmp_path / "g" / "plan" / "probes").glob("*.json")) == ["probe-w1.json"]
    probed = json.loads((tmp_path / "g" / "plan" / "probes" / "probe-w1.json").read_text())["step_times"]
    assert 0 < result.achievable["ddp"] <= 1 and 0 <= result.background_cores <= os.cpu_count()
    by = {(r["num_workers"], r["global_batch_size"]): r for r in result.rows}
    for (workers, batch), r in by.items():
        assert r["step_time_from"] == ("probed" if workers == 1 else "model")
        assert r["predicted_time_to_target_s"] == pytest.approx(r["predicted_steps_to_target"]
                                                                * r["predicted_step_time_s"])
    assert by[1, 8]["predicted_step_time_s"] == pytest.approx(probed["ddp-w1-local8"])
    # two workers compute half the rows each: a shorter step than one worker's at the same batch
    assert 0 < by[2, 16]["predicted_step_time_s"] < by[1, 16]["predicted_step_time_s"]


def test_a_probe_reads_its_median_step_so_one_step_the_host_slows_does_not_count(info, monkeypatch):
    """The throughput probe times each step and takes the median: one step stalled by a second (the host
    busy elsewhere) leaves it near the others, where the window's mean would be over 0.2 s a step."""
    import time

    import torch

    from raytrain_par import strategies, worker
    from raytrain_par.data.shards import DatasetInfo, read_split
    from raytrain_par.strategies import DistContext

    built = strategies.build_engine

    def stalling(*args, **kwargs):
        engine = built(*args, **kwargs)
        step, calls = engine.train_step, []

        def train_step(batch):
            calls.append(1)
            if len(calls) == 4:  # the second timed step
                time.sleep(1.0)
            return step(batch)

        engine.train_step = train_step
        return engine

    monkeypatch.setattr(strategies, "build_engine", stalling)
    spec = config.from_dict(experiment(batch=4))
    data_info = DatasetInfo.from_json(info("kjv"))
    seconds, background = worker.time_steps(spec, data_info, DistContext(), read_split(data_info, data_info.train_path),
                                            warmup=2, steps=5)
    assert 0 < seconds < 0.2 and background >= 0
    assert not torch.distributed.is_initialized()
