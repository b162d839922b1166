"""Every verb over a corpus of malformed inputs: each is refused before Ray starts, with the exit
status 2, an error line and a fix, and never a traceback or an internal error."""

import copy

import pytest
import ray
import yaml

from raytrain_par import cli
from test_config import BASE

VERBS = ["check", "estimate", "plan", "run", "sweep", "data"]


def with_(path: str, value) -> str:
    raw = copy.deepcopy(BASE)
    node = raw
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return yaml.safe_dump(raw)


SWEEP = {"grid": {"scaling.num_workers": [1, 2]}}
TEXTS = {
    "empty": "",
    "a list": "- name: t\n- model: gpt2-tiny\n",
    "a string": "just words\n",
    "a number": "42\n",
    "bad YAML": "name: t\nmodel: {name: gpt2-tiny\n",
    "tabs": "name: t\n\tmodel: gpt2-tiny\n",
    "a second train block": yaml.safe_dump(BASE) + "train: {lr: 0.1}\n",
    "a key twice deep down": "name: t\nmodel: {name: gpt2-tiny, dropout: 0.1, dropout: 0.2}\ndata: kjv\n",
    "no model": "name: t\ndata: kjv\n",
    "bad name": with_("name", "../../etc"),
    "name a number": with_("name", 3),
    **{f"unknown key in {s}": with_(f"{s}.no_such_key", 1)
       for s in ("model", "data", "strategy", "scaling", "train", "target")},
    "unknown top-level key": with_("no_such_key", 1),
    "unknown key in a sweep": with_("sweep", {**SWEEP, "no_such_key": 1}),
    "unknown key in goodput": with_("sweep", {**SWEEP, "search": "goodput", "goodput": {"nope": 1}}),
    "model a number": with_("model", 3),
    "data a list": with_("data", [1, 2]),
    "strategy a number": with_("strategy", 7),
    "scaling a string": with_("scaling", "fast"),
    "train a list": with_("train", [1]),
    "target a number": with_("target", 5),
    "lr a word": with_("train.lr", "fast"),
    "workers a word": with_("scaling.num_workers", "two"),
    "betas a word": with_("train.betas", "x"),
    "max_steps a float": with_("train.max_steps", 1e400),
    "lr not a number": with_("train.lr", float("nan")),
    "sweep a number": with_("sweep", 3),
    "grid a list": with_("sweep", {"grid": [1, 2]}),
    "grid values not a list": with_("sweep", {"grid": {"train.lr": 0.1}}),
    "empty sweep": with_("sweep", {}),
    "output_dir a number": with_("output_dir", 3),
    "negative lr": with_("train.lr", -1),
    "no workers": with_("scaling.num_workers", 0),
    "zero batch": with_("train.global_batch_size", 0),
    "negative steps": with_("train.max_steps", -5),
    "sequence of 1": with_("data.seq_len", 1),
    "val_fraction 2": with_("data.val_fraction", 2),
    "no cpus": with_("scaling.cpus_per_worker", 0),
    "negative target": with_("target.value", -1),
    "accuracy target of a language model the wrong way": with_("target", "val_accuracy <= 0.5"),
    "loss target the wrong way": with_("target", "val_loss >= 3"),
    "perplexity target the wrong way": with_("target", "val_perplexity >= 100"),
    "unreadable target": with_("target", "val_loss < 3"),
    "target not a number": with_("target", "val_loss <= 1.2.3"),
    "unknown strategy": with_("strategy", {"name": "zero-9"}),
    "unknown model": with_("model", {"name": "gpt3"}),
    "unknown data set": with_("data", {"name": "imagenet"}),
    "wikitext without a path": with_("data", {"name": "wikitext-103"}),
    "causal-lm without a config": with_("model", {"name": "causal-lm", "config": "/no/such/config"}),
    "batch that does not split": with_("train.global_batch_size", 33),
    "tensor parallel 3 on 2": with_("strategy", {"name": "megatron", "tensor_parallel": 3}),
    "pipeline on 1 worker": with_("scaling.num_workers", 1).replace("name: ddp", "name: pipeline"),
    "elastic range upside down": with_("scaling.num_workers", [3, 1]),
    "elastic range of three": with_("scaling.num_workers", [1, 2, 3]),
    "fp16 on CPU": with_("train.precision", "fp16"),
}
OVERRIDES = [["train.lr"], ["=3"], ["train..lr=3"], ["train.lr=["], ["epoch=3"], ["train.lr.x=3"]]


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("Ray was started for a malformed input")

    monkeypatch.setattr(ray, "init", refuse)


def refused(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == 2, (argv, rc, out.err)
    assert "Traceback" not in out.err and "internal error" not in out.err, out.err
    assert "error:" in out.err and "fix" in out.err, out.err
    return out.err


@pytest.mark.parametrize("case", list(TEXTS))
def test_every_verb_refuses_a_malformed_experiment(case, tmp_path, capsys, no_ray):
    f = tmp_path / "e.yaml"
    f.write_text(TEXTS[case])
    for verb in VERBS:
        refused([verb, str(f)], capsys)


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_refuses_binary_and_missing_files_and_bad_overrides(verb, tmp_path, capsys, no_ray):
    f = tmp_path / "binary.yaml"
    f.write_bytes(bytes(range(256)) * 4)
    refused([verb, str(f)], capsys)
    refused([verb, str(tmp_path / "missing.yaml")], capsys)
    refused([verb, str(tmp_path)], capsys)  # a directory
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(BASE))
    for override in OVERRIDES:
        refused([verb, str(good), "--set", *override], capsys)


def test_results_verbs_refuse_what_holds_no_results(tmp_path, capsys, no_ray):
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "metrics.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "a-file").write_text("x")
    for target in ("empty", "corrupt", "a-file", "missing"):
        refused(["report", str(tmp_path / target), "--out", str(tmp_path / "out")], capsys)
        refused(["export", str(tmp_path / target), "--out", str(tmp_path / "model")], capsys)


@pytest.mark.parametrize("text", ["", "- 1\n", "cluster_name: x\nprovider: 3\n", "\x00\x01binary"])
def test_cluster_validate_refuses_malformed_cluster_files(text, tmp_path, capsys):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    rc = cli.main(["cluster", "validate", str(f)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "internal error" not in err and "error:" in err, err
