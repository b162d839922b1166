"""Random and Optuna search through Ray Tune: each draws the learning rate of every trial from the
sweep's range, and each trial trains with the value it drew."""

import pytest
import yaml

from raytrain_par.config import load_experiment
from raytrain_par.tuning import run_sweep

pytestmark = pytest.mark.ray

LOW, HIGH = 1e-4, 1e-2


@pytest.mark.parametrize("search", ["random", "optuna"])
def test_sampled_learning_rates_are_drawn_from_the_range_and_trained_with(ray_cluster, tmp_path, search):
    f = tmp_path / "search.yaml"
    f.write_text(yaml.safe_dump({
        "name": "search", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "max_val_samples": 16},
        "scaling": {"num_workers": 1},
        "train": {"global_batch_size": 8, "max_steps": 2, "eval_every_steps": 1, "lr": 1e-3, "warmup_steps": 0,
                  "lr_schedule": "constant", "checkpoint_every_evals": 0},
        "output_dir": str(tmp_path),
        "sweep": {"random": {"train.lr": {"min": LOW, "max": HIGH, "log": True}}, "search": search,
                  "num_samples": 2, "max_concurrent_trials": 1}}))
    result = run_sweep(load_experiment(f), log=lambda *_: None)
    assert len(result.trials) == 2 and all(t["status"] == "completed" for t in result.trials)
    lrs = [t["lr"] for t in result.trials]
    assert len(set(lrs)) == 2 and all(LOW <= lr <= HIGH for lr in lrs)
    for t in result.trials:
        trained = [r["lr"] for r in result.records if r["trial"] == t["trial"] and r["step"] > 0]
        assert trained and trained == pytest.approx([t["lr"]] * len(trained)), t["trial"]
