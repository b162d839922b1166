"""The PipeDream engine end to end through Ray Train, in bf16 (on the session's shared local cluster)."""

import pyarrow.parquet as pq
import pytest

from conftest import experiment_file
from engines import exported_val_loss
from raytrain_par.config import load_experiment
from raytrain_par.driver import run_experiment

pytestmark = pytest.mark.ray


def test_pipedream_in_bf16_through_ray_records_stages(ray_cluster, tmp_path, info):
    """PipeDream in bf16 through Ray Train: per-stage staleness, stash and bubble in its records, and a
    checkpoint of fp32 weights (the master copy) that `raytrain-par export` joins (stages, untied
    embedding and LM head) into a plain GPT-2 scoring the run's validation loss in fp32 within bf16's
    rounding. The synchronous schedules train through Ray in tests/test_layout_3d.py (1F1B) and
    tests/test_strategies_ray.py (ZBV); each schedule in bf16 is compared with fp32 in
    tests/test_pipeline.py."""
    spec = load_experiment(experiment_file("pipeline-staleness.yaml"),
                           [f"output_dir={tmp_path}", "model.n_layer=2", "data.seq_len=32", "data.vocab_size=512",
                            "data.max_val_samples=64", "train.max_steps=12", "train.eval_every_steps=6",
                            "train.warmup_steps=2", "train.precision=bf16"])
    result = run_experiment(spec, log=lambda *_: None)
    assert result.error is None, result.error
    records = pq.read_table(tmp_path / "pipeline-staleness" / "metrics.parquet").to_pylist()
    assert [r["step"] for r in records] == [0, 6, 12]
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.3
    last = records[-1]
    assert last["strategy"] == "pipedream" and last["num_workers"] == 2
    # per stage: stage 0 one update stale (its first microbatch none), the last stage never
    assert last["stage_staleness"] == [1.0, 0.0] and last["stage_staleness_theory"] == [1.0, 0.0]
    assert last["stage_stash_bytes"] == [last["stage_param_bytes"][0], 0]
    assert len(last["mem_activation_bytes_per_worker"]) == 2 and last["mem_activation_bytes"] > 0
    assert 0 <= last["bubble_fraction"] < 1 and len(last["stage_bubble_fraction"]) == 2
    assert records[0]["bubble_fraction"] is None  # before the first step
    # never profiled: its sends complete steps after they are posted, which the profiler does not survive
    assert all(r["comm_fraction"] is None for r in records)
    exported = exported_val_loss(result.results_dir, info("kjv", seq_len=32, vocab_size=512), 64)
    assert exported == pytest.approx(last["val_loss"], rel=1e-3) and exported != last["val_loss"]
