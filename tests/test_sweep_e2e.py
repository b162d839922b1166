"""Sweeps through Ray Tune on the session's shared cluster: one stopped early by ASHA, one searched by Optuna."""

import json
import time

import pytest
import ray
import yaml

from raytrain_par import cli
from raytrain_par.config import load_experiment
from raytrain_par.metrics.records import read_records
from raytrain_par.tuning import run_sweep

pytestmark = pytest.mark.ray


def test_asha_stops_a_poor_trial_and_frees_its_resources(ray_cluster, tmp_path, capsys):
    """`raytrain-par sweep` as typed: two trials one after the other; the second (a learning rate far
    too small) falls behind the first at ASHA's first rung and is stopped, and its placement group is
    freed. Each grid point also draws its weight decay from a range (the random search's sampling)."""
    f = tmp_path / "asha.yaml"
    f.write_text(yaml.safe_dump({
        "name": "asha", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "max_val_samples": 16},
        "scaling": {"num_workers": 1},
        "train": {"global_batch_size": 8, "max_steps": 10, "eval_every_steps": 2, "lr": 3e-3,
                  "checkpoint_every_evals": 0},
        "target": "val_loss <= 5.0", "output_dir": str(tmp_path),
        "sweep": {"grid": {"train.lr": [3e-3, 1e-7]}, "random": {"train.weight_decay": {"min": 0.0, "max": 0.01}},
                  "max_concurrent_trials": 1,
                  "early_stopping": {"grace_period_s": 0.5, "reduction_factor": 2}}}))
    assert cli.main(["sweep", str(f)]) == 0  # on the session's cluster, which the command joins
    out = capsys.readouterr().out
    assert "asha: sweep of 2 trial(s), 1 at a time" in out and "trials in " in out
    trials = read_records(tmp_path / "asha" / "trials.parquet")
    by_lr = {t["lr"]: t for t in trials}
    assert by_lr[1e-7]["status"] == "stopped early" and by_lr[1e-7]["steps"] < 10
    assert by_lr[3e-3]["status"] == "completed" and by_lr[3e-3]["steps"] == 10
    decays = [json.loads(t["overrides"])["train.weight_decay"] for t in trials]
    assert len(set(decays)) == 2 and all(0.0 <= d <= 0.01 for d in decays)
    # The stopped trial's workers' placement group is removed (Ray Train's cleaner polls every second).
    deadline = time.time() + 30
    while (left := [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]) \
            and time.time() < deadline:
        time.sleep(1)
    assert left == []


def test_optuna_draws_each_trials_learning_rate_from_the_range_and_the_trial_trains_with_it(ray_cluster, tmp_path):
    """Optuna's searcher through Ray Tune (random sampling runs in the ASHA test above): every trial's
    learning rate comes from the sweep's range, and the trial trains with the value drawn."""
    low, high = 1e-4, 1e-2
    f = tmp_path / "optuna.yaml"
    f.write_text(yaml.safe_dump({
        "name": "optuna", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "max_val_samples": 16},
        "scaling": {"num_workers": 1},
        "train": {"global_batch_size": 8, "max_steps": 2, "eval_every_steps": 1, "lr": 1e-3, "warmup_steps": 0,
                  "lr_schedule": "constant", "checkpoint_every_evals": 0},
        "output_dir": str(tmp_path),
        "sweep": {"random": {"train.lr": {"min": low, "max": high, "log": True}}, "search": "optuna",
                  "num_samples": 2, "max_concurrent_trials": 2}}))
    result = run_sweep(load_experiment(f), log=lambda *_: None)
    assert len(result.trials) == 2 and all(t["status"] == "completed" for t in result.trials)
    lrs = [t["lr"] for t in result.trials]
    assert len(set(lrs)) == 2 and all(low <= lr <= high for lr in lrs)
    for t in result.trials:
        trained = [r["lr"] for r in result.records if r["trial"] == t["trial"] and r["step"] > 0]
        assert trained and trained == pytest.approx([t["lr"]] * len(trained)), t["trial"]


def test_a_sweep_trains_an_adaptive_point_beside_a_fixed_batch(ray_cluster, tmp_path):
    """`train.adaptive_batch: [null, {...}]` in a sweep's grid: two trials through Ray Tune, one at the fixed
    batch, one whose batch grows from it (short rows: the noise scale is above the starting batch from the
    first steps); each trial's records and its row in trials.parquet say which it was."""
    f = tmp_path / "adaptive.yaml"
    f.write_text(yaml.safe_dump({
        "name": "adaptive", "model": {"name": "gpt2-tiny"},
        "data": {"name": "kjv", "seq_len": 32, "vocab_size": 512, "max_val_samples": 32},
        "scaling": {"num_workers": 2},
        "train": {"global_batch_size": 8, "max_steps": 9, "eval_every_steps": 3, "warmup_steps": 2, "lr": 2e-3,
                  "checkpoint_every_evals": 0},
        "output_dir": str(tmp_path),
        "sweep": {"grid": {"train.adaptive_batch": [None, {"max_global_batch_size": 64}]},
                  "max_concurrent_trials": 1}}))
    result = run_sweep(load_experiment(f), log=lambda *_: None)
    trials = {t["trial"].split("-", 1)[1]: t for t in result.trials}  # after Tune's trial counter
    assert set(trials) == {"adaptive-fixed", "adaptive-64"}
    assert all(t["status"] == "completed" for t in trials.values())
    records = {name: [r for r in result.records if r["trial"] == t["trial"]] for name, t in trials.items()}
    assert {r["global_batch_size"] for r in records["adaptive-fixed"]} == {8}
    assert all(r.get("batch_decision") is None for r in records["adaptive-fixed"])
    batches = [r["global_batch_size"] for r in records["adaptive-64"]]
    assert batches[0] == 8 and max(batches) > 8  # explored, then chose
    assert records["adaptive-64"][-1]["progress"] >= 9 and records["adaptive-64"][-1]["step"] < 9
