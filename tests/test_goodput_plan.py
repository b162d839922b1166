"""`raytrain-par plan`: steps to the target from one reference run's noise scale, the prediction of
every sweep point, bad input refused before start, and one plan end to end on the shared Ray cluster."""

import json

import pytest
import yaml

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
    ({"name": "pipeline", "stages": 2}, 4, "fp32", ("ddp", 4, "fp32")),
    ({"name": "ddp"}, 1, "fp32", ("ddp", 2, "fp32")),
    ({"name": "zero-1"}, 2, "fp16", ("ddp", 2, "fp32")),  # loss-scaled gradients
], ids=["zero-2", "fsdp", "megatron-t2-d2", "megatron-t2-d1", "pipeline", "ddp-alone", "zero-1-fp16"])
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


@pytest.mark.ray
def test_plan_end_to_end(ray_cluster, tmp_path):
    """The reference trains to the target measuring the noise scale and times its own layout; one probe
    run times the per-worker batch it did not; every point gets a prediction."""
    from raytrain_par.goodput import make_plan
    from raytrain_par.metrics.records import read_records

    raw = {**BASE, "data": {**BASE["data"], "max_val_samples": 16}, "output_dir": str(tmp_path),
           "train": {"global_batch_size": 16, "max_steps": 15, "eval_every_steps": 3, "lr": 3e-3,
                     "checkpoint_every_evals": 0},
           "target": "val_loss <= 5.4", "sweep": {"grid": {"train.global_batch_size": [8, 16]}, "lr_scaling": "sqrt"}}
    result = make_plan(config.parse(raw), log=print)
    ref = read_records(tmp_path / "g" / "plan" / "reference" / "metrics.parquet")
    assert ref[-1]["target_met"] and all(r["grad_noise_scale"] > 0 for r in ref if r["step"] > 0)
    assert ref[-2]["step"] < result.reference.steps <= ref[-1]["step"] and result.reference.noise_scale > 0
    rows = read_records(tmp_path / "g" / "plan.parquet")
    assert [r["trial"] for r in rows] == [r["trial"] for r in result.rows] and len(rows) == 2
    by = {r["trial"]: r for r in rows}
    for r in rows:
        assert r["predicted_time_to_target_s"] == pytest.approx(r["predicted_steps_to_target"]
                                                                * r["predicted_step_time_s"])
        assert r["step_time_probed"] and r["memory_per_worker_bytes"] > 0
    # one probe run on two workers times the smallest and largest per-worker batch; the fit lies between
    probed = json.loads((tmp_path / "g" / "plan" / "probes" / "probe-w2.json").read_text())
    assert sorted(probed) == ["ddp-w2-local4", "ddp-w2-local8"] and min(probed.values()) > 0
    for r in rows:
        assert min(probed.values()) - 1e-9 <= r["predicted_step_time_s"] <= max(probed.values()) + 1e-9
    # the reference's batch: its own steps, efficiency 1; a smaller batch: more steps, each row worth more
    assert by["b16"]["predicted_steps_to_target"] == pytest.approx(result.reference.steps)
    assert by["b16"]["statistical_efficiency"] == 1.0 < by["b8"]["statistical_efficiency"]
    assert by["b8"]["predicted_steps_to_target"] > by["b16"]["predicted_steps_to_target"]
