"""End to end through Ray Train on the session's shared local cluster."""

import pyarrow.parquet as pq
import pytest
import torch

from conftest import experiment_file
from raytrain_par.local_group import run_ranks
from engines import train_steps
from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment
from raytrain_par.metrics.records import COLUMNS

pytestmark = pytest.mark.ray


def _run(path, tmp_path, *overrides, resume=False):
    spec = load_experiment(path, [f"output_dir={tmp_path}", *overrides])
    result = run_experiment(spec, resume=resume, log=lambda *_: None)
    assert result.error is None, result.error
    return spec, result.records


def test_quickstart_trains_as_one_process_and_writes_records(ray_cluster, tmp_path, info):
    """The quickstart's 2 ddp workers through Ray: each interval's training loss is the mean of one
    process's losses on the same global batches (with the same warm-up and schedule), validation
    improves, and the records hold what a user reads."""
    steps, every = 12, 6
    overrides = [f"train.max_steps={steps}", f"train.eval_every_steps={every}", "train.warmup_steps=4"]
    spec, records = _run(experiment_file("quickstart.yaml"), tmp_path, *overrides)
    assert [r["step"] for r in records] == [0, 6, 12]
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 1.0  # validation improves
    one = load_experiment(experiment_file("quickstart.yaml"), [*overrides, "scaling.num_workers=1"])
    data = info("kjv", seq_len=one.data.seq_len, vocab_size=one.data.vocab_size)
    losses = run_ranks(1, train_steps, one.to_dict(), data, steps)[0]["losses"]
    means = [sum(losses[i:i + every]) / every for i in range(0, steps, every)]
    assert [r["train_loss"] for r in records[1:]] == pytest.approx(means, rel=1e-5)

    table = pq.read_table(tmp_path / "quickstart" / "metrics.parquet")
    assert set(COLUMNS) <= set(table.column_names)
    last = table.to_pylist()[-1]
    assert last["strategy"] == "ddp" and last["num_workers"] == 2 and last["samples_seen"] == 12 * 32
    assert len(last["mem_peak_bytes_per_worker"]) == 2
    assert last["mem_model_state_bytes"] > 0 and last["mem_peak_bytes"] > last["mem_model_state_bytes"]
    assert 0 < last["wall_time_s"] <= last["elapsed_s"]
    assert last["throughput"] > 0
    # hardware efficiency: per-worker figures, the record holding the largest
    assert len(last["mfu_per_worker"]) == 2 and last["mfu"] == max(last["mfu_per_worker"])
    assert 0 < last["mfu"] <= 1 and last["model_flops_per_step"] > 0 and last["peak_source"].startswith("matmul probe")
    assert 0 < last["comm_fraction"] < 1  # two workers all-reduce gradients; some of it is exposed


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
