"""End to end through Ray Train on the session's shared local cluster."""

import pyarrow.parquet as pq
import pytest

from conftest import experiment_file
from raytrain_par.local_group import run_ranks
from engines import experiment, train_steps
from raytrain_par.config import load_experiment, parse
from raytrain_par.driver import run_experiment
from raytrain_par.metrics.records import COLUMNS

pytestmark = pytest.mark.ray


def _run(path, tmp_path, *overrides, resume=False):
    spec = load_experiment(path, [f"output_dir={tmp_path}", *overrides])
    result = run_experiment(spec, resume=resume, log=lambda *_: None)
    assert result.error is None, result.error
    return spec, result.records


def test_quickstart_trains_and_writes_records(ray_cluster, tmp_path):
    spec, records = _run(experiment_file("quickstart.yaml"), tmp_path, "train.max_steps=12",
                         "train.eval_every_steps=6", "train.warmup_steps=4")
    assert [r["step"] for r in records] == [0, 6, 12]
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 1.0  # validation improves
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


def test_ddp_through_ray_matches_single_process(ray_cluster, tmp_path, info):
    """The per-step global losses of 2 Ray workers equal a single process on the same global batches."""
    steps = 3
    reference = run_ranks(1, train_steps, experiment("gpt2-tiny", "kjv", workers=1, steps=steps), info("kjv"), steps)[0]
    spec = parse({**experiment("gpt2-tiny", "kjv", workers=2, steps=steps), "output_dir": str(tmp_path)})
    spec.train.eval_every_steps = 1
    spec.data.max_val_samples = 16
    records = run_experiment(spec, log=lambda *_: None).records
    ray_losses = [r["train_loss"] for r in records if r["step"] > 0]
    assert ray_losses == pytest.approx(reference["losses"], abs=1e-5, rel=1e-5)


def test_vgg_fashion_trains(ray_cluster, tmp_path):
    spec, records = _run(experiment_file("vgg-fashion.yaml"), tmp_path, "train.max_steps=40",
                         "train.eval_every_steps=20", "data.max_val_samples=1000")
    assert records[-1]["val_accuracy"] > records[0]["val_accuracy"] + 0.2
    assert records[-1]["val_perplexity"] is None
