"""Every experiment file shipped with the project is a valid experiment (and a valid sweep)."""

from pathlib import Path

import pytest
import yaml

from raytrain_par.config import load_experiment
from raytrain_par.data import NEEDS_PATH
from raytrain_par.sweep import plan

FILES = sorted((Path(__file__).resolve().parent.parent / "experiments").rglob("*.yaml"))


def pretrained_for(path: Path, tmp_path) -> list[str]:
    """A fine-tuning file names a checkpoint its user makes first (its comment says how): here, a
    save_pretrained directory of the model it names, in its place."""
    model = yaml.safe_load(path.read_text())["model"]
    if not isinstance(model, dict) or "pretrained" not in model:
        return []
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path.parent / "models" / "llama-tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
    return [f"model.pretrained={tmp_path / 'checkpoint'}"]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(p.parents[1])) for p in FILES])
def test_experiment_file_is_valid(path, tmp_path):
    made = pretrained_for(path, tmp_path)
    spec = load_experiment(path, made, check_data=False)
    if spec.data.name not in NEEDS_PATH:  # the CPU-sized files run here: their data must be installed
        load_experiment(path, made)
    if "paper" in path.parts:
        assert spec.scaling.use_gpu, "paper-sized experiments are for GPU clusters"
    if spec.sweep is not None:
        assert plan(spec).points
