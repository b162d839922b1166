"""Time-to-target and its interpolation, on hand-made records."""

import pytest

from raytrain_par.metrics.efficiency import crossing, rank, summarize, workers_text


def recs(*points, trial="t"):
    """points: (step, wall_time_s, val_perplexity)"""
    return [{"experiment": "e", "trial": trial, "strategy": "ddp", "num_workers": 2, "global_batch_size": 32,
             "step": s, "epoch": s / 100, "samples_seen": s * 32, "wall_time_s": t, "val_perplexity": v,
             "val_loss": 0.0, "step_time_s": 0.5 if s else None, "mem_peak_bytes": 100, "mem_model_state_bytes": 10}
            for s, t, v in points]


def test_crossing_interpolates_between_the_bracketing_evaluations():
    r = recs((0, 0.0, 1000.0), (100, 50.0, 400.0), (200, 100.0, 100.0))
    # 200 lies 2/3 of the way from 400 to 100: 50 + 2/3 * 50 s
    assert crossing(r, "val_perplexity", 200.0, "min", "wall_time_s") == pytest.approx(50 + 50 * 2 / 3)
    assert crossing(r, "val_perplexity", 200.0, "min", "epoch") == pytest.approx(1 + 2 / 3)
    assert crossing(r, "val_perplexity", 200.0, "min", "samples_seen") == pytest.approx((100 + 200 / 3) * 32)


def test_crossing_edge_cases():
    r = recs((0, 0.0, 150.0), (100, 50.0, 120.0))
    assert crossing(r, "val_perplexity", 200.0, "min", "wall_time_s") == 0.0  # met before training
    assert crossing(r, "val_perplexity", 100.0, "min", "wall_time_s") is None  # never met
    exact = recs((0, 0.0, 300.0), (100, 40.0, 200.0))
    assert crossing(exact, "val_perplexity", 200.0, "min", "wall_time_s") == 40.0
    acc = [dict(x, val_accuracy=a) for x, a in zip(recs((0, 0, 0), (10, 10, 0), (20, 30, 0)), (0.1, 0.5, 0.9))]
    assert crossing(acc, "val_accuracy", 0.7, "max", "wall_time_s") == pytest.approx(20.0)
    unsorted = list(reversed(recs((0, 0.0, 1000.0), (100, 50.0, 400.0), (200, 100.0, 100.0))))
    assert crossing(unsorted, "val_perplexity", 400.0, "min", "wall_time_s") == 50.0


def test_summarize_and_rank():
    fast = summarize(recs((0, 0, 900.0), (100, 20.0, 150.0), trial="fast"), "val_perplexity", 200.0, "min")
    slow = summarize(recs((0, 0, 900.0), (100, 60.0, 150.0), trial="slow"), "val_perplexity", 200.0, "min")
    never = summarize(recs((0, 0, 900.0), (100, 10.0, 300.0), trial="never"), "val_perplexity", 200.0, "min")
    assert fast["target_reached"] and not never["target_reached"]
    assert fast["time_to_target_s"] < slow["time_to_target_s"]
    assert fast["best_metric"] == 150.0 and never["best_metric"] == 300.0
    assert fast["throughput"] == pytest.approx(100 * 32 / 20.0)
    assert fast["epoch_time_s"] == pytest.approx(20.0)
    assert [r["trial"] for r in rank([never, slow, fast])] == ["fast", "slow", "never"]


def test_summary_of_an_elastic_run_counts_its_resizes_and_worker_seconds():
    # 2 workers for 10 s, 1 worker for the next 20 s, 2 again for the last 10 s
    r = recs((0, 0.0, 900.0), (10, 10.0, 500.0), (20, 30.0, 300.0), (30, 40.0, 200.0))
    for rec, n in zip(r, (2, 2, 1, 2)):
        rec.update(num_workers=n, model_flops_per_step=1e12, peak_tflops=1.0)
    row = summarize(r, "val_perplexity", 200.0, "min")
    assert (row["num_workers"], row["min_workers"], row["resizes"]) == (2, 1, 2)
    assert workers_text(row) == "1-2"
    # 30 steps of 1e12 FLOPs over 10*2 + 20*1 + 10*2 = 60 worker-seconds at a peak of 1 TFLOP/s
    assert row["mfu"] == pytest.approx(30 / 60)
    fixed = summarize(recs((0, 0.0, 900.0), (10, 10.0, 500.0)))
    assert (fixed["resizes"], workers_text(fixed)) == (0, "2")


def test_records_keep_columns_that_appear_later(tmp_path):
    from raytrain_par.metrics.records import RecordWriter, read_records

    w = RecordWriter(tmp_path / "m.parquet")
    w.append({"trial": "t", "step": 0, "val_loss": 1.0})
    w.append({"trial": "t", "step": 2, "val_loss": 0.5, "mem_activation_bytes": 123})
    assert [r.get("mem_activation_bytes") for r in read_records(tmp_path / "m.parquet")] == [None, 123]
