"""The README's commands as a user types them, in a shell where the project's environment is active,
and the console of the quickstart: our own lines and a short allowlist of Ray's, nothing else."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


def shortened(command: str) -> str:
    """A run kept to a few steps (a later --set wins over an earlier one)."""
    if command.startswith("raytrain-par run"):
        steps = 6 if "--resume" in command else 4
        return f"{command} --set train.max_steps={steps} --set data.max_val_samples=64"
    return command


def test_readme_commands_work_as_typed_and_the_console_is_quiet(tmp_path, ray_cluster):
    # The suite's shared cluster runs beside the commands' own clusters: the console stays quiet also
    # with a second Ray cluster on the machine (Ray Train's placement-group cleaner once found the wrong one).
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"  # as `. .venv/bin/activate` leaves it
    commands = [c for c in readme_commands() if "--address" not in c]  # joining a cluster: tests/test_clusters.py
    assert commands[0] == "raytrain-par run experiments/quickstart.yaml" and len(commands) >= 6
    allowed = OUR_LINES + RAY_LINES
    outputs = {}
    for command in commands:
        proc = subprocess.run(["bash", "-c", shortened(command)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[command] = proc.stdout + proc.stderr
    assert (tmp_path / "gpt2-quickstart" / "config.json").exists()  # the export line
    console = outputs[commands[0]].splitlines()
    unexpected = [line for line in console if not any(re.search(p, line) for p in allowed)]
    assert not unexpected, "\n".join(unexpected)
    assert sum("[quickstart/run] step" in line for line in console) == 2  # steps 0 and 4
