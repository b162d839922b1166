"""The experiment spec: overrides, defaults, and a table of bad inputs that must each be refused
before anything starts, with the field, the value and the fix in the message."""

import copy
import os
import sys

import pytest
import yaml

from raytrain_par import cli, config, driver
from raytrain_par.data import text
from raytrain_par.errors import ConfigError, DataUnavailable

BASE = {
    "name": "t",
    "model": {"name": "gpt2-tiny"},
    "data": {"name": "kjv"},
    "strategy": {"name": "ddp"},
    "scaling": {"num_workers": 2},
    "train": {"global_batch_size": 32, "max_steps": 10, "lr": 1e-3},
    "target": {"metric": "val_perplexity", "value": 200},
}


def with_(path: str, value):
    raw = copy.deepcopy(BASE)
    node = raw
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return raw


class _Delete:
    def __repr__(self):
        return "<deleted>"


DELETE = _Delete()

BAD = [
    # (mutation path, value, field named in the error, words of the problem or fix)
    ("train.lrr", 0.1, "train.lrr", "did you mean 'lr'"),
    ("epochs", 3, "epochs", "unknown key"),
    ("train.lr", "fast", "train.lr", "expected a number"),
    ("train.lr", -0.1, "train.lr", "must be > 0"),
    ("train.max_steps", 0, "train.max_steps", "must be >= 1"),
    ("train.global_batch_size", 33, "train.global_batch_size", "multiple of 2"),
    ("train.optimizer", "adam_w", "train.optimizer", "did you mean 'adamw'"),
    ("train.betas", [0.9], "train.betas", "two numbers"),
    ("train.eval_every_steps", True, "train.eval_every_steps", "expected an integer"),
    ("strategy.name", "zero-9", "strategy.name", "unknown strategy"),
    ("strategy.bucket_cap_mb", -1, "strategy.bucket_cap_mb", "must be > 0"),
    ("strategy.buckets", 3, "strategy.buckets", "unknown key"),
    ("model.name", "gpt3", "model.name", "unknown model"),
    ("model.n_head", 3, "model.n_head", "not divisible"),
    ("model.dropout", 1.5, "model.dropout", "[0, 1)"),
    ("model.width", 0.5, "model.width", "only vgg11, vgg16 models"),
    ("model.image_size", 32, "model.image_size", "only vgg11, vgg16 models"),
    ("model", DELETE, "model", "required key is missing"),
    ("data.name", "fashion-mnist", "data.name", "trains on text data"),
    ("data.name", "wikitext-103", "data.path", "directory"),
    ("data.name", "text", "data.path", "a glob such as"),
    ("data.format", "csv", "data.format", "'txt', 'jsonl', 'parquet'"),
    ("data.format", "jsonl", "data.format", "kjv does not read it; sets that do: text"),
    ("data.field", "body", "data.field", "kjv does not read it"),
    ("data.tokenizer", "/models/gpt2", "data.tokenizer", "sets that do: wikitext-103, text"),
    ("data.seq_len", 1, "data.seq_len", "must be >= 2"),
    ("data.loader", "disk", "data.loader", "'memory', 'stream'"),
    ("scaling.num_workers", 0, "scaling.num_workers", "must be >= 1"),
    ("scaling.num_workers", [3, 1], "scaling.num_workers", "MIN 3 is greater than MAX 1\n  fix: write [1, 3]"),
    ("scaling.num_workers", [0, 2], "scaling.num_workers", "MIN must be >= 1"),
    ("scaling.num_workers", [1, 2, 4], "scaling.num_workers", "two integers [MIN, MAX]"),
    ("scaling.num_workers", [1, 3], "scaling.num_workers", "3 cannot (on 3 workers, train.global_batch_size = 32: "
     "does not split evenly over 3 data-parallel workers x 1 accumulation steps)\n  fix: use a global batch every "
     "count splits, a multiple of 6 (e.g. 36), or a range whose every count works, e.g. [1, 2]"),
    ("scaling.backend", "nccl", "scaling.backend", "NCCL needs GPUs"),
    ("target.metric", "val_bleu", "target.metric", "does not produce"),
    ("target.value", -5, "target.value", "must be > 0"),
    ("name", "my/run", "name", "letters, digits"),
]


@pytest.mark.parametrize("path,value,field,words", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_config_is_refused_with_field_value_and_fix(path, value, field, words):
    with pytest.raises(ConfigError) as err:
        config.parse(with_(path, value))
    e = err.value
    assert e.field == field
    assert words in str(e)
    assert "fix:" in str(e)
    if field == path and value is not DELETE:
        assert e.value == value and f"{field} = {value!r}" in str(e)


@pytest.mark.parametrize("change,field,words", [
    # Ray Train may choose 3 workers, which do not make whole pipelines or tensor-parallel groups of 2
    ({"strategy": {"name": "pipeline", "stages": 2}}, "scaling.num_workers",
     "3 cannot (on 3 workers: does not split into pipelines of 2 stages"),
    ({"strategy": {"name": "megatron", "tensor_parallel": 2}}, "scaling.num_workers",
     "only 2, 4 of these work, and Ray Train may choose any count in the range: use a fixed number of workers"),
    ({"train": {**BASE["train"], "checkpoint_every_evals": 0}}, "train.checkpoint_every_evals",
     "resizes by restarting from its latest checkpoint"),
    ({"scaling": {"num_workers": [2, 4], "resize_interval_s": -1}}, "scaling.resize_interval_s", "must be >= 0"),
])
def test_bad_elastic_range_is_refused(change, field, words):
    raw = {**BASE, "scaling": {"num_workers": [2, 4]}, **change}
    with pytest.raises(ConfigError) as err:
        config.parse(raw)
    assert err.value.field == field and words in str(err.value) and "fix:" in str(err.value)


def test_elastic_range_streams_the_same_batches_at_any_size():
    """The stream loader's rows depend on the seed, the step and the global batch, not on the worker
    count: an elastic run may stream."""
    for strategy in ("ddp", "zero-3"):
        spec = config.parse({**BASE, "data": {"name": "kjv", "loader": "stream"}, "strategy": {"name": strategy},
                             "scaling": {"num_workers": [1, 4]}, "train": {**BASE["train"], "global_batch_size": 48}})
        assert spec.data.effective_loader == "stream" and list(spec.scaling.worker_counts) == [1, 2, 3, 4]


def test_elastic_range_round_trips_and_reaches_ray():
    spec = config.parse({**BASE, "scaling": {"num_workers": [1, 4], "resize_interval_s": 5},
                         "train": {**BASE["train"], "global_batch_size": 48}})  # splits over 1, 2, 3 and 4
    s = spec.scaling
    assert (s.min_workers, s.num_workers, list(s.worker_counts)) == (1, 4, [1, 2, 3, 4])
    assert spec.to_dict()["scaling"]["num_workers"] == [1, 4]
    assert config.from_dict(spec.to_dict()) == spec  # what workers receive is the same range
    assert s.at(3).num_workers == 3 and not s.at(3).elastic  # a worker group of the moment: a fixed count
    ray_scaling = driver.scaling_config(s)
    assert ray_scaling.elasticity_enabled and (ray_scaling.min_workers, ray_scaling.max_workers) == (1, 4)
    assert ray_scaling.elastic_resize_monitor_interval_s == 5
    fixed = config.parse(BASE).scaling
    assert not fixed.elastic and list(fixed.worker_counts) == [2] and fixed.to_dict()["num_workers"] == 2


def test_target_metric_must_be_produced_by_the_model():
    raw = with_("model", {"name": "vgg11", "width": 0.25})
    raw["data"] = {"name": "digits"}
    raw["target"] = "val_perplexity <= 10"
    with pytest.raises(ConfigError, match="vgg11 does not produce it"):
        config.parse(raw)


def test_overrides_and_defaults(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(BASE))
    spec = config.load_experiment(f, ["train.max_steps=20", "scaling.num_workers=1", "strategy.bucket_cap_mb=50",
                                      "target=val_loss <= 3.5", "train.lr=2e-3"], check_data=False)
    assert spec.train.max_steps == 20 and spec.scaling.num_workers == 1 and spec.train.lr == 2e-3
    assert spec.strategy.options.bucket_cap_mb == 50.0
    assert (spec.target.metric, spec.target.value, spec.target.mode) == ("val_loss", 3.5, "min")
    assert spec.per_worker_batch == 32 and spec.scaling.effective_backend == "gloo"
    assert config.from_dict(spec.to_dict()) == spec  # what workers receive is the same experiment
    assert spec.total_steps(steps_per_epoch=100) == 20
    spec.train.max_steps, spec.train.epochs = None, 2
    assert spec.total_steps(steps_per_epoch=100) == 200


@pytest.mark.parametrize("override,words", [
    ("train.lr", "expected KEY=VALUE"),
    ("epoch=3", "not a top-level key"),
    ("train.lr.x=3", "train.lr is not a mapping"),
    ("train.lr=[1", "not valid YAML"),
])
def test_bad_override(override, words, tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        config.load_experiment(f, [override], check_data=False)


def test_malformed_yaml_names_the_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: t\nmodel: {name: gpt2-tiny\ndata: kjv\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        config.load_experiment(f, check_data=False)


def test_missing_data_package_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(text, "BIBLE_DATA", tmp_path / "no-bible.data")
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(BASE))
    with pytest.raises(DataUnavailable, match="apt-get install -y bible-kjv"):
        config.load_experiment(f)


@pytest.mark.parametrize("overrides", [["train.lr=-1"], ["scaling.num_workers=3"], ["strategy.name=zero-9"],
                                       ["data.name=wikitext-103"]])
def test_cli_refuses_before_anything_starts(overrides, monkeypatch, tmp_path, capsys):
    def no_cluster(*a, **k):
        raise AssertionError("a Ray cluster was started for a bad experiment")

    monkeypatch.setattr(driver, "ray_cluster", no_cluster)
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "results")}))
    args = ["run", str(f)] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err
    assert not (tmp_path / "results").exists()


def test_resume_without_earlier_run_is_refused(tmp_path):
    spec = config.parse({**BASE, "output_dir": str(tmp_path)})
    with pytest.raises(Exception, match="holds no earlier run"):
        driver.prepare_results_dir(spec, resume=True)


def test_new_run_moves_earlier_results_aside(tmp_path):
    spec = config.parse({**BASE, "output_dir": str(tmp_path)})
    first = driver.prepare_results_dir(spec, resume=False)
    (first / "metrics.parquet").write_text("earlier")
    driver.prepare_results_dir(spec, resume=False)
    archived = [p for p in tmp_path.iterdir() if p.name.startswith("t.")]
    assert len(archived) == 1 and (archived[0] / "metrics.parquet").read_text() == "earlier"
    assert not (tmp_path / "t" / "metrics.parquet").exists()


def test_each_run_notes_its_command_and_commit_beside_its_records(tmp_path, monkeypatch):
    """What `report` labels its pages with: every run (and resumed run) of a results directory adds its
    command, commit, date and machine to the directory's provenance.json, which moves aside with it."""
    from raytrain_par import provenance, report

    monkeypatch.setattr(sys, "argv", ["/x/.venv/bin/raytrain-par", "run", "e.yaml", "--set", "train.lr=0.1"])
    spec = config.parse({**BASE, "output_dir": str(tmp_path)})
    assert "do not name the run" in report.provenance_text(tmp_path)  # records older than the note
    first = driver.prepare_results_dir(spec, resume=False)
    provenance.record_run(first)  # as `--resume` adds its own
    runs = provenance.runs_of(first)
    assert [r["command"] for r in runs] == ["raytrain-par run e.yaml --set train.lr=0.1"] * 2
    assert runs[0]["commit"] == provenance.commit() and runs[0]["machine"]["cpu_count"] == os.cpu_count()
    text = report.provenance_text(first)
    assert text.count("`raytrain-par run e.yaml --set train.lr=0.1` (started ") == 2
    assert provenance.GENERATED_MARK in text and "Report written by `raytrain-par run e.yaml" in text
    (first / "metrics.parquet").write_text("earlier")
    driver.prepare_results_dir(spec, resume=False)
    (archived,) = [p for p in tmp_path.iterdir() if p.name.startswith("t.")]
    assert len(provenance.runs_of(archived)) == 2 and len(provenance.runs_of(tmp_path / "t")) == 1
