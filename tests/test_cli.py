"""The command line as a user types it: paths relative to the experiment file, --version, input that
YAML would accept silently (a key given twice, a target pointing the wrong way) refused with the field,
the value and the fix, and never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_par import cli, config
from test_config import BASE as CONFIG_BASE

REPO = Path(__file__).resolve().parent.parent
LLAMA = REPO / "experiments" / "models" / "llama-tiny"
BASE = {k: v for k, v in CONFIG_BASE.items() if k != "target"}


def raytrain_par(*args, cwd=None):
    """The installed command, in its own process, as a shell runs it."""
    exe = Path(sys.executable).parent / "raytrain-par"
    return subprocess.run([str(exe), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)


def refused(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "error:" in result.stderr and "fix:" in result.stderr, result.stderr
    for w in words:
        assert w in result.stderr, (w, result.stderr)


def test_paths_in_the_file_are_read_from_the_files_directory(tmp_path, monkeypatch):
    exp = tmp_path / "exp"
    (exp / "models").mkdir(parents=True)
    (exp / "models" / "config.json").write_text((LLAMA / "config.json").read_text())
    raw = {**BASE, "model": {"name": "causal-lm", "config": "models"},
           "data": {"name": "text", "path": "corpus/*.jsonl", "tokenizer": "../tok", "cache_dir": "~/c"},
           "output_dir": "out",
           "sweep": {"grid": {"data.path": ["a/*.txt", "/abs/*.txt"]}, "cases": [{"output_dir": "o2"}]}}
    (exp / "x.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = config.load_experiment("../exp/x.yaml", check_data=False)
    assert spec.model.options.config == str(exp / "models")
    assert spec.data.path == str(exp / "corpus" / "*.jsonl")
    assert spec.data.tokenizer == str(tmp_path / "tok")
    assert spec.data.cache_dir == os.path.expanduser("~/c")
    assert spec.output_dir == str(exp / "out")
    assert spec.sweep["grid"]["data.path"] == [str(exp / "a" / "*.txt"), "/abs/*.txt"]
    assert spec.sweep["cases"] == [{"output_dir": str(exp / "o2")}]
    # --set is typed in a shell: relative to the current directory
    spec = config.load_experiment("../exp/x.yaml", ["data.path=mine/*.txt", "output_dir=res"], check_data=False)
    assert spec.data.path == str(elsewhere / "mine" / "*.txt") and spec.output_dir == str(elsewhere / "res")


def test_check_prints_the_paths_resolved(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "llama.yaml").write_text(yaml.safe_dump(
        {**BASE, "model": {"name": "causal-lm", "config": str(os.path.relpath(LLAMA, tmp_path / "exp"))}}))
    result = raytrain_par("check", "exp/llama.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["model"]["config"] == str(LLAMA)


def test_the_shipped_llama_experiment_runs_check_from_another_directory(tmp_path):
    result = raytrain_par("check", REPO / "experiments" / "llama-tiny.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["model"]["config"] == str(LLAMA)


def test_version():
    result = raytrain_par("--version")
    assert result.returncode == 0, result.stderr
    import ray
    import torch

    line = result.stdout.strip()
    assert line.startswith("raytrain-par 0.") and f"torch {torch.__version__}" in line and f"ray {ray.__version__}" in line
    assert ("CUDA" in line) and "deepspeed" in line and "transformers" in line


@pytest.mark.parametrize("text,field,words", [
    ("name: t\nmodel: gpt2-tiny\ndata: kjv\ntrain: {max_steps: 5}\ntrain: {lr: 0.1}\n", "train", "lines 4 and 5"),
    ("name: t\nmodel: gpt2-tiny\ndata: kjv\ntrain:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n", "train.lr", "lines 5 and 7"),
    ("name: t\nmodel: gpt2-tiny\ndata: kjv\nsweep:\n  cases:\n    - {train.lr: 1, train.lr: 2}\n",
     "sweep.cases[0].train.lr", "given twice"),
])
def test_a_key_given_twice_is_refused(tmp_path, text, field, words):
    f = tmp_path / "e.yaml"
    f.write_text(text)
    result = raytrain_par("check", f)
    refused(result, f"{field} = ", words)


@pytest.mark.parametrize("target,fix", [
    ("val_loss >= 3", "val_loss <= 3"),
    ("val_perplexity >= 100", "val_perplexity <= 100"),
])
def test_a_target_pointing_the_wrong_way_is_refused(tmp_path, target, fix):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "target": target}))
    refused(raytrain_par("check", f), "target = ", "wrong way", fix)


def test_an_accuracy_target_must_rise():
    raw = {**BASE, "model": {"name": "vgg11", "width": 0.25}, "data": {"name": "digits"},
           "target": "val_accuracy <= 0.5"}
    with pytest.raises(config.ConfigError, match="val_accuracy >= 0.5"):
        config.parse(config.resolve_paths(raw, Path.cwd()))
    assert config.parse({**raw, "target": "val_accuracy >= 0.5"}).target.mode == "max"


def test_unreadable_files_are_refused(tmp_path):
    f = tmp_path / "binary.yaml"
    f.write_bytes(bytes(range(256)))
    refused(raytrain_par("check", f), "experiment file")
    assert cli.main(["check", str(tmp_path / "missing.yaml")]) == 2
