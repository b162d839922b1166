"""Every experiment file shipped with the project is a valid experiment (and a valid sweep)."""

from pathlib import Path

import pytest

from raytrain_par.config import load_experiment
from raytrain_par.data import NEEDS_PATH
from raytrain_par.sweep import plan

FILES = sorted((Path(__file__).resolve().parent.parent / "experiments").rglob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(p.parents[1])) for p in FILES])
def test_experiment_file_is_valid(path):
    spec = load_experiment(path, check_data=False)
    if spec.data.name not in NEEDS_PATH:  # the CPU-sized files run here: their data must be installed
        load_experiment(path)
    if "paper" in path.parts:
        assert spec.scaling.use_gpu, "paper-sized experiments are for GPU clusters"
    if spec.sweep is not None:
        assert plan(spec).points
