"""Sweep blocks: expansion into trials, the learning-rate rule, and bad sweeps refused before start."""

import math

import pytest
import yaml

from raytrain_par import config
from raytrain_par.errors import ConfigError
from raytrain_par.sweep import describe, plan

BASE = {"name": "s", "model": "gpt2-tiny", "data": "kjv", "scaling": {"num_workers": 2},
        "train": {"global_batch_size": 32, "max_steps": 10, "lr": 1e-3}, "target": "val_perplexity <= 300"}


def spec_with(sweep):
    return config.parse({**BASE, "sweep": sweep})


def test_grid_times_cases_and_lr_scaling():
    p = plan(spec_with({"grid": {"scaling.num_workers": [1, 2], "train.global_batch_size": [16, 64]},
                        "lr_scaling": "sqrt"}))
    assert len(p.points) == 4
    assert (p.metric, p.mode, p.target) == ("val_perplexity", "min", 300.0)
    lrs = {(pt["scaling.num_workers"], pt["train.global_batch_size"]): p.trial_spec(pt).train.lr for pt in p.points}
    assert lrs[(1, 16)] == pytest.approx(1e-3 * math.sqrt(0.5))
    assert lrs[(2, 64)] == pytest.approx(1e-3 * math.sqrt(2))
    linear = plan(spec_with({"grid": {"train.global_batch_size": [64]}, "lr_scaling": "linear"}))
    assert linear.trial_spec(linear.points[0]).train.lr == pytest.approx(2e-3)
    cases = plan(spec_with({"cases": [{"scaling.num_workers": 1, "train.global_batch_size": 16},
                                      {"scaling.num_workers": 2, "train.global_batch_size": 32}],
                            "grid": {"train.lr": [1e-3, 2e-3]}}))
    assert len(cases.points) == 4 and cases.trial_cpus == 2
    assert describe(cases.points[0]) == "w1-b16-lr0.001"


@pytest.mark.parametrize("sweep,field,words", [
    ({"grid": {"train.lrr": [1, 2]}}, "train.lrr", "did you mean 'lr'"),
    ({"grid": {"scaling.num_workers": [3]}}, "train.global_batch_size", "multiple of 3"),
    ({"grid": {"scaling.num_workers": []}}, "sweep.grid.scaling.num_workers", "non-empty list"),
    ({}, "sweep", "the search space is empty"),
    ({"grid": {"strategy.name": ["ddp", "zero-9"]}}, "strategy.name", "unknown strategy"),
    ({"random": {"train.lr": {"min": 1e-2, "max": 1e-4}}}, "sweep.random.train.lr", "min <= max"),
    ({"random": {"train.lr": {"min": -1.0, "max": 1e-4}}}, "train.lr", "must be > 0"),
    ({"grid": {"scaling.num_workers": [1]}, "metric": "val_bleu"}, "sweep.metric", "does not produce"),
    ({"grid": {"scaling.num_workers": [1]}, "searchh": "grid"}, "sweep.searchh", "did you mean 'search'"),
    ({"grid": {"scaling.host_allocator": ["caching", "system"]}}, "scaling.host_allocator", "one Ray job"),
])
def test_bad_sweep_is_refused(sweep, field, words):
    with pytest.raises(ConfigError) as err:
        plan(spec_with(sweep))
    assert err.value.field.endswith(field) and words in str(err.value) and "fix:" in str(err.value)


def test_target_metric_the_model_does_not_produce():
    raw = {**BASE, "model": {"name": "vgg11", "width": 0.25}, "data": "digits", "target": None,
           "sweep": {"grid": {"scaling.num_workers": [1, 2]}, "metric": "val_perplexity"}}
    with pytest.raises(ConfigError, match="vgg11 does not produce it"):
        plan(config.parse(raw))


@pytest.mark.parametrize("sweep,words", [
    ("{grid: {train.nothing: [1, 2]}}", "sweep trial nothing=1: train.nothing"),
    ("{grid: {}}", "the search space is empty"),
])
def test_check_refuses_a_sweep_block_that_sweep_refuses(sweep, words, tmp_path, capsys):
    from raytrain_par import cli

    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(BASE))
    assert cli.main(["check", str(f), "--set", "sweep={grid: {train.global_batch_size: [16, 32]}}"]) == 0
    assert "train.global_batch_size:\n    - 16" in capsys.readouterr().out
    assert cli.main(["check", str(f), "--set", f"sweep={sweep}"]) == 2
    err = capsys.readouterr().err
    assert words in err and "fix:" in err


def test_the_sweeps_log_pickles_after_ray_replaces_print(monkeypatch):
    """Tune pickles a sweep's log function (with its callbacks and searcher); Ray replaces builtins.print
    when its progress bars start (tqdm_ray), after which the `print` a default argument took fails to
    pickle, and `raytrain-par sweep` failed before its first trial."""
    import builtins
    import inspect

    from ray import cloudpickle

    from raytrain_par import goodput, tuning

    monkeypatch.setattr(builtins, "print", lambda *a, **k: None)
    for f in (tuning.run_sweep, tuning.SweepRecorder, goodput.make_plan, goodput.GoodputSearcher):
        log = inspect.signature(f).parameters["log"].default
        assert cloudpickle.loads(cloudpickle.dumps(log)) is log, f
