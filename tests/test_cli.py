"""The command line as a user types it: paths relative to the experiment file, --version, input that
YAML would accept silently (a key given twice, a target pointing the wrong way) refused with the field,
the value and the fix, and never a traceback."""

import contextlib
import io
import json
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


def in_process(*args):
    """The command's `main` in the test's own process, returning what `raytrain_par` returns: for the
    many calls of one test that check what a command says (each process of its own spends ~3 s on
    imports). Tests of the installed command as a shell runs it use `raytrain_par`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse's refusals
            rc = e.code
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


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
           "sweep": {"grid": {"data.path": ["a/*.txt", "/abs/*.txt"]}, "cases": [{"data.tokenizer": "t2"}]}}
    (exp / "x.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = config.load_experiment("../exp/x.yaml", check_data=False)
    assert spec.model.options.config == str(exp / "models")
    assert spec.data.path == str(exp / "corpus" / "*.jsonl")
    assert spec.data.tokenizer == str(tmp_path / "tok")
    assert spec.data.cache_dir == os.path.expanduser("~/c")
    assert spec.output_dir == "out"  # where results go: from where the command runs (a Ray job moves it)
    assert spec.sweep["grid"]["data.path"] == [str(exp / "a" / "*.txt"), "/abs/*.txt"]
    assert spec.sweep["cases"] == [{"data.tokenizer": str(exp / "t2")}]
    # --set is typed in a shell: relative to the current directory
    spec = config.load_experiment("../exp/x.yaml", ["data.path=mine/*.txt", "data.tokenizer=tok"], check_data=False)
    assert spec.data.path == str(elsewhere / "mine" / "*.txt") and spec.data.tokenizer == str(elsewhere / "tok")


def test_check_prints_the_paths_resolved(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "llama.yaml").write_text(yaml.safe_dump(
        {**BASE, "model": {"name": "causal-lm", "config": str(os.path.relpath(LLAMA, tmp_path / "exp"))}}))
    result = raytrain_par("check", "exp/llama.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(yaml.safe_load(result.stdout)["model"]["config"]) == LLAMA.resolve()


def test_the_shipped_llama_experiment_runs_check_from_another_directory(tmp_path):
    result = raytrain_par("check", REPO / "experiments" / "llama-tiny.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(yaml.safe_load(result.stdout)["model"]["config"]) == LLAMA.resolve()


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


def test_check_ends_with_what_would_run():
    result = raytrain_par("check", REPO / "experiments" / "sweep-workers-batch.yaml")
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("# ")]
    raw = yaml.safe_load((REPO / "experiments" / "sweep-workers-batch.yaml").read_text())
    t, grid = raw["train"], raw["sweep"]["grid"]
    dp = raw["scaling"]["num_workers"]
    assert summary[0].startswith(f"# workers: {dp} on cpu (gloo); layout: data {dp}")
    assert f"global batch {t['global_batch_size']}, {t['global_batch_size'] // dp} per replica" in summary[1]
    assert summary[2].split(",")[0] == f"# steps: {t['max_steps']}"  # and epochs, where the data set is prepared
    evals = t["max_steps"] // t["eval_every_steps"] + 1  # and one before the first step
    assert summary[3].startswith(f"# evaluations: {evals}; checkpoints: {evals - 1}")
    trials = len(grid["scaling.num_workers"]) * len(grid["train.global_batch_size"])
    assert summary[4].startswith(f"# sweep (grid): {trials} trial(s)")
    assert yaml.safe_load(result.stdout)["name"] == raw["name"]  # the summary keeps it a YAML file


@pytest.mark.parametrize("change,steps,epochs,evals,checkpoints", [
    ({"epochs": 2}, 60, 2.0, 3, 2),  # one evaluation per epoch, one before the first step
    ({"epochs": 3, "max_steps": 50, "eval_every_steps": 20, "checkpoint_every_evals": 2}, 50, 50 / 30, 4, 2),
    ({"max_steps": 45, "eval_at_start": False, "checkpoint_every_evals": 0}, 45, 1.5, 2, 0),
])
def test_steps_epochs_evaluations_and_checkpoints_of_a_prepared_data_set(monkeypatch, change, steps, epochs,
                                                                          evals, checkpoints):
    from raytrain_par import data, summary
    from raytrain_par.data.shards import DatasetInfo

    monkeypatch.setattr(data, "cached", lambda spec, cache=None: DatasetInfo("kjv", "text", "", "", 32 * 30 + 5, 10))
    raw = {**BASE, "train": {"global_batch_size": 32, "lr": 1e-3, **change}}
    s = summary.run_summary(config.parse(raw))
    assert (s["steps_per_epoch"], s["steps"], s["evaluations"], s["checkpoints"]) == (30, steps, evals, checkpoints)
    assert s["epochs"] == pytest.approx(epochs)


def test_a_pipeline_summary_counts_microbatches():
    from raytrain_par import summary

    raw = {**BASE, "strategy": {"name": "pipeline", "schedule": "1f1b", "microbatches": 4},
           "train": {"global_batch_size": 32, "max_steps": 10, "lr": 1e-3, "gradient_accumulation_steps": 2}}
    s = summary.run_summary(config.parse(raw))
    assert s["layout"]["pipeline"] == 2 and s["rows_per_replica"] == 32 and s["rows_per_microbatch"] == 4


def json_of(result):
    assert "Traceback" not in result.stderr, result.stderr
    import json

    return json.loads(result.stdout)  # stdout holds the document and nothing else


def test_check_json():
    result = raytrain_par("check", REPO / "experiments" / "quickstart.yaml", "--json")
    doc = json_of(result)
    assert result.returncode == 0 and doc["schema"] == 1 and doc["command"] == "check"
    assert doc["experiment"]["name"] == "quickstart" and doc["summary"]["layout"]["data"] == 2
    assert doc["summary"]["steps"] == 200 and doc["sweep"] is None


def test_json_errors_are_documents_too(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "train": {"lr": -1}}))
    result = raytrain_par("check", f, "--json")
    doc = json_of(result)
    assert result.returncode == 2 and "train.lr" in doc["error"] and "fix:" in result.stderr


def test_estimate_json_gives_every_row_and_says_why_a_layout_cannot_exist():
    result = raytrain_par("estimate", REPO / "experiments" / "quickstart.yaml", "--json", "--workers", "1,3",
                          "--strategies", "ddp,zero-3", "--device-memory", "1GiB")
    doc = json_of(result)
    assert result.returncode == 0 and doc["command"] == "estimate" and doc["parameters"] > 1e6
    rows = {(r["strategy"], r["workers"]): r for r in doc["rows"]}
    assert set(rows) == {("ddp", 1), ("ddp", 3), ("zero-3", 1), ("zero-3", 3)}
    one = rows["ddp", 1]
    assert one["possible"] and one["states_theory_bytes"] == 16 * doc["parameters"] and one["fits"] is True
    assert not rows["ddp", 3]["possible"] and "global_batch_size" in rows["ddp", 3]["note"]


def test_report_json(tmp_path):
    from raytrain_par.metrics.records import write_table

    records = [{"experiment": "e", "trial": f"w{w}", "strategy": "ddp", "num_workers": w, "global_batch_size": 32,
                "step": step, "epoch": step / 10, "wall_time_s": step * 2.0 / w, "samples_seen": 32 * step,
                "step_time_s": 2.0 / w if step else None, "val_loss": 6 - step / 10,
                "val_perplexity": 400 - 5 * step * w} for w in (1, 2) for step in (0, 10, 20)]
    write_table(tmp_path / "metrics.parquet", records)
    result = raytrain_par("report", tmp_path, "--out", tmp_path / "report", "--json")
    doc = json_of(result)
    assert result.returncode == 0 and doc["metric"] == "val_perplexity"
    assert [t["trial"] for t in doc["trials"]] == ["w2", "w1"]  # the best perplexity first
    assert all(Path(f).exists() for f in doc["files"]) and str(tmp_path / "report" / "summary.md") in doc["files"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_estimate_answers_megatron_with_activation_checkpointing(mode):
    result = in_process("estimate", REPO / "experiments" / "megatron.yaml", "--json", "--strategies", "megatron,ddp",
                        "--set", f"train.activation_checkpointing={mode}")
    doc = json_of(result)
    assert result.returncode == 0 and doc["activation_checkpointing"] == mode
    plain = json_of(in_process("estimate", REPO / "experiments" / "megatron.yaml", "--json", "--strategies",
                               "megatron,ddp"))
    for row, before in zip(doc["rows"], plain["rows"]):
        assert row["possible"] and 0 < row["activation_bytes"] < before["activation_bytes"]  # recomputed, not kept


def test_estimate_gives_pipedreams_memory_whatever_the_clipping():
    result = in_process("estimate", REPO / "experiments" / "quickstart.yaml", "--json", "--workers", "2",
                        "--strategies", "pipeline,pipedream,megatron", "--set", "train.grad_clip=1.0")
    rows = {r["strategy"]: r for r in json_of(result)["rows"]}
    assert rows["pipedream"]["possible"] and rows["pipedream"]["per_worker_bytes"] > 0
    assert "train.grad_clip = 0.0" in rows["pipedream"]["remark"] and rows["pipeline"]["remark"] is None
    # megatron has no default degree: the row says which it estimated
    assert rows["megatron"]["possible"] and rows["megatron"]["remark"] == "strategy.tensor_parallel = 2"


def test_an_installed_wheel_runs_version_check_and_reproduce(tmp_path):
    """The wheel holds the package alone: its experiments are package data, found without a checkout."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "wheel"),
                            str(REPO)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("raytrain_par-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr
    away = tmp_path / "away"  # no checkout here: nothing to find by accident
    away.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def cli_(*args):
        return subprocess.run([sys.executable, "-m", "raytrain_par.cli", *map(str, args)], cwd=away, env=env,
                              capture_output=True, text=True, timeout=300)

    where = subprocess.run([sys.executable, "-c", "import raytrain_par; print(raytrain_par.__file__)"], cwd=away,
                           env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's package, not the checkout's
    assert cli_("--version").stdout.startswith("raytrain-par ")
    packaged = site / "raytrain_par" / "experiments"
    checked = cli_("check", packaged / "llama-tiny.yaml", "--json")
    assert checked.returncode == 0, checked.stderr
    assert Path(json.loads(checked.stdout)["experiment"]["model"]["config"]) == (packaged / "models" / "llama-tiny").resolve()
    listed = cli_("reproduce", "--list")
    assert listed.returncode == 0 and "took (reproduce/)" in listed.stdout, listed.stderr
    from raytrain_par import reproduce

    assert all(name in listed.stdout for name in reproduce.FINDINGS)
    planned = subprocess.run([sys.executable, "-c", "from raytrain_par import reproduce\n"
                              "for f in reproduce.FINDINGS.values():\n"
                              "    for paper in (False, True):\n"
                              "        print(reproduce.shown(reproduce.plan_finding(f, paper).experiment))"],
                             cwd=away, env=env, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr
    assert len(planned.stdout.split()) == 2 * len(reproduce.FINDINGS)


def test_plan_json_keeps_stdout_for_the_document(monkeypatch, capfd):
    """What plan prints while it trains (its own lines, Ray's, a library's writing to file descriptor 1)
    goes to stderr; stdout holds the document, a point that never reaches the target as null."""
    import math

    from raytrain_par import goodput

    def make_plan(spec, address=None, device_memory=None, probe_workers=None):
        print("reference run: training to the target")
        os.write(1, b"(TrainController pid=1) a line Ray writes\n")
        rows = [{"trial": "b16", "predicted_time_to_target_s": 12.5, "fits": None},
                {"trial": "b8", "predicted_time_to_target_s": math.inf, "fits": None}]
        return goodput.GoodputPlan(rows, None, None, notes=["a note"], path=Path("/r/plan.parquet"), seconds=3.0)

    monkeypatch.setattr(goodput, "make_plan", make_plan)
    assert cli.main(["plan", str(REPO / "experiments" / "goodput-search.yaml"), "--json"]) == 0
    out, err = capfd.readouterr()
    doc = json.loads(out)
    assert doc["command"] == "plan" and doc["plan"] == "/r/plan.parquet" and doc["notes"] == ["a note"]
    assert [r["predicted_time_to_target_s"] for r in doc["rows"]] == [12.5, None]
    assert "reference run" in err and "a line Ray writes" in err
