"""`raytrain-par plan`: time-to-target predicted for every point of a sweep, from one reference run
and a few short probes, before training any of them.

Goodput (Pollux, Qiao et al. OSDI 2021) is throughput times statistical efficiency. The two are
measured apart:

- statistical efficiency: one reference run trains the experiment's own configuration (global
  batch M0) to the target, measuring the gradient noise scale as it goes (metrics/goodput.py). From
  it the steps to the target at any global batch M follow, S = S_min (1 + B_noise / M), and the
  efficiency against M0, (B_noise + M0) / (B_noise + M). Engines with two data-parallel replicas or
  more measure the noise scale (see Engine.measures_noise_scale); an experiment whose own strategy or
  worker count does not is measured with ddp on two workers instead (same model, data, batch and
  learning rate).
- throughput: for each strategy and worker count of the sweep, one short Ray Train run times a few
  optimizer steps (after warm-up; start-up excluded) at each per-worker batch of the sweep (at most
  PROBE_BATCHES of them, the smallest and largest among them). A probed point takes its measured step
  time; Pollux's step-time model, fitted to the probes (metrics/throughput.py), gives the others'.
  (On CPUs the time per row changes with the batch and with the workers sharing a socket, which a
  model linear in the batch misses: measured where it can be, modelled where it must.)

Predicted time to target = S(M) x step time. A point with `train.adaptive_batch` is predicted interval by
interval of the reference: over each, the batch its decision would pick from that interval's noise scale
and the step-time model (metrics/adaptive.py), and the steps S_min,i (1 + B_i / M_i) it would take there.
Memory per worker comes from `raytrain-par estimate`.
Writes <output_dir>/<name>/plan.parquet (one row per point, ranked) and the reference's records and
probes under <output_dir>/<name>/plan/.

`sweep: {search: goodput}` makes the same plan, then trains points in the predicted order with
GoodputSearcher (a Ray Tune Searcher) until the leader is confirmed, and stops every trial that runs
longer than the best time to target measured so far (GoodputStopper).
"""

from __future__ import annotations

import functools
import json
import math
import pickle
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import ray.train
from ray.tune import Stopper
from ray.tune.search import Searcher
from scipy.optimize import nnls

from . import data as data_sets
from . import estimate
from .config import ExperimentSpec, parse
from .driver import make_trainer, preflight, ray_cluster, run_experiment
from .errors import ConfigError, UserError, say
from .metrics import adaptive
from .metrics.efficiency import crossing
from .metrics.goodput import Reference, fit_reference
from .metrics.records import write_table
from .metrics.throughput import Probe, ThroughputModel
from .sweep import Plan, check_goodput, describe, plan as sweep_plan
from .tables import text_table
from .worker import probe_loop_per_worker

PROBE_WARMUP, PROBE_STEPS = 2, 5
PROBE_BATCHES = 4  # per-worker batches probed per strategy and worker count, at most


@dataclass
class GoodputPlan:
    rows: list[dict]  # one per point, fastest predicted first
    reference: Reference
    throughput: ThroughputModel
    notes: list[str] = field(default_factory=list)
    path: Path | None = None
    seconds: float = 0.0  # the plan's own time, start-up included
    achievable: dict[str, float] = field(default_factory=dict)  # by strategy: Calibrated's, with --probe-workers
    background_cores: float | None = None  # Calibrated's: cores the machine's other processes kept busy
    step_overhead_s: dict[str, float] = field(default_factory=dict)  # by strategy: Calibrated's


def strategy_key(spec: ExperimentSpec) -> str:
    """What shares one step-time model: a strategy with its options."""
    return json.dumps(spec.strategy.to_dict(), sort_keys=True)


def reference_spec(spec: ExperimentSpec) -> tuple[ExperimentSpec, str | None]:
    """The experiment's own configuration, stopping at the target, with its records kept under plan/;
    where its own strategy, layout or precision does not measure the noise scale (pipedream, a single
    data-parallel replica, fp16's loss scaling), ddp on two workers or more in fp32 or bf16 (and why)."""
    from .strategies import engine_class

    raw = spec.to_dict()
    raw.update(sweep=None, name="reference", output_dir=str(spec.results_dir / "plan"))
    raw["train"].update(stop_at_target=True, eval_at_start=True, adaptive_batch=None)  # at the file's batch
    note = None
    if not engine_class(spec.strategy.name, spec.strategy.options).measures_noise_scale(spec.strategy.options, spec.train, spec.layout):
        workers = max(2, spec.scaling.num_workers)
        precision = "fp32" if spec.train.precision == "fp16" else spec.train.precision
        what = f"{spec.strategy.name} on {spec.scaling.num_workers} worker(s)"
        if spec.train.precision == "fp16":
            what += " in fp16 (its gradients are loss-scaled)"
        note = (f"{what} does not measure the gradient noise scale: the reference trains with ddp on {workers} "
                f"workers in {precision} (same model, data, batch and lr)")
        raw["strategy"], raw["scaling"]["num_workers"] = {"name": "ddp"}, workers
        raw["train"]["precision"] = precision
    try:
        return parse(raw), note
    except ConfigError as e:
        raise ConfigError(e.field, e.value, f"{e.problem} (in the reference run that measures the noise scale: "
                          f"{note})", e.fix) from None


class _StepTimes(ray.train.UserCallback):
    """On the Train controller (an actor of its own, on the driver's node): writes rank 0's report to a
    file, as RecordCallback does (Ray Train V2 keeps metrics in its Result only with checkpoints)."""

    def __init__(self, path: Path):
        self.path = path

    def after_report(self, run_context, metrics, checkpoint):
        if metrics and metrics[0]:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({k: metrics[0][k] for k in ("step_times", "background_cores")}))


def probe_points(p: Plan, specs: list[ExperimentSpec]) -> dict[tuple, dict[str, ExperimentSpec]]:
    """The probes to run, by (workers, data): for each strategy and worker count, each per-worker batch
    of the sweep, or PROBE_BATCHES of them spread from the smallest to the largest. (The reference's own
    step times are not reused: its intervals hold the steps that measure memory and the profiled ones,
    which the probes' steps do not.)"""
    groups: dict[tuple, list[ExperimentSpec]] = {}
    for s in specs:
        groups.setdefault((strategy_key(s), s.scaling.num_workers), []).append(s)
    runs: dict[tuple, dict[str, ExperimentSpec]] = {}
    for (key, workers), members in groups.items():
        by_batch = {s.per_worker_batch: s for s in members}
        batches = sorted(by_batch)
        if len(batches) > PROBE_BATCHES:
            last = len(batches) - 1
            batches = sorted({batches[round(i * last / (PROBE_BATCHES - 1))] for i in range(PROBE_BATCHES)})
        for b in batches:
            s = by_batch[b]
            run = runs.setdefault((workers, json.dumps(s.to_dict()["data"], sort_keys=True)), {})
            name = f"{s.strategy.name}-w{workers}-local{b}"
            run[name if name not in run else f"{name}-{len(run)}"] = s  # one strategy, other options
    return runs


def _probe(specs: dict[str, ExperimentSpec], storage: Path, log) -> tuple[dict[str, float], dict[str, float]]:
    """One Ray Train run on these probes' workers timing each of them: seconds per step by name, and the
    cores the machine's other processes kept busy meanwhile (worker.time_steps)."""
    import pyarrow.dataset as pds
    import ray.data
    from ray.train import DataConfig

    first = next(iter(specs.values()))
    info = data_sets.prepare(first.data, first.data.cache_dir, log=lambda *_: None)
    # Enough rows for the largest global batch a few times over: the probes time steps, not epochs.
    rows = 2 * max(s.train.global_batch_size for s in specs.values())
    table = pds.dataset(info.train_path, format="parquet").head(min(rows, info.num_train))
    name = f"probe-w{first.scaling.num_workers}"
    out = storage / f"{name}.json"
    trainer = make_trainer(first, info, storage, name=name, callbacks=[_StepTimes(out)],
                           loop=probe_loop_per_worker,
                           loop_config={"probes": {n: s.to_dict() for n, s in specs.items()},
                                        "warmup": PROBE_WARMUP, "steps": PROBE_STEPS},
                           datasets=({"train": ray.data.from_arrow(table)}, DataConfig(datasets_to_split=[])))
    t0 = time.perf_counter()
    trainer.fit()
    log(f"probed {', '.join(specs)} in {time.perf_counter() - t0:.0f} s")
    measured = json.loads(out.read_text())
    return measured["step_times"], measured["background_cores"]


class Calibrated:
    """Step times at worker counts no probe ran: `raytrain-par estimate`'s model of the step (metrics/
    steptime.py: the layout's collectives on the device's links, its FLOPs at the device's peak), with the
    achievable fraction a of each strategy, and its per-step overhead o, measured by its probes. A probe's
    step is m = o / s + (compute + bubble) / a + exposed communication, the parts taken at a = 1 and o = 0
    (s: the share of a core each worker had: devices.cpu_workers). Probes at two batch sizes or more give
    both by least squares: o is what the step takes whatever its batch (the optimizer's update, each
    operator's dispatch), which a fraction alone would charge to the FLOPs, so that a smaller batch per
    worker was predicted too fast. One batch, or a fit that leaves no positive pair, gives the median of
    the probes' a with o = 0: the catalogue's one fitted figure.

    On this machine's CPU (`device` None) the device is `devices.cpu()` with the loopback link measured and
    the cores shared once the workers outnumber the cores the machine's other processes leave them
    (`background_cores`, as the probes measured it: devices.cpu_workers)."""

    def __init__(self, probes: list[tuple[ExperimentSpec, float]], device=None, background_cores: float = 0.0):
        from . import devices

        self.base, self.link, self.background_cores = device, None, background_cores
        if device is None:
            self.base, self.link = devices.cpu(), devices.measure_loopback()
        points: dict[str, list[tuple[float, float, float]]] = {}  # (1 / s, work at a = 1, busy)
        for s, measured in probes:
            d = self._device(s, 1.0)
            t = estimate.step_time(s, d)
            if measured > t.exposed_comm_s:
                points.setdefault(strategy_key(s), []).append(
                    (1 / d.cores_share, t.compute_s + t.bubble_s, measured - t.exposed_comm_s))
        self.achievable, self.overhead_s = {}, {}
        for key, rows in points.items():
            self.achievable[key], self.overhead_s[key] = _fit_fraction(rows)

    def _device(self, s: ExperimentSpec, achievable: float, overhead_s: float = 0.0):
        from . import devices

        d = replace(self.base, step_overhead_s=overhead_s)
        if self.link is not None:
            d = devices.cpu_workers(d, self.link, s.scaling.num_workers, max(1, int(s.scaling.cpus_per_worker)),
                                    self.background_cores)
        return replace(d, achievable=achievable)

    def step_time(self, s: ExperimentSpec) -> float:
        key = strategy_key(s)
        if key not in self.achievable:
            raise KeyError(f"no probe of {s.strategy.name} measured its achievable fraction")
        return estimate.step_time(s, self._device(s, self.achievable[key], self.overhead_s[key])).step_s


def _fit_fraction(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, o) with busy = o u + work / a over rows (u, work, busy), by the non-negative least squares the
    throughput model fits with (metrics/throughput.py), where the works differ by a tenth or more and
    both come out positive; else (median of work / busy, 0)."""
    works = [w for _, w, _ in rows]
    if len(rows) >= 2 and max(works) >= 1.1 * min(works):
        (o, k), _ = nnls(np.array([[u, w] for u, w, _ in rows]), np.array([y for _, _, y in rows]))
        if o > 0 and k > 0:
            return 1 / k, float(o)
    return statistics.median(w / y for _, w, y in rows), 0.0


def predict(p: Plan, reference: Reference, model: ThroughputModel, device_memory: int | None = None,
            probed: dict[tuple, float] | None = None, calibrated: Calibrated | None = None) -> list[dict]:
    """One row per point: steps, step time and time to the target, efficiency, memory; fastest first
    (points that do not fit in `device_memory` last). `probed`: measured seconds per step by
    (strategy key, workers, per-worker batch, accumulation), taken over the model's where given.
    `calibrated`: the step's model, for the worker counts no probe ran (instead of `model`'s fit)."""
    probed = probed or {}
    probed_counts = {(k[0], k[1]) for k in probed}
    rows = []
    for point in p.points:
        s = p.trial_spec(point)  # with the sweep's lr_scaling, as the trial will run
        m = s.train.global_batch_size
        at = (strategy_key(s), s.scaling.num_workers, s.per_worker_batch, s.train.gradient_accumulation_steps)
        modelled = calibrated is not None and at[:2] not in probed_counts

        def seconds(shape: adaptive.Shape, s=s, modelled=modelled) -> float:
            key = (strategy_key(s), s.scaling.num_workers, shape.batch // s.layout.data, shape.accumulation)
            if key in probed:
                return probed[key]
            if modelled:
                return calibrated.step_time(replace(s, train=replace(
                    s.train, global_batch_size=shape.batch, gradient_accumulation_steps=shape.accumulation,
                    adaptive_batch=None)))
            return model.step_time(*key)

        batches = None
        if s.train.adaptive_batch is None:
            steps = reference.steps_to_target(m, s.train.lr, s.train.optimizer)
            step_time = seconds(adaptive.Shape(m, s.train.gradient_accumulation_steps))
            efficiency = reference.efficiency(m)
        else:
            steps, total, batches = _adaptive_prediction(s, reference, seconds)
            step_time, efficiency = total / steps, reference.steps * reference.batch / sum(
                n * b for n, b in batches)
        memory = _memory_bytes(s)
        rows.append({
            "trial": describe(point), "overrides": json.dumps(point), "strategy": s.strategy.name,
            "num_workers": s.scaling.num_workers, "global_batch_size": m, "per_worker_batch": s.per_worker_batch,
            "lr": s.train.lr, "statistical_efficiency": efficiency,
            "predicted_steps_to_target": steps, "predicted_step_time_s": step_time,
            "predicted_time_to_target_s": steps * step_time,
            "predicted_batches": None if batches is None else " -> ".join(
                str(b) for b in dict.fromkeys(b for _, b in batches)),
            "step_time_probed": at in probed and batches is None,
            "step_time_from": "probed" if at in probed and batches is None else ("model" if modelled else "fitted"),
            "memory_per_worker_bytes": memory,
            # the names `estimate --json` gives the same figures
            "workers": s.scaling.num_workers, "step_time_s": step_time, "time_to_target_s": steps * step_time,
            "mem_per_worker_bytes": memory,
            "fits": None if device_memory is None or memory is None else memory <= device_memory,
            "grad_noise_scale": reference.noise_scale, "reference_batch": reference.batch,
            "reference_steps_to_target": reference.steps,
        })
    rows.sort(key=lambda r: (r["fits"] is False, r["predicted_time_to_target_s"]))
    for i, r in enumerate(rows):
        r["rank"] = i + 1
    return rows


def _adaptive_prediction(s: ExperimentSpec, reference: Reference, seconds
                         ) -> tuple[float, float, list[tuple[float, int]]]:
    """An adaptive point's steps and seconds to the target, and its (steps, batch) over each interval of the
    reference: the batch its decision picks from the interval's noise scale (the step times known, as once
    the run has timed two batches), and the steps S_min,i (1 + B_i / M_i) that interval's progress takes."""
    from .strategies import engine_class

    a = s.train.adaptive_batch
    shapes = engine_class(s.strategy.name, s.strategy.options).batch_layout(
        s.train, s.layout, a.max_micro_batch_rows).shapes(a.min_global_batch_size or s.train.global_batch_size,
                                                          a.max_global_batch_size)
    steps = total = 0.0
    batches = []
    for s_min, noise in reference.intervals or [(reference.min_steps, reference.noise_scale)]:
        c = adaptive.decide(shapes, s.train.global_batch_size, s.train.global_batch_size, noise, a.lr_scaling, seconds)
        n = s_min * (1 + noise / c.batch)
        steps, total = steps + n, total + n * seconds(adaptive.Shape(c.batch, c.accumulation))
        batches.append((n, c.batch))
    return steps, total, batches


def adaptive_probes(s: ExperimentSpec) -> list[ExperimentSpec]:
    """An adaptive point probed at its smallest and largest batch (as it would cut them), so that the
    step-time model spans its range; a fixed point as it is."""
    from .strategies import engine_class

    a = s.train.adaptive_batch
    if a is None:
        return [s]
    cut = engine_class(s.strategy.name, s.strategy.options).batch_layout(s.train, s.layout, a.max_micro_batch_rows)
    out = []
    for batch in (a.min_global_batch_size or s.train.global_batch_size, a.max_global_batch_size):
        shape = cut.shape(batch)
        out.append(replace(s, train=replace(s.train, global_batch_size=batch, adaptive_batch=None,
                                            gradient_accumulation_steps=shape.accumulation)))
    return out


def _memory_bytes(s: ExperimentSpec) -> float | None:
    return _memory_of(json.dumps(s.to_dict(), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _memory_of(experiment: str) -> float | None:
    """`raytrain-par estimate`'s bytes per worker (a second or two per experiment: kept per experiment)."""
    s = parse(json.loads(experiment))
    rows = estimate.estimate(s, [s.strategy.name], [s.scaling.num_workers])
    return rows[0].device_bytes if rows and not rows[0].note else None


def probed_only(specs: list[ExperimentSpec], probe_workers: list[int] | None) -> list[ExperimentSpec]:
    """The points to probe: all, or those at the worker counts `probe_workers` names, which must hold a
    point of every strategy (its probes measure what the model of the others is calibrated with)."""
    if probe_workers is None:
        return specs
    counts = sorted({s.scaling.num_workers for s in specs})
    missing = [w for w in probe_workers if w not in counts]
    if missing:
        raise ConfigError("--probe-workers", ",".join(map(str, probe_workers)), f"the sweep has no point on "
                          f"{missing[0]} worker(s) (its worker counts: {', '.join(map(str, counts))})",
                          f"probe some of {', '.join(map(str, counts))}")
    chosen = [s for s in specs if s.scaling.num_workers in probe_workers]
    for s in specs:
        if strategy_key(s) not in {strategy_key(c) for c in chosen}:
            raise ConfigError("--probe-workers", ",".join(map(str, probe_workers)), f"no point of {s.strategy.name} "
                              "is on those worker counts, and its probes calibrate its other counts",
                              f"add a count {s.strategy.name} runs on (e.g. {s.scaling.num_workers})")
    return chosen


def lr_notes(p: Plan) -> list[str]:
    """What a plan notes about the sweep's learning rates."""
    if p.sweep.lr_scaling != "none":
        return []
    return ["sweep.lr_scaling is none: every batch trains with the file's lr, which may limit progress at batches "
            "above the reference's; the predicted steps count it (set lr_scaling: sqrt or linear to scale it)"]


def run_reference(spec: ExperimentSpec, p: Plan, ref: ExperimentSpec, log) -> Reference:
    """Train the reference (`reference_spec`) to the target on the cluster already joined; its S_min and B_noise."""
    log(f"{spec.name}: reference run ({ref.strategy.name}, {ref.scaling.num_workers} workers, global batch "
        f"{ref.train.global_batch_size}) to {spec.target}")
    result = run_experiment(ref, log=lambda *_: None)
    if result.error is not None:
        raise UserError(f"the reference run failed: {result.error}")
    reference = fit_reference(result.records, p.metric, p.target, p.mode, lr=ref.train.lr)
    if reference is None:
        raise UserError(f"the reference run did not reach {spec.target} in {result.records[-1]['step']} steps "
                        f"(records in {result.results_dir}).\n  fix: raise train.max_steps (or train.epochs), "
                        "or set an easier target")
    log(f"reference: target reached after {reference.steps:.1f} steps at batch {reference.batch}; gradient noise "
        f"scale {reference.noise_scale:.1f} rows, S_min {reference.min_steps:.1f} steps")
    return reference


class OnDevice:
    """Every point's step from `raytrain-par estimate`'s model on a device nothing here ran on (its catalogue
    figures, the achievable fraction included): what `plan --cluster` ranks by."""

    def __init__(self, device):
        self.device = device

    def step_time(self, s: ExperimentSpec) -> float:
        return estimate.step_time(s, self.device).step_s


def worker_counts(text: str) -> list[int]:
    """--workers: '8,16,64', or '8..256' for the powers of two from 8 to 256."""
    lo, dots, hi = text.partition("..")
    try:
        if dots:
            first, last = int(lo), int(hi)
            counts = [first * 2**k for k in range(64) if first * 2**k <= last] if 0 < first <= last else []
        else:
            counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--workers {text!r}: expected positive worker counts, e.g. 8,16,64, or 8..256 (the powers of "
                        "two from 8 to 256).\n  fix: e.g. --workers 8..256")
    return sorted(set(counts))


def cluster_plan(spec: ExperimentSpec, device, nodes=None, usd_per_gpu_hour: float | None = None,
                 workers: list[int] | None = None, records: str | None = None, address: str | None = None,
                 log=say) -> GoodputPlan:
    """Every point of the sweep (its worker counts replaced by `workers`) on `device`, nothing probed: the step
    from the step-time model on the device, the steps from a reference (`records`: an earlier run's, else one
    trained now on the plan's Ray cluster), the cost at `usd_per_gpu_hour`. A point that cannot exist (a batch
    that does not split, more GPUs than `nodes` holds) or whose steps the reference does not predict
    (PipeDream's) is a row saying why, ranked last."""
    t0 = time.perf_counter()
    p = sweep_plan(spec)
    check_goodput(p, "raytrain-par plan")
    points = p.points
    if workers is not None:
        kept = list(dict.fromkeys(json.dumps({k: v for k, v in pt.items() if k != "scaling.num_workers"},
                                             sort_keys=True) for pt in p.points))
        points = [{"scaling.num_workers": w, **json.loads(k)} for k in kept for w in workers]
    possible, impossible = [], []
    for pt in points:
        why, w = None, pt.get("scaling.num_workers", p.base["scaling"]["num_workers"])
        if nodes is not None and isinstance(w, int) and nodes.too_small_for(w):
            why = nodes.too_small_for(w)
        else:
            try:
                if p.trial_spec(pt).layout.asynchronous:
                    why = estimate.STALE
            except ConfigError as e:
                why = f"{e.field} ({e.problem})"
        if why:
            impossible.append({"trial": describe(pt), "overrides": json.dumps(pt), "possible": False,
                               "note": f"not possible: {why}"})
        else:
            possible.append(pt)
    notes = lr_notes(p)
    if records is not None:
        target = estimate.to_target(spec, records)
        reference = target.reference
        log(f"reference {target.source}: {spec.target} after {reference.steps:.1f} steps at batch {reference.batch}; "
            f"gradient noise scale {reference.noise_scale:.1f}")
    else:
        ref, note = reference_spec(spec)
        notes += [note] if note else []
        preflight(ref, address, log)
        with ray_cluster(ref, address, log=log):
            reference = run_reference(spec, p, ref, log)
    for n in notes:
        log(f"note: {n}")
    rows = predict(replace(p, points=possible), reference, ThroughputModel({}), int(device.memory_bytes),
                   calibrated=OnDevice(device))
    for r in rows:
        r["possible"], r["note"] = True, None
        r["predicted_cost_usd"] = None if usd_per_gpu_hour is None else (
            r["predicted_time_to_target_s"] * r["num_workers"] / 3600 * usd_per_gpu_hour)
    rows += impossible
    path = write_table(spec.results_dir / "plan.parquet", rows)
    return GoodputPlan(rows, reference, ThroughputModel({}), notes, path, time.perf_counter() - t0)


def make_plan(spec: ExperimentSpec, address: str | None = None, device_memory: int | None = None,
              log=say, probe_workers: list[int] | None = None) -> GoodputPlan:
    """Reference run, probes, predictions; writes plan.parquet. `probe_workers`: probe only those worker
    counts, and predict the others' steps with the model calibrated on them (Calibrated)."""
    t0 = time.perf_counter()
    p = sweep_plan(spec)
    check_goodput(p, "raytrain-par plan")
    ref, note = reference_spec(spec)
    specs = [p.trial_spec(pt) for pt in p.points]
    to_probe = probed_only(specs, probe_workers)
    if probe_workers is not None and any(s.scaling.use_gpu for s in specs):
        raise ConfigError("--probe-workers", ",".join(map(str, probe_workers)), "predicting unprobed worker counts "
                          "on GPUs needs the device's links, and the plan knows this machine's only",
                          "probe every worker count (leave --probe-workers out), or use `raytrain-par estimate "
                          "--device NAME --records DIR`")
    preflight(spec, address, log)
    notes = ([note] if note else []) + lr_notes(p)
    for n in notes:
        log(f"note: {n}")
    specs = [probe for s in to_probe for probe in adaptive_probes(s)]
    biggest = max(specs + [ref], key=lambda s: s.scaling.num_workers)
    with ray_cluster(biggest, address, log=log):
        reference = run_reference(spec, p, ref, log)
        probes, measured, background = [], [], []
        for (workers, _), run in probe_points(p, specs).items():
            times, busy = _probe(run, spec.results_dir / "plan" / "probes", log)
            probes += [Probe(strategy_key(s), workers, s.per_worker_batch, times[name],
                             s.train.gradient_accumulation_steps) for name, s in run.items()]
            measured += [(s, times[name]) for name, s in run.items()]
            background += list(busy.values())
    model = ThroughputModel.fit(probes)
    calibrated = None
    if probe_workers is not None:
        calibrated = Calibrated(measured, background_cores=statistics.median(background))
        log("achievable fraction of the probed peak and overhead per step, from the probes: " + ", ".join(
            f"{json.loads(k)['name']} {a:.2f} + {calibrated.overhead_s[k] * 1e3:.1f} ms"
            for k, a in calibrated.achievable.items())
            + f"; the machine's other processes kept {calibrated.background_cores:.2f} cores busy")
    rows = predict(p, reference, model, device_memory,
                   {(q.strategy, q.workers, q.local_batch, q.accumulation): q.step_time_s for q in probes}, calibrated)
    path = write_table(spec.results_dir / "plan.parquet", rows)
    achievable = {json.loads(k)["name"]: a for k, a in calibrated.achievable.items()} if calibrated else {}
    overhead = {json.loads(k)["name"]: o for k, o in calibrated.overhead_s.items()} if calibrated else {}
    return GoodputPlan(rows, reference, model, notes, path, time.perf_counter() - t0, achievable,
                       calibrated.background_cores if calibrated else None, overhead)


def plan_table(rows: list[dict]) -> str:
    """The ranking, for the terminal and docs."""
    def f(v, fmt):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)
    costs = any(r.get("predicted_cost_usd") is not None for r in rows)
    rows = [r for r in rows if r.get("possible", True)]
    head = ["#", "point", "strategy", "workers", "batch", "lr", "efficiency", "steps", "s/step", "to_target_s",
            "MiB/worker", "fits"] + (["cost_usd"] if costs else [])
    body = [[str(r["rank"]), r["trial"], r["strategy"], str(r["num_workers"]),
             r.get("predicted_batches") or str(r["global_batch_size"]),
             f(r["lr"], ".3g"), f(r["statistical_efficiency"], ".3f"), f(r["predicted_steps_to_target"], ".1f"),
             f(r["predicted_step_time_s"], ".3f") + {"probed": "", "fitted": "*", "model": "+"}[r["step_time_from"]],
             f(r["predicted_time_to_target_s"], ".1f"),
             f(None if r["memory_per_worker_bytes"] is None else r["memory_per_worker_bytes"] / 2**20, ".0f"),
             "-" if r["fits"] is None else ("yes" if r["fits"] else "NO")]
            + ([f(r.get("predicted_cost_usd"), ",.2f")] if costs else []) for r in rows]
    return text_table(head, body)


class GoodputSearcher(Searcher):
    """Trains a plan's points fastest-predicted first, and finishes once no untried point is predicted
    to reach the target sooner than the best trial measured so far.

    A prediction is steps to target x seconds per step, and each factor is corrected by what the
    trials measured so far, separately, since they go wrong for different reasons:
    - seconds per step by the median of measured / predicted over every trial that trained: the probes
      time every point, so what is left is uniform (a busier or slower cluster than the probes saw);
    - steps to target by the median of measured / predicted over the trials of the same global batch
      that reached the target, and not at all for a batch no trial has reached it with: the noise
      scale's model of steps against batch size is what errs, and by how much depends on the batch
      (on a 2-core machine it was 1.5x optimistic at batch 8 and right at batch 16).
    A trial that ends without reaching the target (the stopper ends trials slower than the best) bounds
    its batch's correction from below. So the search trains at most one point per batch size whose
    correction it does not know yet (a second one waits while the first runs), and of the points that
    may still win it trains the one predicted fastest once corrected.
    `min_trials` points are trained whatever the predictions say, so the leader is measured against at
    least one other; `margin` (a fraction) also trains points predicted up to that much slower than the
    best measured. Points that do not fit in device memory, or whose time cannot be predicted, are never
    trained.

    Ray Tune has no searcher that ranks a fixed grid by a model and stops early (its model-based ones
    sample a space and need many trials to learn it), hence this one.
    """

    def __init__(self, rows: list[dict], metric: str, mode: str, target: float, min_trials: int = 2,
                 margin: float = 0.0, log=say):
        super().__init__(metric=metric, mode=mode)
        self.target, self.min_trials, self.margin, self.log = target, min_trials, margin, log
        self.queue = [r for r in rows if r["fits"] is not False and _finite(r["predicted_time_to_target_s"])]
        self.rows: dict[str, dict] = {}  # trial id -> its plan row
        self.records: dict[str, list[dict]] = {}
        self.running: set[str] = set()
        self.measured: dict[str, float | None] = {}  # trial id -> time to target (None: not reached)
        self.stopped: set[str] = set()  # trials GoodputStopper ended

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the points come from the plan, not from Tune's param_space

    def times(self) -> dict[str, float]:
        """Time to target of every trial that reached it so far, running or ended."""
        out = {i: t for i, t in self.measured.items() if t is not None}
        out.update({i: t for i, t in ((i, self._reached(i)) for i in self.running) if t is not None})
        return out

    def best(self) -> float | None:
        return min(self.times().values(), default=None)

    def step_time_factor(self) -> float:
        """Median of measured / predicted seconds per step over the trials that trained (1 before any)."""
        ratios = []
        for i, records in self.records.items():
            trained = [r for r in records if r.get("step")]
            if trained and self.rows[i].get("predicted_step_time_s"):
                last = max(trained, key=lambda r: r["step"])
                ratios.append(last["wall_time_s"] / last["step"] / self.rows[i]["predicted_step_time_s"])
        return statistics.median(ratios) if ratios else 1.0

    def steps_factor(self, batch) -> float:
        """Median of measured / predicted steps to target over the trials of global batch `batch` that
        reached it (1 where none did: the model's own prediction), and at least what a trial of that
        batch that ended without reaching it shows: it needed more steps than it trained (a trial the
        stopper ends never reaches the target, and would otherwise leave its batch uncorrected)."""
        reached, ended = [], []
        for i, row in self.rows.items():
            predicted = row.get("predicted_steps_to_target")
            if row.get("global_batch_size") != batch or not predicted:
                continue
            steps = crossing(self.records[i], self.metric, self.target, self.mode, "step")
            if steps:
                reached.append(steps / predicted)
            elif i in self.measured and self.records[i]:  # ended short of the target
                ended.append(max(r["step"] for r in self.records[i]) / predicted)
        return max([statistics.median(reached) if reached else 1.0, *ended])

    def _untried_batch_running(self, row: dict) -> bool:
        """Whether a trial of this row's batch is running while no trial of it has ended or reached the
        target: its correction is on the way, and a second point of the batch waits for it."""
        batch = row.get("global_batch_size")
        same = [i for i, r in self.rows.items() if r.get("global_batch_size") == batch]
        reached = self.times()
        known = [i for i in same if i in self.measured or i in reached]
        return any(i in self.running for i in same) and not known

    def corrected(self, row: dict) -> float:
        """The row's predicted time to target, both factors corrected by what was measured so far."""
        steps, step_s = row.get("predicted_steps_to_target"), row.get("predicted_step_time_s")
        if not (_finite(steps) and _finite(step_s)):
            return row["predicted_time_to_target_s"]
        return steps * self.steps_factor(row.get("global_batch_size")) * step_s * self.step_time_factor()

    def could_win(self, row: dict) -> bool:
        best = self.best()
        if best is None:  # nothing has reached the target: the next point once the running ones end
            return not self.running
        return not self._untried_batch_running(row) and self.corrected(row) < best * (1 + self.margin)

    def suggest(self, trial_id: str):
        started = len(self.measured) + len(self.running)
        # the point predicted fastest once corrected, of those that may still win: corrections differ by
        # batch size, so one point that cannot win does not rule out the points after it
        if self.queue and started < self.min_trials:
            pick = 0
        else:
            winners = [k for k, row in enumerate(self.queue) if self.could_win(row)]
            pick = min(winners, key=lambda k: self.corrected(self.queue[k])) if winners else None
        if pick is not None:
            row = self.queue.pop(pick)
            self.rows[trial_id], self.records[trial_id] = row, []
            self.running.add(trial_id)
            self.log(f"goodput search: training {row['trial']} (predicted rank {row['rank']}, "
                     f"{row['predicted_time_to_target_s']:.1f} s to target, {self.corrected(row):.1f} s corrected)")
            return {"point": json.loads(row["overrides"])}
        if self.running:
            return None  # what the running trials measure decides whether another is worth training
        if self.queue:
            self.log(f"goodput search: done; the {len(self.queue)} point(s) left are predicted slower than "
                     f"{self.best():.1f} s (seconds per step corrected by {self.step_time_factor():.2f}, steps to "
                     "target by what each batch size measured)")
        return Searcher.FINISHED

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        # Tune hands searchers the result flattened: the record's own fields are at its top level
        if trial_id in self.records and result.get("wall_time_s") is not None:
            self.records[trial_id].append({k: result.get(k) for k in ("step", "wall_time_s", self.metric)})

    def __getstate__(self):
        # Tune pickles the searcher with its experiment; the log function stays behind (a test's
        # captured print, a closure) and a restored searcher prints
        return {k: v for k, v in self.__dict__.items() if k != "log"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.log = say

    def save(self, checkpoint_path: str) -> None:
        """What has been trained and measured, for `sweep --resume`."""
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__getstate__(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.rows:
            return
        self.running.discard(trial_id)
        self.measured[trial_id] = None if error else self._reached(trial_id)

    def _reached(self, trial_id: str) -> float | None:
        records = self.records.get(trial_id) or []
        return crossing(records, self.metric, self.target, self.mode, "wall_time_s") if records else None


class GoodputStopper(Stopper):
    """Ends a trial once its training has run longer than the best time to target measured so far
    without reaching the target: it cannot be the fastest any more."""

    def __init__(self, searcher: GoodputSearcher):
        self.searcher = searcher

    def __call__(self, trial_id: str, result: dict) -> bool:
        best = self.searcher.best()
        wall = result.get("wall_time_s")
        late = (best is not None and wall is not None and wall > best
                and self.searcher._reached(trial_id) is None and not result.get("target_met"))
        if late:
            self.searcher.stopped.add(trial_id)
        return late

    def stop_all(self) -> bool:
        return False


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)
