"""benchmarks/gpu_check.py in its CPU mode: the tiny GPT-2 trained under ddp and fsdp in one
subprocess (as a user runs it), again on a "bare machine" (torch without Ray, transformers,
DeepSpeed, pyarrow, pandas or numpy, nothing installed), and its FLOP count checked against the
formula directly."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out-dir", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, out


def test_cpu_run_measures_ddp_and_fsdp(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "gpu_check.json").read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    for name in ("ddp", "fsdp"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["mfu_vs_measured"] <= 1
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * result["run"]["model"]["seq"] / r["step_time_s"])
        assert 4 < r["loss"] < 8  # about ln(512) = 6.2 for random tokens and a fresh model
        assert r["mfu_vs_datasheet"] is None  # no datasheet for a CPU
        assert r["peak_mem_bytes"] is None and r["model_state_bytes"] is None and "CPU" in r["memory_note"]
    assert result["peak"]["datasheet_tflops"] is None and result["peak"]["measured_tflops"] > 0
    flops = result["flops"]
    assert flops["counted_per_token"] == pytest.approx(flops["formula"]["per_token"], rel=0.05)
    assert flops["used"] == "FlopCounterMode"


def test_cpu_run_says_why_deepspeed_did_not_run(cpu_run):
    proc, out = cpu_run
    rows = {r["strategy"]: r for r in json.loads((out / "gpu_check.json").read_text())["rows"]}
    for name in ("zero-2", "zero-3"):
        status = rows[name]["status"]
        assert status.startswith("skipped: ") and "deepspeed" in status.lower(), status
        assert rows[name]["step_time_s"] is None
    assert "zero-3" in proc.stdout and "skipped" in proc.stdout


def test_markdown_names_commit_device_command_and_target(cpu_run):
    proc, out = cpu_run
    md = (out / "gpu-check.md").read_text()
    commit = subprocess.run(["git", "--no-optional-locks", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    assert f"commit `{commit}" in md  # common.write_page's line; "+changes" may follow
    assert "device: CPU" in md and f"--out-dir {out}" in md
    target = [line for line in md.splitlines() if "Target (ddp MFU >= 45% of the measured" in line]
    assert len(target) == 1 and ("NOT met" in target[0] or ": met" in target[0]), md
    assert "| ddp | engine | ok |" in md and "| fsdp | engine | ok |" in md
    # where the package imports, the product's own step is what is timed, and the page says so
    assert "- timed: our own engine's training step (`raytrain_par.strategies`, `Engine.train_step`" in md
    run = json.loads((out / "gpu_check.json").read_text())["run"]
    assert (run["path"], run["path_reason"]) == ("engine", None)


BARE = ("ray", "transformers", "deepspeed", "pyarrow", "pandas", "numpy")

# Loaded by the interpreter before the script (PYTHONPATH names its folder): makes BARE unimportable
# (ModuleNotFoundError, as for a package not installed; torch runs without numpy), drops the editable
# install's finder, so raytrain_par can only come from the copy's root, and reports at exit.
SITECUSTOMIZE = f"""
import atexit, json, os, sys
BARE = {BARE!r}
for name in BARE:
    sys.modules[name] = None
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]

@atexit.register
def report():
    with open(os.environ["BARE_REPORT"], "w") as f:
        json.dump({{"loaded": sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in BARE),
                   "package": getattr(sys.modules.get("raytrain_par"), "__file__", None)}}, f)
"""


def test_cpu_run_on_a_bare_machine(tmp_path):
    """A copy of only the script, benchmarks/common.py and the package, run as `python
    benchmarks/gpu_check.py` where torch is all there is: the shared flops and common code it
    imports must not need anything else."""
    copy = tmp_path / "repo"
    (copy / "benchmarks").mkdir(parents=True)
    for name in ("gpu_check.py", "common.py"):
        shutil.copy(REPO / "benchmarks" / name, copy / "benchmarks" / name)
    shutil.copytree(REPO / "raytrain_par", copy / "raytrain_par", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    report, out = tmp_path / "report.json", tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(site),
           "BARE_REPORT": str(report), "GIT_CEILING_DIRECTORIES": str(tmp_path)}  # git finds no repository
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out-dir", str(out)],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loaded = json.loads(report.read_text())
    assert loaded["loaded"] == [], loaded
    assert loaded["package"] == str(copy / "raytrain_par" / "__init__.py")  # the copy's, found through its root
    result = json.loads((out / "gpu_check.json").read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["ddp"]["status"] == rows["fsdp"]["status"] == "ok"
    assert rows["ddp"]["tokens_per_s"] > 0 and 0 < rows["ddp"]["mfu_vs_measured"] <= 1
    for name in ("zero-2", "zero-3"):
        assert rows[name]["status"] == "skipped: deepspeed not importable (not installed)"
    assert result["commit"] == result["run"]["commit"] == "unknown"  # a copy without git
    md = (out / "gpu-check.md").read_text()
    assert "| ddp | stand-alone | ok |" in md  # transformers is missing: the labelled fallback
    assert result["run"]["path"] == "stand-alone" and "transformers" in result["run"]["path_reason"]
    assert "- timed: the stand-alone GPT-2 of benchmarks/gpu_check.py" in md and "a fallback" in md


def test_flop_counter_matches_formula(gpu_check):
    for cfg in (gpu_check.MODELS["tiny"], replace(gpu_check.MODELS["medium"], vocab_rows=50304)):
        formula = gpu_check.formula_flops(cfg)["per_token"]
        assert gpu_check.counted_flops(cfg) == pytest.approx(formula, rel=0.05), cfg.name
    # GPT-2 medium as published: 354.8M parameters with the LM head tied to the token embedding
    assert gpu_check.formula_flops(gpu_check.MODELS["medium"])["params"] == 354_823_168


def test_datasheet_matches_device_names(gpu_check):
    import torch

    def peak(name, dtype):  # what gpu_check reports as datasheet_tflops (raytrain_par.metrics.flops' table)
        return (gpu_check.datasheet_peak(name, dtype) or (None,))[0]
    assert peak("NVIDIA H200", torch.bfloat16) == 989
    assert peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989
    assert peak("NVIDIA H100 PCIe", torch.bfloat16) == 756
    assert peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312
    assert peak("NVIDIA A10G", torch.bfloat16) is None  # not the A10 nor the A100
    assert peak("NVIDIA H100 NVL", torch.bfloat16) == 835
    assert peak("NVIDIA H200", torch.float32) == 67


def fake_build(limits):
    """A strategy whose step runs out of CUDA memory above a batch limit: limits[i] for the i-th build."""
    import torch

    builds = []

    def build(c, device, dtype, batch, note):
        limit = limits[min(len(builds), len(limits) - 1)]
        builds.append(batch)

        def step(x, y):
            if x.shape[0] > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            note()
            return torch.tensor(6.0)
        return step, None
    return build, builds


def setup(gpu_check, **kw):
    import time

    import torch
    return gpu_check.Setup(**{"cfg": gpu_check.MODELS["tiny"], "device": torch.device("cpu"), "dtype": torch.float32,
                              "warmup": 1, "steps": 2, "max_batch": 256, "batch": None, "batch_how": "",
                              "deadline": time.monotonic() + 60, "deepspeed_on_cpu": False, **kw})


def test_engine_path_is_required_where_asked(gpu_check, monkeypatch, capsys):
    """--path engine where the package's engines do not import: refused, naming why and the fix."""
    monkeypatch.setattr(gpu_check, "engine_unavailable", lambda: "ModuleNotFoundError: No module named 'transformers'")
    assert gpu_check.main(["--device", "cpu", "--path", "engine", "--strategies", "ddp"]) == 2
    err = capsys.readouterr().err
    assert "--path engine" in err and "transformers" in err and "fix: install the package" in err


def test_batch_search_keeps_the_largest_power_of_two_that_fits(gpu_check):
    build, _ = fake_build([12])
    assert gpu_check.largest_batch(build, setup(gpu_check)) == (8, "largest power of two that fits (16 ran out of memory)")
    build, _ = fake_build([1000])
    assert gpu_check.largest_batch(build, setup(gpu_check, max_batch=32))[0] == 32


def test_a_batch_that_runs_out_of_memory_in_the_timed_run_is_halved(gpu_check, monkeypatch):
    build, builds = fake_build([8, 4])  # the search fits 8; the timed run then only 4
    monkeypatch.setitem(gpu_check.BUILDERS, "ddp", build)
    flops = {"per_token": 1e6, "formula": {"params": 1000}}
    row = gpu_check.run_strategy("ddp", setup(gpu_check), flops, {"measured_tflops": 1.0, "datasheet_tflops": None})
    assert row["status"] == "ok" and row["batch"] == 4 and builds == [1, 8, 4]
    assert "halved: 8 ran out of memory in the timed run" in row["batch_how"]
    build, _ = fake_build([2])  # a batch the user chose is not changed behind their back
    monkeypatch.setitem(gpu_check.BUILDERS, "ddp", build)
    row = gpu_check.run_strategy("ddp", setup(gpu_check, batch=4, batch_how="--batch"), flops,
                                 {"measured_tflops": 1.0, "datasheet_tflops": None})
    assert row["status"].startswith("failed: batch 4 (--batch) runs out of CUDA memory; fix: a smaller --batch")


def test_a_batch_that_fits_only_by_allocator_retries_is_halved(gpu_check, monkeypatch):
    measure = gpu_check.measure

    def retrying_above_4(build, s, batch):  # CUDA's allocator freeing its cache to fit batches above 4
        return {**measure(build, s, batch), "alloc_retries": 3 if batch > 4 else 0}
    monkeypatch.setattr(gpu_check, "measure", retrying_above_4)
    build, builds = fake_build([1000])
    monkeypatch.setitem(gpu_check.BUILDERS, "ddp", build)
    flops = {"per_token": 1e6, "formula": {"params": 1000}}
    peaks = {"measured_tflops": 1.0, "datasheet_tflops": None}
    row = gpu_check.run_strategy("ddp", setup(gpu_check, max_batch=8), flops, peaks)
    assert row["status"] == "ok" and row["batch"] == 4 and row["alloc_retries"] == 0
    assert "halved: the allocator freed its cache and retried 3 times in the timed run at 8" in row["batch_how"]
    row = gpu_check.run_strategy("ddp", setup(gpu_check, batch=8, batch_how="--batch"), flops, peaks)
    assert row["batch"] == 8 and row["alloc_retries"] == 3  # the user's batch is kept, and the row says why it is slow
    assert row["status"].startswith("ok, but the allocator freed its cache and retried 3 times") and "--batch" in row["status"]


def test_time_budget_skips_strategies_with_a_row_saying_so(gpu_check, tmp_path):
    assert gpu_check.main(["--device", "cpu", "--strategies", "ddp,fsdp", "--time-budget", "0.001",
                           "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(result["rows"]) == 2
    assert all(r["status"].startswith("skipped: time budget") and "--time-budget" in r["status"] for r in result["rows"])
    assert result["target"]["met"] is None and "NOT met: ddp did not run" in result["target"]["line"]


def test_bad_arguments_name_the_flag_the_value_and_the_fix(gpu_check, capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--strategies", "ddp,zero-9"])
    assert "--strategies = ddp,zero-9: unknown strategy 'zero-9'; fix: choose from ddp,fsdp,zero-2,zero-3" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--batch", "0"])
    assert "--batch = 0: must be >= 1; fix: pass a positive --batch" in capsys.readouterr().err
