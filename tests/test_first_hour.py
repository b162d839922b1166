"""The README's commands as a user types them, in a shell where the project's environment is active,
and the console of the quickstart: our own lines and a short allowlist of Ray's, nothing else."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
# Lines Ray prints that a user should see: token authentication being on is a security fact.
RAY_LINES = [r"^\S+ \S+\s+WARNING authentication_token_setup\.py:\d+ -- Token authentication is enabled"]
OUR_LINES = [
    r"^(\x1b\[\d+m)?\(TrainController pid=\d+\)(\x1b\[0m)? \[quickstart/run\] step ",  # progress, via Ray's log
    r"^quickstart: gpt2-tiny on kjv", r"^starting an embedded Ray cluster", r"^earlier results of",
    r"^\s*step\s+epoch", r"^\s+\d+\s+\d+\.\d\d\s", r"^target val_perplexity", r"^\d+ records in ",
    r"^resuming ", r"^$",
]


def readme_commands() -> list[str]:
    """The commands of README.md's "Running an experiment" block, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Running an experiment\n.*?```\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


#: what a run command of the README is kept to (a later --set wins over an earlier one)
SHORT = ["train.max_steps=4", "data.max_val_samples=64"]


def shortened(command: str) -> str:
    """A run kept to a few steps; the resume goes on for two more."""
    if command.startswith("raytrain-par run"):
        keys = [*SHORT, "train.max_steps=6"] if "--resume" in command else SHORT
        return command + "".join(f" --set {k}" for k in keys)
    return command


def test_readme_commands_work_as_typed_and_the_console_is_quiet(tmp_path, ray_cluster, info):
    # The first command starts its own embedded cluster beside the suite's shared one: its console stays
    # quiet also with a second Ray cluster on the machine (Ray Train's placement-group cleaner once found
    # the wrong one). The later runs join the shared cluster through RAY_ADDRESS, as the README says a
    # user may, instead of each starting and stopping a cluster of its own.
    (tmp_path / "experiments").symlink_to(REPO / "experiments")  # the repository's root, as the README has it
    (tmp_path / "clusters").symlink_to(REPO / "clusters")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"  # as `. .venv/bin/activate` leaves it
    joined = {**env, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    commands = [c for c in readme_commands() if "--address" not in c]  # joining a cluster: tests/test_clusters.py
    assert commands[0] == "raytrain-par run experiments/quickstart.yaml" and len(commands) >= 6
    allowed = OUR_LINES + RAY_LINES
    outputs = {}
    for command in commands:
        own = command == commands[0] or not command.startswith("raytrain-par run")
        proc = subprocess.run(["bash", "-c", shortened(command)], cwd=tmp_path, env=env if own else joined,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[command] = proc.stdout + proc.stderr
        if command == commands[0]:  # read before the resume adds to these results
            quickstart = pq.read_table(tmp_path / "results" / "quickstart" / "metrics.parquet")
    resumed = pq.read_table(tmp_path / "results" / "quickstart" / "metrics.parquet").to_pylist()
    assert [r["step"] for r in resumed] == [0, 4, 6]  # the resume line continued the quickstart's run
    for command in commands:  # the check line prints the experiment with its --set values in it
        if command.startswith("raytrain-par check"):
            for key, value in re.findall(r"--set (\S+?)=(\S+)", command):
                assert f"{key.rsplit('.', 1)[-1]}: {value}" in outputs[command], (command, key)
    assert (tmp_path / "gpt2-quickstart" / "config.json").exists()  # the export line
    console = outputs[commands[0]].splitlines()
    unexpected = [line for line in console if not any(re.search(p, line) for p in allowed)]
    assert not unexpected, "\n".join(unexpected)
    assert sum("[quickstart/run] step" in line for line in console) == 2  # steps 0 and 4
    _check_quickstart_records(quickstart, info)


def _check_quickstart_records(table, info):
    """The quickstart's 2 ddp workers through Ray: the interval's training loss is the mean of one
    process's losses on the same global batches (with the same warm-up and schedule), validation
    improves, and the records hold what a user reads."""
    from engines import train_steps
    from raytrain_par.config import load_experiment
    from raytrain_par.local_group import run_ranks
    from raytrain_par.metrics.records import COLUMNS

    records = table.to_pylist()
    assert [r["step"] for r in records] == [0, 4]
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    one = load_experiment(REPO / "experiments" / "quickstart.yaml", [*SHORT, "scaling.num_workers=1"])
    data = info("kjv", seq_len=one.data.seq_len, vocab_size=one.data.vocab_size)
    losses = run_ranks(1, train_steps, one.to_dict(), data, 4)[0]["losses"]
    assert records[-1]["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)

    assert set(COLUMNS) <= set(table.column_names)
    last = records[-1]
    assert last["strategy"] == "ddp" and last["num_workers"] == 2 and last["samples_seen"] == 4 * 32
    assert len(last["mem_peak_bytes_per_worker"]) == 2
    assert last["mem_model_state_bytes"] > 0 and last["mem_peak_bytes"] > last["mem_model_state_bytes"]
    assert 0 < last["wall_time_s"] <= last["elapsed_s"]
    assert last["throughput"] > 0
    # hardware efficiency: per-worker figures, the record holding the largest
    assert len(last["mfu_per_worker"]) == 2 and last["mfu"] == max(last["mfu_per_worker"])
    assert 0 < last["mfu"] <= 1 and last["model_flops_per_step"] > 0 and last["peak_source"].startswith("matmul probe")
    assert 0 < last["comm_fraction"] < 1  # two workers all-reduce gradients; some of it is exposed
