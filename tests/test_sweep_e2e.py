"""Sweeps through Ray Tune on the session's shared cluster, and the report drawn from them."""

import time

import pytest
import ray
import yaml

from conftest import experiment_file
from raytrain_par.config import load_experiment
from raytrain_par.metrics.efficiency import crossing
from raytrain_par.report import write_report
from raytrain_par.tuning import run_sweep

pytestmark = pytest.mark.ray


def test_workers_by_batch_sweep_and_report(ray_cluster, tmp_path):
    spec = load_experiment(experiment_file("sweep-workers-batch.yaml"), [
        "train.max_steps=4", "train.eval_every_steps=2", "data.max_val_samples=16", "target=val_perplexity <= 6500",
        "sweep.max_concurrent_trials=2", f"output_dir={tmp_path}"])
    result = run_sweep(spec, log=lambda *_: None)
    trials = {t["trial"].split("-", 1)[1]: t for t in result.trials}
    assert set(trials) == {"w1-b16", "w1-b32", "w2-b16", "w2-b32"}
    assert all(t["status"] == "completed" for t in trials.values())
    for name, t in trials.items():
        records = [r for r in result.records if r["trial"] == t["trial"]]
        assert [r["step"] for r in records] == [0, 2, 4]
        # time-to-target agrees with the trial's own records, and lies between two evaluations
        assert t["time_to_target_s"] == crossing(records, "val_perplexity", 6500.0, "min", "wall_time_s")
        if t["time_to_target_s"] is not None:
            assert 0 <= t["time_to_target_s"] <= records[-1]["wall_time_s"]
        # hardware efficiency over the run: all model FLOPs over all training time, against the probe
        last = records[-1]
        assert t["mfu"] == pytest.approx(last["model_flops_per_step"] * 4 / last["wall_time_s"]
                                         / last["num_workers"] / (last["peak_tflops"] * 1e12))
        assert 0 < t["mfu"] <= 1 and t["comm_fraction"] is not None and 0 <= t["comm_fraction"] < 1
    # same global batch, same losses, whatever the worker count; lr follows the batch (sqrt rule)
    assert trials["w1-b32"]["final_val_loss"] == pytest.approx(trials["w2-b32"]["final_val_loss"], abs=1e-5)
    assert trials["w1-b16"]["lr"] == pytest.approx(trials["w1-b32"]["lr"] / 2 ** 0.5)
    assert (tmp_path / "sweep-workers-batch" / "trials.parquet").exists()

    files = write_report(tmp_path / "sweep-workers-batch")
    for f in files:
        assert f.stat().st_size > 1000, f
    assert "mfu.png" in {f.name for f in files}
    summary = files[-1].read_text()
    assert all(name in summary for name in trials) and "time to target" in summary and "MFU %" in summary


def test_asha_stops_a_poor_trial_and_frees_its_resources(ray_cluster, tmp_path):
    """Three trials one after another; the middle one (a learning rate far too small) falls behind
    the first at ASHA's first rung and is stopped; its placement group is freed and the third runs."""
    f = tmp_path / "asha.yaml"
    f.write_text(yaml.safe_dump({
        "name": "asha", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "max_val_samples": 16},
        "scaling": {"num_workers": 1},
        "train": {"global_batch_size": 8, "max_steps": 10, "eval_every_steps": 2, "lr": 3e-3,
                  "checkpoint_every_evals": 0},
        "target": "val_loss <= 5.0", "output_dir": str(tmp_path),
        "sweep": {"grid": {"train.lr": [3e-3, 1e-7, 2e-3]}, "max_concurrent_trials": 1,
                  "early_stopping": {"grace_period_s": 0.5, "reduction_factor": 2}}}))
    result = run_sweep(load_experiment(f), log=lambda *_: None)
    by_lr = {t["lr"]: t for t in result.trials}
    assert by_lr[1e-7]["status"] == "stopped early" and by_lr[1e-7]["steps"] < 10
    assert by_lr[3e-3]["status"] == "completed" and by_lr[3e-3]["steps"] == 10
    assert by_lr[2e-3]["evaluations"] >= 2  # the trial after the stopped one still ran
    # The stopped trial's workers' placement group is removed (Ray Train's cleaner polls every second).
    deadline = time.time() + 30
    while (left := [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]) \
            and time.time() < deadline:
        time.sleep(1)
    assert left == []

