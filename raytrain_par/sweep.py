"""Sweep plans: the `sweep:` block of an experiment -> the trials to run, every one validated
before anything starts.

    sweep:
      grid:                                  # every combination of these values
        scaling.num_workers: [1, 2, 4]
        train.global_batch_size: [32, 64]
        strategy: [{name: ddp}, {name: zero-2}]
      cases:                                 # explicit combinations, crossed with the grid
        - {scaling.num_workers: 1, train.global_batch_size: 32}
        - {scaling.num_workers: 2, train.global_batch_size: 64}
      random:                                # sampled per trial: a list is a choice,
        train.lr: {min: 1.0e-4, max: 1.0e-2, log: true}   # a range is uniform (log: log-uniform)
      search: grid                           # grid | random | optuna | goodput
      goodput: {min_trials: 2, margin: 0.0}  # search: goodput only (see below)
      num_samples: 1                         # draws of the random keys (per grid point)
      lr_scaling: sqrt                       # none | linear | sqrt: lr follows the global batch
      max_concurrent_trials: 2               # default: as many as the cluster's free CPUs/GPUs hold
      early_stopping: {grace_period_s: 30, reduction_factor: 2}   # ASHA on the metric vs wall time
      metric: val_perplexity                 # default: the target's metric, else val_loss

The learning-rate rule takes the file's `train.lr` as tuned for the file's `train.global_batch_size`
and scales it by (batch / that batch) — linearly or by the square root — for every trial whose
global batch differs, keeping the file's warm-up. Data parallelism grows the effective batch with
the worker count; without a rule, larger worker counts train with a learning rate tuned for a
smaller batch.

`search: goodput` first predicts every grid point's time to the target, as `raytrain-par plan` does
(one reference run measuring the gradient noise scale, a few short throughput probes), then trains
points in the predicted order, each until the target, and ends once no untried point is predicted to
reach it sooner than the best trial so far; a trial still short of the target when it has trained
longer than that best is stopped. It needs a target on the sweep's metric and two batch sizes or more.
`min_trials` points are trained whatever the prediction says; `margin` (a fraction) also trains points
predicted up to that much slower than the best measured.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .config import ExperimentSpec, _from_mapping, apply_overrides, parse
from .errors import ConfigError
from .models import task_metrics

SHORT = {"scaling.num_workers": "w", "train.global_batch_size": "b", "train.lr": "lr",
         "strategy.name": "", "scaling.use_gpu": "gpu", "train.adaptive_batch": "adaptive-"}


@dataclass
class EarlyStopping:
    """ASHA: at each rung (grace period x reduction_factor^k seconds of training), keep the best
    1/reduction_factor of the trials that got there and stop the rest."""

    grace_period_s: float = 30.0
    reduction_factor: float = 2.0
    max_t_s: Optional[float] = None


@dataclass
class GoodputSearch:
    """search: goodput: trials trained whatever the prediction says, and how much slower than the best
    measured a point may be predicted and still be trained."""

    min_trials: int = 2
    margin: float = 0.0


@dataclass
class SweepSpec:
    grid: dict = field(default_factory=dict)
    cases: list[dict] = field(default_factory=list)
    random: dict = field(default_factory=dict)
    search: Literal["grid", "random", "optuna", "goodput"] = "grid"
    goodput: Optional[GoodputSearch] = None
    num_samples: int = 1
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    max_concurrent_trials: Optional[int] = None
    early_stopping: Optional[EarlyStopping] = None
    metric: Optional[str] = None


@dataclass
class Plan:
    base: dict  # the experiment without its sweep block
    sweep: SweepSpec
    points: list[dict]  # grid x cases: overrides of each grid point
    metric: str
    mode: str
    target: Optional[float]
    trial_cpus: float = 1.0  # the most CPUs / GPUs one trial's workers reserve
    trial_gpus: float = 0.0

    def trial_spec(self, overrides: dict) -> ExperimentSpec:
        return trial_spec(self.base, self.sweep, overrides)

    def trials_held(self, free: dict) -> int:
        """Trials run at once: sweep.max_concurrent_trials, else what `free` resources (Ray's
        available_resources) hold, keeping one CPU for Ray Data's reads."""
        if self.sweep.max_concurrent_trials:
            return self.sweep.max_concurrent_trials
        n = math.floor((free.get("CPU", 0) - 1) / self.trial_cpus) if self.trial_cpus else 1
        if self.trial_gpus:
            n = min(n, math.floor(free.get("GPU", 0) / self.trial_gpus))
        return max(1, n)

    def global_batches(self) -> list[int]:
        """The global batch sizes the points train with, smallest first."""
        return sorted({self.trial_spec(pt).train.global_batch_size for pt in self.points})


def trial_spec(base: dict, sweep: SweepSpec, overrides: dict) -> ExperimentSpec:
    """The experiment of one trial: base + overrides (+ the learning-rate rule)."""
    raw = apply_overrides(base, [])
    for path, value in overrides.items():
        if path == "strategy.name" and value != raw["strategy"]["name"]:
            # another strategy: the base strategy's options (its defaults included) mean nothing to it
            raw["strategy"] = {"name": value}
        _set(raw, path, value)
    if sweep.lr_scaling != "none":
        ratio = raw["train"]["global_batch_size"] / base["train"]["global_batch_size"]
        raw["train"]["lr"] = raw["train"]["lr"] * (ratio if sweep.lr_scaling == "linear" else math.sqrt(ratio))
    return parse(raw)


def _set(raw: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if isinstance(child, str) and p in ("model", "data", "strategy"):
            child = {"name": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(path, value, f"{p} is not a mapping", "sweep over the parent key as a whole")
        node[p] = child
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def describe(overrides: dict) -> str:
    """A short readable name for a trial, e.g. 'w2-b64-zero-2'."""
    parts = []
    for path, value in overrides.items():
        if path == "train.adaptive_batch":  # a point that adapts its batch against the fixed ones
            value = "fixed" if value is None else value.get("max_global_batch_size")
        elif isinstance(value, dict):
            value = "-".join(str(v) for v in value.values())
        elif isinstance(value, float):
            value = f"{value:.3g}"
        short = SHORT.get(path, path.rsplit(".", 1)[-1] + "=")
        parts.append(f"{short}{value}")
    return "-".join(parts).replace("/", "_") or "base"


def plan(spec: ExperimentSpec) -> Plan:
    """Validate an experiment's sweep block and every trial it implies."""
    if spec.sweep is None:
        raise ConfigError("sweep", None, "the experiment has no sweep block",
                          "add e.g. `sweep: {grid: {scaling.num_workers: [1, 2]}}`, or use `raytrain-par run`")
    sweep = _from_mapping(SweepSpec, spec.sweep, "sweep")
    base = {k: v for k, v in spec.to_dict().items() if k != "sweep"}
    if not (sweep.grid or sweep.cases or sweep.random):
        raise ConfigError("sweep", spec.sweep, "the search space is empty",
                          "give values under sweep.grid, sweep.cases or sweep.random")
    for path, values in sweep.grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.grid.{path}", values, "expected a non-empty list of values",
                              f"write e.g. `{path}: [1, 2]`")
    for i, case in enumerate(sweep.cases):
        if not isinstance(case, dict) or not case:
            raise ConfigError(f"sweep.cases[{i}]", case, "expected a non-empty mapping of field paths to values",
                              "write e.g. `- {scaling.num_workers: 2, train.global_batch_size: 64}`")
    if sweep.num_samples < 1:
        raise ConfigError("sweep.num_samples", sweep.num_samples, "must be >= 1", "use 1")
    if sweep.max_concurrent_trials is not None and sweep.max_concurrent_trials < 1:
        raise ConfigError("sweep.max_concurrent_trials", sweep.max_concurrent_trials, "must be >= 1",
                          "leave it out to fit the cluster's free resources")
    if sweep.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("sweep.search", "optuna", "the optuna package is not installed",
                              "pip install optuna, or use search: grid / random") from None
        if sweep.grid or sweep.cases:
            raise ConfigError("sweep.search", "optuna", "Optuna samples; it does not take grid or cases",
                              "move the values to sweep.random as lists (choices), or use search: grid")

    if sweep.search == "goodput":
        _check_goodput_search(sweep)
        # every trial trains until its target, and no longer: its time to the target is what is compared
        base["train"]["stop_at_target"] = True
    elif sweep.goodput is not None:
        raise ConfigError("sweep.goodput", spec.sweep["goodput"], f"it sets up search: goodput, and the search is "
                          f"{sweep.search}", "add `search: goodput`, or remove the goodput block")

    points = []
    grid_items = list(sweep.grid.items())
    for combo in itertools.product(*[v for _, v in grid_items]) if grid_items else [()]:
        grid_point = {p: v for (p, _), v in zip(grid_items, combo)}
        for case in sweep.cases or [{}]:
            points.append({**case, **grid_point})

    # Every trial must be a valid experiment; random ranges are checked at both ends.
    random_probes = [{}]
    for path, dom in sweep.random.items():
        values = dom if isinstance(dom, list) else [dom.get("min"), dom.get("max")] if isinstance(dom, dict) else None
        if not values or any(v is None for v in values) or (isinstance(dom, dict) and dom["min"] > dom["max"]):
            raise ConfigError(f"sweep.random.{path}", dom, "expected a list of choices or {min, max[, log, int]}"
                              " with min <= max", f"write e.g. `{path}: {{min: 1.0e-4, max: 1.0e-2, log: true}}`")
        random_probes = [{**p, path: v} for p in random_probes for v in values]
    specs = []
    for point in points:
        for probe in random_probes:
            try:
                specs.append(trial_spec(base, sweep, {**point, **probe}))
            except ConfigError as e:
                raise ConfigError(f"sweep trial {describe({**point, **probe})}: {e.field}", e.value, e.problem,
                                  f"{e.fix} (in the sweep block or the experiment)") from None
    allocators = sorted({s.scaling.host_allocator for s in specs})
    if len(allocators) > 1:  # the workers' environment is the Ray job's, set once for every trial
        raise ConfigError("sweep: scaling.host_allocator", allocators, "every trial of a sweep runs in one Ray job, "
                          "whose workers all start with one host allocator",
                          "sweep each in a run of its own: raytrain-par sweep FILE --set scaling.host_allocator=system")
    metric = sweep.metric or (spec.target.metric if spec.target else "val_loss")
    produced = task_metrics(spec.model.name)
    if metric not in produced:
        raise ConfigError("sweep.metric", metric, f"{spec.model.name} does not produce it",
                          f"use one of: {', '.join(produced)}")
    mode = "max" if metric == "val_accuracy" else "min"
    target = spec.target.value if spec.target and spec.target.metric == metric else None
    p = Plan(base, sweep, points, metric, mode, target,
             trial_cpus=max(s.scaling.num_workers * s.scaling.cpus_per_worker for s in specs),
             trial_gpus=max((s.scaling.num_workers * s.scaling.gpus_per_worker if s.scaling.use_gpu else 0)
                            for s in specs))
    if sweep.search == "goodput":
        check_goodput(p, "sweep.search: goodput")
    return p


def _check_goodput_search(sweep: SweepSpec) -> None:
    g = sweep.goodput = sweep.goodput or GoodputSearch()
    if g.min_trials < 1:
        raise ConfigError("sweep.goodput.min_trials", g.min_trials, "must be >= 1",
                          "use 2 (the predicted leader and the runner-up are both trained)")
    if not g.margin >= 0:
        raise ConfigError("sweep.goodput.margin", g.margin, "must be >= 0 (a fraction of the best time measured)",
                          "use 0, or e.g. 0.1 to also train points predicted up to 10% slower")
    if sweep.num_samples != 1:
        raise ConfigError("sweep.num_samples", sweep.num_samples, "search: goodput trains each grid point once",
                          "use 1")
    if sweep.early_stopping is not None:
        raise ConfigError("sweep.early_stopping", "set", "search: goodput stops every trial that has trained "
                          "longer than the best time to the target itself", "remove early_stopping")


def check_goodput(p: Plan, who: str) -> None:
    """What predicting time-to-target over a search space needs (`raytrain-par plan`):
    a target on the sweep's metric, grid points (nothing sampled) and two global batch sizes or more,
    since the noise scale says how steps to the target change with the batch."""
    if p.target is None:
        raise ConfigError("target", None, f"{who} predicts the time to reach a target of {p.metric}, "
                          "and the experiment has none on it",
                          f"add e.g. `target: {p.metric} {'>=' if p.mode == 'max' else '<='} VALUE`")
    if p.sweep.random:
        raise ConfigError("sweep.random", p.sweep.random, f"{who} predicts grid points; it samples nothing",
                          "move the values to sweep.grid as lists")
    batches = p.global_batches()
    if len(batches) < 2 and not any(p.trial_spec(pt).train.adaptive_batch for pt in p.points):
        raise ConfigError("sweep.grid.train.global_batch_size", batches,
                          f"{who} compares batch sizes and the search space has one",
                          "sweep two or more, e.g. `train.global_batch_size: [16, 32, 64]`")
