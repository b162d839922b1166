"""End to end through Ray Train on the session's shared local cluster (the quickstart's run and its records:
tests/test_first_hour.py, which trains it as the README types it)."""

import pytest
import torch

from conftest import experiment_file
from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment

pytestmark = pytest.mark.ray


def _run(path, tmp_path, *overrides, resume=False):
    spec = load_experiment(path, [f"output_dir={tmp_path}", *overrides])
    result = run_experiment(spec, resume=resume, log=lambda *_: None)
    assert result.error is None, result.error
    return spec, result.records


def test_vgg_fashion_trains_and_exports(ray_cluster, tmp_path):
    """VGG on Fashion-MNIST learns, and `export` writes the trained model, which classifies the
    validation images as the run's last evaluation did."""
    from safetensors.torch import load_model

    from raytrain_par import data, models
    from raytrain_par.data.shards import read_split
    from raytrain_par.export import export

    spec, records = _run(experiment_file("vgg-fashion.yaml"), tmp_path, "train.max_steps=40",
                         "train.eval_every_steps=20", "data.max_val_samples=1000")
    assert records[-1]["val_accuracy"] > records[0]["val_accuracy"] + 0.2
    assert records[-1]["val_perplexity"] is None
    # written in the background (the default), each save's write time reaches the record Ray Train delivers
    assert [r["step"] for r in records if r["checkpoint_write_s"]] == [20, 40]

    export(tmp_path / spec.name, tmp_path / "vgg", log=lambda *_: None)
    prepared = data.prepare(spec.data, spec.data.cache_dir, log=lambda *_: None)
    model, task = models.build(spec.model, prepared, seed=1)  # other weights than the run started from
    load_model(model, str(tmp_path / "vgg" / "model.safetensors"))  # strict: every key
    val = read_split(prepared, prepared.val_path)
    batch = task.prepare({k: v[:1000] for k, v in val.items()}, torch.device("cpu"))
    with torch.no_grad():
        logits, labels = task.outputs(model.eval(), batch)
    accuracy = float((logits.argmax(-1) == labels).float().mean())
    assert accuracy == pytest.approx(records[-1]["val_accuracy"], abs=0.01)


def test_an_adaptive_batch_grows_in_ray_train_workers(ray_cluster, tmp_path):
    """The quickstart with `train.adaptive_batch` on short rows (whose noise scale is above the starting
    batch from the first steps): the batch explores, then follows the measured step times; each record
    trains at the batch the evaluation before it decided, and the run ends at its progress."""
    spec, records = _run(experiment_file("quickstart.yaml"), tmp_path,
                         "data={name: kjv, seq_len: 32, vocab_size: 512, max_val_samples: 32}",
                         "train.global_batch_size=8", "train.max_steps=12", "train.eval_every_steps=3",
                         "train.warmup_steps=2", "train.adaptive_batch={max_global_batch_size: 64}")
    assert records[0]["step"] == 0 and records[0]["batch_decision"] == "start"
    assert records[1]["batch_decision"] == "explore" and records[1]["next_global_batch_size"] == 16
    for before, r in zip(records, records[1:]):
        if before["next_global_batch_size"] is not None:
            assert r["global_batch_size"] == before["next_global_batch_size"]
        assert r["samples_seen"] - before["samples_seen"] == r["global_batch_size"] * (r["step"] - before["step"])
    assert records[-1]["progress"] >= 12 and records[-1]["step"] < 12
    assert all(r["predicted_goodput"] for r in records[3:])  # two batch sizes timed from the third on
