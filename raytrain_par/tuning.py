"""`raytrain-par sweep`: one Ray Tune trial per point of the sweep, each a TorchTrainer run of the
same worker loop.

The Tune + Train V2 pattern: a Tune function trainable builds and fits a TorchTrainer whose
RunConfig carries a callback that hands each evaluation's merged record to Tune. The trial itself
reserves (almost) no CPU — its workers reserve theirs — and the number of trials at once is
capped to what the cluster's free resources hold, since trials that take every CPU wait forever
for their workers. Records reach the driver through Tune's result stream, so metrics.parquet is
written in one place even when trials run on other nodes.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from . import data as data_sets
from . import tracking
from .config import ExperimentSpec
from .driver import make_trainer, preflight, prepare_results_dir, ray_cluster, tracked_figures
from .errors import say
from .metrics.efficiency import rank, summarize, workers_text
from .metrics.records import RecordWriter, merge, progress_line, read_records, write_table
from .goodput import GoodputSearcher, GoodputStopper, make_plan, plan_table
from .sweep import Plan, describe, plan
from .tables import text_table
from .worker import steps_per_epoch



class TuneRecordCallback(TuneReportCallback):
    """On the Train controller: merge the workers' reports of one evaluation into one record and
    pass it to Tune (which stops a trial on it when ASHA says so)."""

    def after_report(self, run_context, metrics, checkpoint):
        if metrics and metrics[0]:
            record = merge(metrics)
            super().after_report(run_context, [{**{k: v for k, v in record.items() if not isinstance(v, list)},
                                                "record": record}], checkpoint)


class SweepRecorder(tune.Callback):
    """On the driver: every record of every trial -> metrics.parquet, with a progress line; keeps
    what each trial was and how it ended."""

    def __init__(self, path: Path, log=say):
        self.writer, self.log = RecordWriter(path), log
        self.trials: dict[str, dict] = {}  # trial id -> {name, overrides, status, error}

    def on_trial_start(self, iteration, trials, trial, **info):
        overrides = trial_overrides(trial.config)
        self.trials[trial.trial_id] = {"name": trial_name(trial.trial_id, overrides), "overrides": overrides,
                                       "status": "running", "error": None}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        record = result.get("record")
        if record:
            self.writer.append(record)
            self.log(progress_line(record))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.trials[trial.trial_id]["status"] = "completed"

    def on_trial_error(self, iteration, trials, trial, **info):
        t = self.trials[trial.trial_id]
        t["status"], t["error"] = "failed", str(getattr(trial, "error_msg", None) or "failed")


def trial_overrides(config: dict) -> dict:
    return {**config["point"], **config.get("random", {})}


def trial_name(trial_id: str, overrides: dict) -> str:
    """e.g. '00003-w2-b64': Tune's trial counter, then the trial's values."""
    return f"{trial_id.rsplit('_', 1)[-1]}-{describe(overrides)}"


def _trial(config: dict, base: dict, sweep, storage: str) -> None:
    """A Tune trial: the trial's experiment, trained by a TorchTrainer."""
    from .sweep import trial_spec

    overrides = trial_overrides(config)
    spec = trial_spec(base, sweep, overrides)
    info = data_sets.prepare(spec.data, spec.data.cache_dir, log=lambda *_: None)
    name = trial_name(tune.get_context().get_trial_id(), overrides)
    trainer = make_trainer(spec, info, Path(storage), name=name, trial=name, callbacks=[TuneRecordCallback()])
    trainer.fit()


def _domain(dom):
    if isinstance(dom, list):
        return tune.choice(dom)
    lo, hi = dom["min"], dom["max"]
    if dom.get("int"):
        return tune.lograndint(lo, hi + 1) if dom.get("log") else tune.randint(lo, hi + 1)
    return tune.loguniform(lo, hi) if dom.get("log") else tune.uniform(lo, hi)


def concurrency(p: Plan) -> int:
    """Trials the cluster's free resources hold at once (Plan.trials_held)."""
    return p.trials_held(ray.available_resources())


@dataclass
class SweepResult:
    results_dir: Path
    trials: list[dict]
    records: list[dict]


def run_sweep(spec: ExperimentSpec, address: str | None = None, resume: bool = False,
              log=say) -> SweepResult:
    preflight(spec, address, log)
    p = plan(spec)
    for point in p.points:  # every distinct data set is prepared once, here, before any trial
        data_sets.prepare(p.trial_spec(point).data, spec.data.cache_dir, log=log)
    results = prepare_results_dir(spec, resume, log=log, run_subdir="tune")
    storage = results / "trials"
    # The embedded cluster is sized for the largest trial.
    biggest = max((p.trial_spec(pt) for pt in p.points), key=lambda s: s.scaling.num_workers)
    recorder = SweepRecorder(results / "metrics.parquet", log=log)
    trackers = tracking.for_sweep(spec, p, results, lambda name: next(
        t["overrides"] for t in recorder.trials.values() if t["name"] == name))
    with ray_cluster(biggest, address, log=log):
        n = concurrency(p)
        scheduler = None
        if p.sweep.early_stopping:
            es = p.sweep.early_stopping
            scheduler = tune.schedulers.ASHAScheduler(
                time_attr="wall_time_s", grace_period=es.grace_period_s, reduction_factor=es.reduction_factor,
                max_t=es.max_t_s or 10**6)  # seconds; rungs stop at max_t, so a bound is required
        search_alg = stopper = goodput = None
        param_space = {"point": tune.grid_search(p.points) if len(p.points) > 1 else p.points[0]}
        num_samples = p.sweep.num_samples
        if p.sweep.search == "optuna":
            from ray.tune.search.optuna import OptunaSearch

            search_alg = OptunaSearch()
        elif p.sweep.search == "goodput":
            goodput = _goodput_search(spec, p, address, resume, log)
            search_alg, stopper = goodput.searcher, GoodputStopper(goodput.searcher)
            param_space, num_samples = {}, len(p.points)
        if p.sweep.random:
            param_space["random"] = {k: _domain(v) for k, v in p.sweep.random.items()}
        log(f"{spec.name}: sweep of {'up to ' if goodput else ''}{len(p.points) * p.sweep.num_samples} trial(s), "
            f"{n} at a time, judged by {p.metric}" + (f" (target {p.target:g})" if p.target is not None else ""))
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_trial, base=p.base, sweep=p.sweep, storage=str(storage)),
                                {"CPU": 0.001}),
            param_space=param_space,
            tune_config=tune.TuneConfig(
                metric=p.metric if (scheduler or search_alg) else None, mode=p.mode if (scheduler or search_alg) else None,
                num_samples=num_samples, max_concurrent_trials=n, scheduler=scheduler, search_alg=search_alg),
            run_config=tune.RunConfig(name="tune", storage_path=str(results), callbacks=[recorder], verbose=0,
                                      stop=stopper),
        )
        if resume and tune.Tuner.can_restore(str(results / "tune")):
            tuner = tune.Tuner.restore(str(results / "tune"), trainable=tune.with_resources(
                tune.with_parameters(_trial, base=p.base, sweep=p.sweep, storage=str(storage)), {"CPU": 0.001}),
                resume_errored=True)
        with tracking.Follow(trackers, results / "metrics.parquet") if trackers else nullcontext():
            tuner.fit()
    records = read_records(results / "metrics.parquet") if (results / "metrics.parquet").exists() else []
    rows = [_trial_row(p, t, [r for r in records if r["trial"] == t["name"]]) for t in recorder.trials.values()]
    if goodput:
        rows = goodput.rows(rows, recorder.trials)
    rows = rank(rows, p.mode)
    path = write_table(results / "trials.parquet", rows)
    if trackers:
        trackers.close({r["trial"]: r for r in rows}, tracked_figures(results) if records else [])
    log("")
    log(trials_table(rows))
    log(f"{len(rows)} trials in {path}; records in {results / 'metrics.parquet'}")
    return SweepResult(results, rows, records)


@dataclass
class _Goodput:
    """search: goodput: the plan's predictions and the searcher that trains by them."""

    plan_rows: list[dict]
    searcher: GoodputSearcher

    def rows(self, trained: list[dict], trials: dict[str, dict]) -> list[dict]:
        """trials.parquet's rows with the prediction beside what was measured, and one row per point
        the search did not train (and why). Points are matched by their overrides, so that a resumed
        search (whose searcher Tune restores on its own) is matched as well."""
        plan = {_key(r["overrides"]): r for r in self.plan_rows}
        stopped = {trials[tid]["name"] for tid in self.searcher.stopped if tid in trials}
        out, tried = [], set()
        for row in trained:
            tried.add(_key(row["overrides"]))
            if row["trial"] in stopped:
                row["status"] = "stopped: slower than the best"
            out.append({**row, **_prediction(plan.get(_key(row["overrides"])))})
        for k, r in plan.items():
            if k in tried:
                continue
            why = ("not trained: does not fit in device memory" if r["fits"] is False else
                   "not trained: predicted slower than the best")
            spec_fields = {"trial": r["trial"], "overrides": r["overrides"], "strategy": r["strategy"],
                           "num_workers": r["num_workers"], "global_batch_size": r["global_batch_size"], "lr": r["lr"],
                           "status": why, "error": None}
            out.append({**spec_fields, **_prediction(r)})
        return out


def _key(overrides: str) -> str:
    return json.dumps(json.loads(overrides), sort_keys=True)


def _prediction(r: dict | None) -> dict:
    keys = ("predicted_time_to_target_s", "predicted_steps_to_target", "predicted_step_time_s",
            "statistical_efficiency")
    return {"predicted_rank": r and r["rank"], **{k: r and r[k] for k in keys}}


def _goodput_search(spec: ExperimentSpec, p: Plan, address: str | None, resume: bool, log) -> _Goodput:
    """The plan (reference run and probes, on the cluster already started; on --resume the one the
    interrupted search made) and its searcher."""
    path = spec.results_dir / "plan.parquet"
    if resume and path.exists():
        rows = read_records(path)
        log(f"goodput plan of the interrupted search, from {path}:")
    else:
        gp = make_plan(spec, address, log=log)
        rows = gp.rows
        log(f"goodput plan ({gp.seconds:.0f} s, in {gp.path}):")
    log(plan_table(rows))
    g = p.sweep.goodput
    return _Goodput(rows, GoodputSearcher(rows, p.metric, p.mode, p.target, g.min_trials, g.margin, log=log))


def _trial_row(p: Plan, trial: dict, records: list[dict]) -> dict:
    spec = p.trial_spec(trial["overrides"])
    row = summarize(records, p.metric, p.target, p.mode) if records else {"experiment": spec.name}
    status = trial["status"]
    if status == "completed" and records:
        info = data_sets.prepare(spec.data, spec.data.cache_dir, log=lambda *_: None)
        planned = spec.total_steps(steps_per_epoch(spec, info))
        met_and_stopped = spec.train.stop_at_target and records[-1].get("target_met")
        # the run's length counts progress: steps of the starting batch (an adaptive batch takes fewer, larger)
        done = records[-1].get("progress")
        if (records[-1]["step"] if done is None else done) < planned and not met_and_stopped:
            status = "stopped early"
    row.update({"trial": trial["name"], "overrides": json.dumps(trial["overrides"]), "status": status,
                "error": trial["error"], "strategy": spec.strategy.name, "num_workers": spec.scaling.num_workers,
                "global_batch_size": spec.train.global_batch_size, "lr": spec.train.lr})
    return row


def trials_table(rows: list[dict]) -> str:
    """The ranked trials, for the terminal and the report."""
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    metric = next((r["metric"] for r in rows if r.get("metric")), "metric")
    head = ["#", "trial", "strategy", "workers", "batch", "lr", "to_target_s", "to_target_ep", f"best_{metric}",
            "s/step", "samples/s", "peak_MiB", "status"]
    predicted = any(r.get("predicted_time_to_target_s") is not None for r in rows)
    if predicted:
        head.insert(7, "predicted_s")
    body = []
    for i, r in enumerate(rows):
        line = [str(i + 1), r["trial"], r["strategy"], workers_text(r), str(r["global_batch_size"]),
                f(r.get("lr"), ".3g"), f(r.get("time_to_target_s"), ".1f"), f(r.get("epochs_to_target"), ".2f"),
                f(r.get("best_metric"), ".4g"), f(r.get("mean_step_time_s"), ".3f"), f(r.get("throughput"), ".1f"),
                f(None if r.get("mem_peak_bytes") is None else r["mem_peak_bytes"] / 2**20, ".0f"), r["status"]]
        if predicted:
            line.insert(7, f(r.get("predicted_time_to_target_s"), ".1f"))
        body.append(line)
    return text_table(head, body)
