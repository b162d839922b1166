"""Adaptive batch size: the noise-scale-to-efficiency formula and the learning-rate gain against brute
force on a toy problem, and the decision rule against hand-made step times and noise scales
(metrics/adaptive.py)."""

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from engines import KJV, experiment, loop
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics import adaptive
from raytrain_par.metrics.records import read_records
from raytrain_par.metrics.adaptive import Layout, Shape, decide


def _toy(n=6, d=3, seed=0):
    """Least squares whose Hessian is the identity ((1/n) X^T X = I), at a point off its minimum: the
    per-row gradients g_i = x_i (x_i . w - y_i) and the exact B_simple = tr(Sigma) / |G|^2."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    x = q * math.sqrt(n)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    grads = x * (x @ w - y)[:, None]
    mean = grads.mean(0)
    trace = ((grads - mean) ** 2).sum(1).mean()  # the population covariance: rows drawn with replacement
    return grads, float(trace / mean.dot(mean))


def _expected_square(grads: torch.Tensor, batch: int) -> float:
    """E |g_B|^2 over every batch of `batch` rows drawn with replacement, enumerated."""
    n = len(grads)
    total = 0.0
    for idx in itertools.product(range(n), repeat=batch):
        g = grads[list(idx)].mean(0)
        total += float(g.dot(g))
    return total / n ** batch


def _best_gain_per_row(grads: torch.Tensor, batch: int) -> float:
    """The loss one step of `batch` rows lowers in expectation with its best learning rate, per row: on a
    loss with identity Hessian, E L(w - eps g_B) = L(w) - eps |G|^2 + eps^2 / 2 E|g_B|^2, best at
    eps = |G|^2 / E|g_B|^2, lowering it by |G|^4 / (2 E|g_B|^2)."""
    mean = grads.mean(0)
    return float(mean.dot(mean)) ** 2 / (2 * _expected_square(grads, batch)) / batch


def test_efficiency_is_the_gain_per_row_of_the_best_step_by_enumeration():
    grads, noise = _toy()
    for base, batch in [(1, 2), (1, 4), (2, 4), (2, 5), (3, 1)]:
        brute = _best_gain_per_row(grads, batch) / _best_gain_per_row(grads, base)
        assert adaptive.efficiency(noise, batch, base) == pytest.approx(brute, rel=1e-9)


def test_adascale_gain_is_the_ratio_of_expected_squared_gradients():
    """AdaScale's gain r = E|g_M0|^2 / E|g_M|^2 (its definition, in terms of variance and mean)."""
    grads, noise = _toy(seed=3)
    for base, batch in [(1, 3), (2, 4), (1, 5)]:
        brute = _expected_square(grads, base) / _expected_square(grads, batch)
        assert adaptive.gain(noise, batch, base) == pytest.approx(brute, rel=1e-9)
        assert 1 <= adaptive.gain(noise, batch, base) <= batch / base


def test_lr_rules():
    assert adaptive.lr_scale("linear", 10.0, 64, 16) == 4
    assert adaptive.lr_scale("sqrt", 10.0, 64, 16) == 2
    assert adaptive.lr_scale("adascale", 48.0, 64, 16) == pytest.approx(64 / 16 * (48 + 16) / (48 + 64))
    assert adaptive.lr_scale("adascale", None, 64, 16) == 4  # noise unknown: every row counts
    with pytest.raises(ValueError, match="lr_scaling 'cubic'"):
        adaptive.lr_scale("cubic", 1.0, 2, 1)


def test_shapes_split_over_replicas_and_accumulate_beyond_memory():
    dp = Layout(replicas=2, max_rows=8)
    assert dp.shape(7) is None  # does not split over 2 replicas
    assert dp.shape(16) == Shape(16, 1)
    assert dp.shape(20) == Shape(20, 2)  # 10 rows per replica: two accumulation steps of 5
    assert dp.shape(34) == Shape(34, 17)  # 17 rows per replica: only 17 steps of one row fit
    assert Layout(replicas=1, max_rows=4).shape(6) == Shape(6, 2)
    # a pipeline of 4 micro-batches: each accumulation step holds a multiple of 4 rows
    assert Layout(replicas=1, unit=4, max_rows=8).shape(24) == Shape(24, 3)
    assert Layout(replicas=1, unit=4).shape(6) is None
    # a schedule built for one micro-batch shape: only the accumulation changes
    fixed = Layout(replicas=2, fixed_rows=4)
    assert fixed.shape(24) == Shape(24, 3)
    assert fixed.shape(20) is None
    assert [s.batch for s in fixed.shapes(8, 32)] == [8, 16, 24, 32]
    assert Shape(24, 3).rows_per_micro_batch(2) == 4


def test_the_decision_maximises_goodput_against_the_closed_form():
    """With T(M) = a + b M and efficiency (phi + M0) / (phi + M), goodput M (phi + M0) / ((a + b M)(phi + M))
    peaks at M* = sqrt(a phi / b): a = 1 s, b = 0.01 s per row, phi = 400 rows -> 200."""
    shapes = Layout(replicas=8).shapes(16, 512)
    c = decide(shapes, base=16, current=16, noise_scale=400.0, rule="adascale",
               step_time=lambda s: 1.0 + 0.01 * s.batch)
    assert (c.batch, c.accumulation, c.reason) == (200, 1, "goodput")
    assert c.efficiency == pytest.approx(416 / 600)
    assert c.goodput == pytest.approx(200 / 3.0 * 416 / 600)
    assert c.lr_scale == pytest.approx(200 / 16 * 416 / 600)
    # no fixed cost per step: every row costs the same, so the smallest batch wastes none
    assert decide(shapes, 16, 64, 400.0, "adascale", lambda s: 0.01 * s.batch).batch == 16
    # a noise scale far above every batch: the largest
    assert decide(shapes, 16, 16, 1e9, "linear", lambda s: 1.0 + 0.01 * s.batch).batch == 512


def test_the_decision_before_two_batches_are_timed():
    shapes = Layout(replicas=2).shapes(8, 64)
    # noise unknown: stays
    assert decide(shapes, 8, 8, None, "adascale", None).batch == 8
    # noise above the batch, nothing fitted yet: doubles, to time a second batch
    c = decide(shapes, 8, 8, 20.0, "adascale", None)
    assert (c.batch, c.reason) == (16, "explore")
    assert decide(shapes, 8, 48, 500.0, "adascale", None).batch == 64  # within the largest allowed
    # noise below the batch: doubling would waste a third of its rows or more
    assert decide(shapes, 8, 16, 10.0, "adascale", None).batch == 16


# -- adaptive runs through the worker's own loop, in plain gloo process groups ------------------------

def _timed(seconds):
    """The interval step times a run decides on, replaced by `seconds(rows per replica, accumulation)`: the
    decisions, which follow measured times, are the test's to fix (a resumed run must replay them)."""
    from raytrain_par.worker import Trainer

    def fake(self, interval_s, interval_steps):
        return seconds(self.loader.global_batch // self.engine.dp_size, self.engine.train.gradient_accumulation_steps)

    Trainer._seconds_per_step = fake


def _step_time(rows, accumulation):
    """0.2 s a step and 0.01 s a row: with the measured noise scale the best batch is well above the start."""
    return 0.2 + 0.01 * rows


def _adaptive_spec(strategy="ddp", steps=16, batch=8, workers=2, **adaptive_batch):
    spec = experiment("gpt2-tiny", KJV, strategy=strategy, workers=workers, batch=batch, steps=steps, eval_every_steps=2,
                      checkpoint_every_evals=1, eval_at_start=False, lr_schedule="cosine", warmup_steps=2,
                      adaptive_batch={"max_global_batch_size": 20, **adaptive_batch})
    spec["data"]["max_val_samples"] = 16
    return spec


def _adaptive_run(rank, world, spec_dict, info_dict, root, resume=False):
    _timed(_step_time)
    return loop(spec_dict, info_dict, root, resume=resume)


def _resume_runs(rank, world, info_dict, tmp):
    """An uninterrupted adaptive ddp run; its copy cut back to its third checkpoint, resumed; zero-2 and
    fsdp under the same decisions."""
    import torch.distributed as dist

    tmp = Path(tmp)
    out = {"ddp": _adaptive_run(rank, world, _adaptive_spec(), info_dict, tmp / "ddp")}
    if rank == 0:
        shutil.copytree(tmp / "ddp", tmp / "resumed")
        for late in sorted((tmp / "resumed").glob("checkpoint_*"))[3:]:
            shutil.rmtree(late)
    dist.barrier()
    out["resumed"] = _adaptive_run(rank, world, _adaptive_spec(), info_dict, tmp / "resumed", resume=True)
    for name in ("zero-2", "fsdp"):
        out[name] = _adaptive_run(rank, world, _adaptive_spec(name), info_dict, tmp / name)
    for name in ("ddp", "zero-2"):  # at most 4 rows a replica at once: larger batches accumulate
        out[f"{name} capped"] = _adaptive_run(rank, world, _adaptive_spec(name, max_micro_batch_rows=4), info_dict,
                                              tmp / f"{name}-capped")
    out["settling"] = _settling_run(info_dict, tmp / "settling")
    return out


def _settling_run(info_dict, root):
    """A run evaluating every 5 steps of progress, with the steps each decision's timing counted."""
    from raytrain_par.worker import Trainer

    counted = []

    def fake(self, interval_s, interval_steps):
        counted.append(interval_steps)
        return _step_time(self.loader.global_batch // self.engine.dp_size, 1)

    Trainer._seconds_per_step = fake
    spec = _adaptive_spec(steps=20, lr_scaling="sqrt")
    spec["train"]["eval_every_steps"] = 5
    return {"records": loop(spec, info_dict, root), "counted": counted}


@pytest.fixture(scope="module")
def adaptive_runs(info, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adaptive")
    return run_ranks(2, _resume_runs, info(**KJV), str(tmp))[0], tmp


def _trained(records):
    return [(r["step"], r["global_batch_size"], r["gradient_accumulation_steps"], r["lr"], r["train_loss"],
             r["val_loss"], r["next_global_batch_size"]) for r in records]


def test_an_adaptive_run_grows_its_batch_to_the_goodput_optimum(adaptive_runs):
    out, tmp = adaptive_runs
    records = out["ddp"]
    batches = [r["global_batch_size"] for r in records]
    # the first decision explores (doubles: one batch size timed), the next fits 0.2 s + 0.01 s a row per
    # replica and the measured noise scale phi: M* = sqrt(0.2 phi / 0.005), at most the largest batch allowed
    # (20 rows: phi is 10 or more here, so M* is 20 or more)
    assert batches[:3] == [8, 16, 20] and records[0]["batch_decision"] == "explore"
    for r in records[1:-1]:
        phi = r["grad_noise_scale"]
        best = min(math.sqrt(0.2 * phi / 0.005), 20)
        assert abs(r["next_global_batch_size"] - best) <= 2, (r["step"], phi)
    # the schedule runs on progress: each step of M advances it by its lr_scale (AdaScale's gain)
    assert records[-1]["progress"] >= 16 > records[-2]["progress"]
    assert records[-1]["step"] < 16  # fewer, larger steps than the 16 steps of 8 rows
    for r in records:
        assert 1 <= r["lr_scale"] <= r["global_batch_size"] / 8
        assert r["samples_seen"] == sum(x["global_batch_size"] * (x["step"] - p["step"])
                                        for p, x in zip([{"step": 0}] + records, records) if x["step"] <= r["step"])
    trained = read_records(tmp / "ddp" / "metrics.parquet")
    assert [r["global_batch_size"] for r in trained] == batches  # as written to metrics.parquet


def test_a_resumed_adaptive_run_equals_the_uninterrupted_one(adaptive_runs):
    out, tmp = adaptive_runs
    resumed, whole = out["resumed"], out["ddp"]
    first = resumed[0]["resumed_from_step"]
    assert first == 5  # after two decisions changed the batch (8 -> 16 at step 2, 16 -> 20 at step 4)
    after = [r for r in whole if r["step"] > first]
    # the same steps, batches, rates, losses and decisions, to the bit; so the noise scale, which AdaScale's
    # rate follows (DDP's buckets, built again after a restarted process's first step, do not change its sum:
    # Engine.add_parameter_squares)
    assert _trained(resumed) == _trained(after)
    assert [r["grad_noise_scale"] for r in resumed] == [r["grad_noise_scale"] for r in after]
    # the checkpoint holds what the decisions were made from: the timed intervals and the latest choice
    loop_state = json.loads((sorted((tmp / "resumed").glob("checkpoint_*"))[2] / "loop.json").read_text())["state"]
    assert [p[1:3] for p in loop_state["probes"]] == [[4, 1], [8, 1], [10, 1]]
    assert loop_state["global_batch_size"] == 20 and loop_state["choice"]["batch"] == 20


@pytest.mark.parametrize("name", ["zero-2", "fsdp"])
def test_every_data_parallel_strategy_adapts_alike(adaptive_runs, name):
    out, _ = adaptive_runs
    theirs, ddp = out[name], out["ddp"]
    assert [t[:3] + t[6:] for t in _trained(theirs)] == [t[:3] + t[6:] for t in _trained(ddp)]
    for a, b in zip(theirs, ddp):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        # each engine sums the squares of the noise scale in its own order
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-4)


@pytest.mark.parametrize("name", ["ddp", "zero-2"])
def test_beyond_the_rows_that_fit_a_batch_accumulates(adaptive_runs, name):
    """max_micro_batch_rows 4: batch 16 is 2 accumulation steps of 4 rows a replica; batch 20, 10 rows a
    replica, the fewest equal steps of at most 4 rows (5 of 2). The decisions are those made without the
    limit (the step times here do not depend on it), and so is the training, to rounding."""
    capped, free = adaptive_runs[0][f"{name} capped"], adaptive_runs[0]["ddp"]
    assert [(r["global_batch_size"], r["gradient_accumulation_steps"]) for r in capped[:3]] == [(8, 1), (16, 2), (20, 5)]
    assert [t[:2] + t[6:] for t in _trained(capped)] == [t[:2] + t[6:] for t in _trained(free)]
    # (zero-N takes the noise scale's small batch per micro-batch: other rows, so a slightly other rate)
    for a, b in zip(capped, free):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


def test_the_first_steps_at_a_new_batch_are_not_timed(adaptive_runs):
    """The step time a decision sees leaves out the first two steps of the run and of each new batch (they
    allocate and warm caches); an interval of no more steps than that is timed whole."""
    out, _ = adaptive_runs
    records, counted = out["settling"]["records"], out["settling"]["counted"]
    steps = [r["step"] - p["step"] for p, r in zip([{"step": 0}] + records, records)]
    batches = [r["global_batch_size"] for r in records]
    assert len(set(batches)) >= 3  # the batch changed at least twice
    new = [True] + [a != b for a, b in zip(batches, batches[1:])]
    expected = [n - 2 if fresh and n > 2 else n for n, fresh in zip(steps, new)]
    assert counted == expected and any(n < s for n, s in zip(counted, steps)) and not all(new)


def test_the_report_plots_the_batch_and_goodput_against_wall_time(adaptive_runs):
    from raytrain_par.report import write_report

    _, tmp = adaptive_runs
    files = write_report(tmp / "ddp", tmp / "report")
    assert tmp / "report" / "adaptive_batch.png" in files
    assert "adaptive_batch.png" in (tmp / "report" / "summary.md").read_text()


FOUR = {"pipeline": {"name": "pipeline", "stages": 2, "microbatches": 2},
        "megatron": {"name": "megatron", "tensor_parallel": 2}}
LARGEST = {"pipeline": {"max_global_batch_size": 24}}


def _four_rank_runs(rank, world, info_dict, tmp, two_rank_tmp):
    import torch.distributed as dist

    # (a pipeline's batches are multiples of 8 here: it may go to 24)
    out = {name: _adaptive_run(rank, world, _adaptive_spec(strategy, workers=4, **LARGEST.get(name, {})), info_dict,
                               Path(tmp) / name)
           for name, strategy in FOUR.items()}
    # the two-rank ddp run's third checkpoint (step 5, batch 20), resumed on four workers, as an elastic
    # run's resize resumes it
    if rank == 0:
        shutil.copytree(Path(two_rank_tmp) / "ddp", Path(tmp) / "grown")
        for late in sorted((Path(tmp) / "grown").glob("checkpoint_*"))[3:]:
            shutil.rmtree(late)
    dist.barrier()
    out["grown"] = _adaptive_run(rank, world, _adaptive_spec(workers=4), info_dict, Path(tmp) / "grown", resume=True)
    return out


@pytest.fixture(scope="module")
def four_rank_runs(info, tmp_path_factory, adaptive_runs):
    return run_ranks(4, _four_rank_runs, info(**KJV), str(tmp_path_factory.mktemp("adaptive4")),
                     str(adaptive_runs[1]))[0]


def test_a_pipeline_adapts_by_accumulating_its_schedule(four_rank_runs, adaptive_runs):
    """P2 x D2, 2 micro-batches of 2 rows per replica: the schedule keeps its 4 rows a replica and step, so
    a batch is a multiple of 8 and grows by running the schedule several times (accumulation)."""
    pipe, ddp = four_rank_runs["pipeline"], adaptive_runs[0]["ddp"]
    assert [(r["global_batch_size"], r["gradient_accumulation_steps"]) for r in pipe[:3]] == [(8, 1), (16, 2), (24, 3)]
    assert all(r["global_batch_size"] == 8 * r["gradient_accumulation_steps"] for r in pipe)
    # the best multiple of 8 near the optimum (about 20 rows)
    assert {r["next_global_batch_size"] for r in pipe[2:-1]} == {24}
    for a, b in zip(pipe[:2], ddp[:2]):  # the same batches as ddp's so far: the same losses
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


def test_megatron_tensor_by_data_adapts_as_ddp(four_rank_runs, adaptive_runs):
    meg, ddp = four_rank_runs["megatron"], adaptive_runs[0]["ddp"]
    assert [t[:3] + t[6:] for t in _trained(meg)] == [t[:3] + t[6:] for t in _trained(ddp)]
    for a, b in zip(meg, ddp):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


# -- bad input, refused before anything starts -----------------------------------------------------

from raytrain_par import config  # noqa: E402
from raytrain_par.errors import ConfigError  # noqa: E402


@pytest.mark.parametrize("strategy, workers, adaptive_batch, field, words", [
    ("ddp", 2, {"max_global_batch_size": 64, "min_global_batch_size": 128}, "max_global_batch_size",
     "below the smallest batch the run may train with (128)"),
    ("ddp", 2, {"max_global_batch_size": 65}, "max_global_batch_size", "a multiple of 2 rows"),
    ("ddp", 2, {"max_global_batch_size": 64, "min_global_batch_size": 3}, "min_global_batch_size", "e.g. 2"),
    ("ddp", 2, {"max_global_batch_size": 8, "min_global_batch_size": 8}, "global_batch_size",
     "outside train.adaptive_batch's range [8, 8]"),
    ("ddp", 2, {"max_global_batch_size": 64, "every_evals": 0}, "every_evals", "must be >= 1"),
    ("ddp", 2, {"max_global_batch_size": 64, "lr_scaling": "cubic"}, "lr_scaling", "not one of 'adascale', 'sqrt', 'linear'"),
    ({"name": "pipeline", "stages": 2, "microbatches": 2}, 4, {"max_global_batch_size": 36}, "max_global_batch_size",
     "a multiple of 16 rows (2 data-parallel replicas x 8 rows per accumulation step, which its pipeline"),
    ({"name": "pipedream", "stages": 2}, 2, {"max_global_batch_size": 64}, "adaptive_batch",
     "pipedream never measures it"),
    ("ddp", 1, {"max_global_batch_size": 64}, "adaptive_batch", "does not measure the gradient noise scale"),
    ({"name": "megatron", "tensor_parallel": 2}, 2, {"max_global_batch_size": 64}, "adaptive_batch",
     "it needs two data-parallel replicas or more"),
    ("ddp", 2, {"max_global_batch_size": 64, "max_micro_batch_rows": 4}, "max_micro_batch_rows",
     "the starting batch already computes 8 rows at once per replica"),
    ({"name": "pipeline", "stages": 2, "microbatches": 2}, 4, {"max_global_batch_size": 64, "max_micro_batch_rows": 8},
     "max_micro_batch_rows", "a pipeline keeps the rows of one accumulation step"),
])
def test_bad_adaptive_batch_is_refused_before_start(strategy, workers, adaptive_batch, field, words):
    spec = {"name": "a", "model": {"name": "gpt2-tiny"}, "data": KJV,
            "strategy": strategy if isinstance(strategy, dict) else {"name": strategy},
            "scaling": {"num_workers": workers},
            "train": {"global_batch_size": 16, "max_steps": 10, "adaptive_batch": adaptive_batch}}
    with pytest.raises(ConfigError) as err:
        config.parse(spec)
    assert err.value.field.startswith("train.") and err.value.field.endswith(field)
    assert words in str(err.value)


def test_an_adaptive_batch_round_trips_and_check_says_it():
    from raytrain_par.summary import lines, run_summary

    spec = config.parse({"name": "a", "model": {"name": "gpt2-tiny"}, "data": KJV, "scaling": {"num_workers": 2},
                         "train": {"global_batch_size": 16, "adaptive_batch": {"max_global_batch_size": 64}}})
    assert spec.train.adaptive_batch == config.AdaptiveBatchSpec(64, None, "adascale", 1, None)
    assert config.from_dict(spec.to_dict()) == spec
    summary = run_summary(spec)
    assert summary["adaptive_batch"] == {"min": 16, "max": 64, "lr_scaling": "adascale", "every_evals": 1}
    assert ("# adaptive batch: from 16, within [16, 64], chosen every 1 evaluation(s); lr scaled by adascale; steps "
            "below are of the starting batch (progress)") in lines(summary)


# -- plan: an adaptive point against fixed ones ----------------------------------------------------

def test_plan_predicts_an_adaptive_point_interval_by_interval():
    """Step time 0.15 s + 0.005 s a row of the global batch (2 replicas); the reference's noise scale is 2
    rows over its first 50 steps of S_min, 60 over its next 50. The adaptive point picks, per interval, the
    batch of greatest goodput sqrt(a phi / b) within [8, 64]: 8 (sqrt(60) is below the minimum), then 42."""
    from raytrain_par.goodput import predict, strategy_key
    from raytrain_par.metrics.goodput import Reference
    from raytrain_par.metrics.throughput import StepTimeModel, ThroughputModel
    from raytrain_par.sweep import check_goodput, plan

    spec = config.parse({"name": "g", "model": "gpt2-tiny", "data": {"name": "kjv", "seq_len": 32, "vocab_size": 512},
                         "scaling": {"num_workers": 2}, "train": {"global_batch_size": 8, "max_steps": 10, "lr": 1e-3},
                         "target": "val_loss <= 3.0",
                         "sweep": {"grid": {"train.adaptive_batch": [None, {"max_global_batch_size": 64}]}}})
    p = plan(spec)
    check_goodput(p, "raytrain-par plan")  # one global batch, and a point that spans many
    ref = Reference(batch=8, steps=50 * (1 + 2 / 8) + 50 * (1 + 60 / 8), min_steps=100.0, noise_scale=31.0,
                    intervals=[(50.0, 2.0), (50.0, 60.0)])
    model = ThroughputModel({strategy_key(p.trial_spec(p.points[0])): StepTimeModel(0.1, 0.01, 0.05, 0.0)})
    rows = {r["trial"]: r for r in predict(p, ref, model)}
    assert set(rows) == {"adaptive-fixed", "adaptive-64"}
    fixed, adapt = rows["adaptive-fixed"], rows["adaptive-64"]
    assert fixed["predicted_steps_to_target"] == pytest.approx(ref.steps)
    steps = 50 * (1 + 2 / 8) + 50 * (1 + 60 / 42)
    seconds = 50 * (1 + 2 / 8) * (0.15 + 0.005 * 8) + 50 * (1 + 60 / 42) * (0.15 + 0.005 * 42)
    assert adapt["predicted_batches"] == "8 -> 42"
    assert adapt["predicted_steps_to_target"] == pytest.approx(steps)
    assert adapt["predicted_time_to_target_s"] == pytest.approx(seconds)
    assert adapt["predicted_time_to_target_s"] < fixed["predicted_time_to_target_s"] and adapt["rank"] == 1
    rows_to_target = 50 * (1 + 2 / 8) * 8 + 50 * (1 + 60 / 42) * 42
    assert adapt["statistical_efficiency"] == pytest.approx(ref.steps * 8 / rows_to_target)


def test_a_resize_decides_again_for_the_new_worker_count(four_rank_runs, adaptive_runs):
    """Resumed on 4 workers from a 2-worker checkpoint at batch 20: the decision is taken again for 4, with
    no step time measured on 4 yet and a noise scale (about 10) below the batch, so it keeps 20, which 4
    replicas can cut; the training goes on as the 2-worker run's, to rounding."""
    grown, two = four_rank_runs["grown"], adaptive_runs[0]["ddp"]
    assert grown[0]["resumed_from_step"] == 5 and {r["num_workers"] for r in grown} == {4}
    assert all(r["global_batch_size"] == 20 for r in grown)
    assert {r["batch_decision"] for r in grown[:-1]} == {"start"}
    for a, b in zip(grown, [r for r in two if r["step"] > 5]):
        assert a["step"] == b["step"] and a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


def test_the_rows_that_fit_follow_the_memory_estimate():
    """On a GPU the rows a replica computes at once are capped by what `estimate` says fits: states and
    gathered units whatever the rows, activations in proportion to them, within HEADROOM of the memory."""
    from raytrain_par import estimate

    spec = config.parse({"name": "a", "model": {"name": "gpt2-tiny"}, "data": KJV, "strategy": {"name": "zero-3"},
                         "scaling": {"num_workers": 2}, "train": {"global_batch_size": 16}})
    row = estimate.estimate(spec, ["zero-3"], [2])[0]
    fixed, per_row = row.expected - row.offloaded + row.gathered, row.activations / 8
    for rows in (8, 40, 1000):
        memory = (fixed + rows * per_row) / estimate.HEADROOM
        assert estimate.rows_that_fit(spec, int(memory) + 1) == rows
    assert estimate.rows_that_fit(spec, int(fixed)) == 1  # never below one row


def test_the_progress_line_says_the_batch_decided():
    from raytrain_par.metrics.records import progress_line

    record = {"experiment": "e", "trial": "run", "step": 4, "epoch": 0.1, "wall_time_s": 1.0, "train_loss": 5.0,
              "val_loss": 4.0, "throughput": 10.0, "mem_peak_bytes": 2**20, "mem_model_state_bytes": 2**20,
              "global_batch_size": 16, "next_global_batch_size": 20}
    assert "batch 16 -> 20" in progress_line(record)
    assert "batch" not in progress_line({**record, "next_global_batch_size": None})
