"""Experiment tracking: every evaluation record of a run or of each trial of a sweep, logged to MLflow,
TensorBoard and Weights & Biases (`tracking:` in the experiment), with the libraries' own clients.

    tracking:
      mlflow: {tracking_uri: http://127.0.0.1:5000, experiment_name: gpt2, run_name: r1, tags: {team: x}}
      tensorboard: {log_dir: tb}
      wandb: {project: gpt2, entity: me, group: g, mode: offline}

Why the driver logs, not Ray: Ray Train V2 removed its logger callbacks (its RunConfig refuses
`MLflowLoggerCallback`), and a tracker called from Train's controller (where `RecordCallback` writes
the records) would hold up its report loop, and so the workers, whenever the tracker's server is
slow or down. Instead `Follow` reads metrics.parquet, the record of truth that the controller (a
run) or Tune's driver callback (a sweep) writes, on a thread of the driver, and hands every new
record to the trackers: one process logs, never a worker, and no tracker can stop or slow training.
A tracker that fails is said once on stderr and left out from then on; the records stay in
metrics.parquet, and `raytrain-par report DIR --to-mlflow URI` pushes them later.

Each trial is one tracker run (a run is one trial, named "run"); a sweep groups its trials (an MLflow
parent run with nested runs, a W&B group, a TensorBoard directory per trial). The ids of the tracker
runs are kept in the results directory's tracking.json, so that a resumed run appends to its own
tracker runs. The resolved experiment is each run's parameters, its provenance (command, commit,
machine) its tags, and at the end the trial's summary (time and samples to the target) and the
report's figures are logged.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

STATE_FILE = "tracking.json"
# Record columns that are not figures of the run at that step (or are figures per worker, lists)
NOT_METRICS = {"step", "timestamp", "started_at", "resumed_from_step"}
# Each tracker: its extra (pip install 'raytrain-par[X]') and the module it imports, one name for both.
TRACKERS = ("mlflow", "tensorboard", "wandb")


@dataclass
class MLflowSpec:
    tracking_uri: Optional[str] = None  # default: MLFLOW_TRACKING_URI, else MLflow's own (./mlruns)
    experiment_name: Optional[str] = None  # default: the experiment's name
    run_name: Optional[str] = None  # default: the experiment's name (a sweep: its parent run; trials by name)
    tags: dict = field(default_factory=dict)


@dataclass
class TensorBoardSpec:
    log_dir: Optional[str] = None  # default: <results directory>/tensorboard; a sweep: a directory per trial


@dataclass
class WandbSpec:
    project: Optional[str] = None  # default: the experiment's name
    entity: Optional[str] = None
    group: Optional[str] = None  # default for a sweep: the experiment's name
    mode: Literal["online", "offline"] = "online"


@dataclass
class TrackingSpec:
    mlflow: Optional[MLflowSpec] = None
    tensorboard: Optional[TensorBoardSpec] = None
    wandb: Optional[WandbSpec] = None

    def configured(self) -> list[str]:
        return [name for name in TRACKERS if getattr(self, name) is not None]


def missing_package(name: str) -> str | None:
    """The package a configured tracker needs where it is not installed (checked before anything
    starts), else None."""
    import importlib.util

    return name if importlib.util.find_spec(name) is None else None


def metrics_of(record: dict) -> dict[str, float]:
    """The figures of a record: its numbers (booleans as 0/1), finite ones only."""
    out = {}
    for k, v in record.items():
        if k in NOT_METRICS or isinstance(v, (str, list, dict)) or v is None:
            continue
        v = float(v)
        if math.isfinite(v):
            out[k] = v
    return out


def flat(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested mapping as dotted keys (parameters are flat in every tracker)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


@dataclass
class Trial:
    """What a tracker run is made of: its name, its parameters and tags, and its place in a sweep."""

    name: str
    params: dict[str, str]
    tags: dict[str, str]
    sweep: Optional[str] = None  # the sweep's name, for a trial of one


class Backend:
    """One tracker. `open` starts (or, given its id, continues) the run of a trial and returns its id;
    `log` one record; `close` the summary and files at the end. Tracker errors propagate: `Tracking`
    turns the first into a warning and leaves the tracker out."""

    name = ""
    # Takes each step once, in order (W&B): a resumed run's records up to the last step logged are left out.
    ordered = False

    def open(self, trial: Trial, run_id: str | None, parent: str | None) -> str: ...

    def open_sweep(self, name: str, params: dict[str, str], tags: dict[str, str], run_id: str | None) -> str | None:
        return None

    def log(self, run_id: str, step: int, metrics: dict[str, float], timestamp: float | None) -> None: ...

    def close(self, run_id: str, summary: dict[str, float], files: list[Path], failed: bool) -> None: ...

    def close_sweep(self, run_id: str | None, files: list[Path], failed: bool) -> None:
        pass


class MLflowBackend(Backend):
    name = "mlflow"

    def __init__(self, spec: MLflowSpec, experiment: str):
        # A server that is down must cost seconds, not MLflow's default minutes of retries; and the run's
        # console holds its own progress lines, not MLflow's links to each run it ends.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow import MlflowClient

        self.spec, self.client = spec, MlflowClient(tracking_uri=spec.tracking_uri)
        name = spec.experiment_name or experiment
        found = self.client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(name)

    def _start(self, run_id, name, params, tags) -> str:
        from mlflow.entities import Param, RunTag

        if run_id is None:
            run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
            items = [Param(k, v[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(run_id, params=items[i:i + 100])
        else:  # a resumed run: its parameters stay those it started with (MLflow keeps them fixed)
            self.client.update_run(run_id, status="RUNNING")
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        return run_id

    def open(self, trial, run_id, parent):
        tags = {**trial.tags, **{k: str(v) for k, v in self.spec.tags.items()}}
        if parent:
            tags["mlflow.parentRunId"] = parent
        return self._start(run_id, trial.name if trial.sweep else (self.spec.run_name or trial.name),
                           trial.params, tags)

    def open_sweep(self, name, params, tags, run_id):
        return self._start(run_id, self.spec.run_name or name, params,
                           {**tags, **{k: str(v) for k, v in self.spec.tags.items()}})

    def log(self, run_id, step, metrics, timestamp):
        from mlflow.entities import Metric

        ms = int((timestamp or 0) * 1000)
        items = [Metric(k, v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])

    def close(self, run_id, summary, files, failed):
        from mlflow.entities import Metric

        if summary:
            self.client.log_batch(run_id, metrics=[Metric(f"summary.{k}", v, 0, 0) for k, v in summary.items()])
        for f in files:
            self.client.log_artifact(run_id, str(f))
        self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")

    def close_sweep(self, run_id, files, failed):
        if run_id:
            for f in files:
                self.client.log_artifact(run_id, str(f))
            self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


class TensorBoardBackend(Backend):
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, results_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.SummaryWriter = SummaryWriter
        self.root = Path(spec.log_dir) if spec.log_dir else results_dir / "tensorboard"
        self.writers: dict[str, object] = {}

    def open(self, trial, run_id, parent):
        directory = self.root / trial.name if trial.sweep else self.root
        writer = self.SummaryWriter(log_dir=str(directory))
        if run_id is None:  # parameters and tags once, as text (TensorBoard's hparams want a final metric)
            writer.add_text("parameters", _markdown(trial.params), 0)
            writer.add_text("tags", _markdown(trial.tags), 0)
        self.writers[str(directory)] = writer
        return str(directory)

    def log(self, run_id, step, metrics, timestamp):
        w = self.writers[run_id]
        for k, v in metrics.items():
            w.add_scalar(k, v, step, walltime=timestamp)
        w.flush()

    def close(self, run_id, summary, files, failed):
        w = self.writers.pop(run_id)
        if summary:
            w.add_text("summary", _markdown({k: f"{v:g}" for k, v in summary.items()}), 0)
        _images(w, files)
        w.close()

    def close_sweep(self, run_id, files, failed):
        if files:  # the sweep's figures, beside its trials' directories
            w = self.SummaryWriter(log_dir=str(self.root))
            _images(w, files)
            w.close()


def _images(writer, files: list[Path]) -> None:
    import matplotlib.image

    for f in files:
        if f.suffix == ".png":
            writer.add_image(f.stem, matplotlib.image.imread(str(f))[..., :3], 0, dataformats="HWC")


class WandbBackend(Backend):
    name = "wandb"
    ordered = True

    def __init__(self, spec: WandbSpec, experiment: str, results_dir: Path):
        import wandb

        self.wandb, self.spec, self.experiment, self.dir = wandb, spec, experiment, results_dir
        self.runs: dict[str, object] = {}
        self.group = spec.group

    def open_sweep(self, name, params, tags, run_id):
        self.group = self.spec.group or name
        return None

    def open(self, trial, run_id, parent):
        run_id = run_id or secrets.token_hex(4)  # W&B's run ids: lower-case letters and digits
        run = self.wandb.init(project=self.spec.project or self.experiment, entity=self.spec.entity,
                              group=self.group, name=trial.name if trial.sweep else self.experiment, id=run_id,
                              resume="allow", mode=self.spec.mode, dir=str(self.dir), config=trial.params,
                              tags=[f"{k}:{v}"[:64] for k, v in trial.tags.items() if k in ("commit", "machine")],
                              reinit="create_new", settings=self.wandb.Settings(silent=True, console="off"))
        self.runs[run_id] = run
        return run_id

    def log(self, run_id, step, metrics, timestamp):
        self.runs[run_id].log(metrics, step=step)

    def close(self, run_id, summary, files, failed):
        run = self.runs.pop(run_id)
        run.summary.update(summary)
        figures = {f"figures/{f.stem}": self.wandb.Image(str(f)) for f in files if f.suffix == ".png"}
        if figures:  # one row after the evaluations
            run.log(figures)
        run.finish(exit_code=1 if failed else 0)


def _markdown(d: dict) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in d.items())


class Tracking:
    """The trackers of one run or sweep, and the tracker runs of its trials (kept in tracking.json).
    Every call to a tracker goes through `_call`: the first error is said once and the tracker left
    out, so that tracking never stops a run."""

    def __init__(self, spec: TrackingSpec, experiment: str, results_dir: Path, trial_of: Callable[[str], Trial],
                 sweep: Optional[Trial] = None, warn=None, remember: bool = True):
        self.results_dir, self.trial_of, self.sweep = results_dir, trial_of, sweep
        self.warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
        # the tracker runs' ids, for a resumed run to continue them (not for a push to another tracker)
        self.state_path = results_dir / STATE_FILE if remember else None
        self.state: dict = (json.loads(self.state_path.read_text()) if self.state_path and self.state_path.exists()
                            else {})
        self.backends: list[Backend] = []
        self.failed: set[str] = set()
        self.opened: dict[tuple[str, str], str] = {}  # (backend, trial) -> run id, this process
        self.lock = threading.Lock()
        makers = {"mlflow": lambda s: MLflowBackend(s, experiment),
                  "tensorboard": lambda s: TensorBoardBackend(s, results_dir),
                  "wandb": lambda s: WandbBackend(s, experiment, results_dir)}
        for name in spec.configured():
            backend = self._call(name, makers[name], getattr(spec, name))
            if backend is not None:
                self.backends.append(backend)
        for b in self.backends:
            if sweep is not None:
                prior = self.state.get(b.name, {}).get("__sweep__")
                run_id = self._call(b.name, b.open_sweep, sweep.name, sweep.params, sweep.tags, prior)
                self._remember(b.name, "__sweep__", run_id)

    def _call(self, name: str, fn, *args):
        if name in self.failed:
            return None
        try:
            return fn(*args)
        except Exception as e:  # the tracker's own errors: connection refused, disk full, a bad key...
            self.failed.add(name)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            self.warn(f"raytrain-par: warning: tracking to {name} failed ({type(e).__name__}: {first}); training "
                      f"goes on without it, every record stays in {self.results_dir / 'metrics.parquet'} "
                      f"(raytrain-par report {self.results_dir} --to-mlflow URI pushes them later)")
            return None

    def _remember(self, backend: str, trial: str, run_id) -> None:
        if run_id is None:
            return
        self.state.setdefault(backend, {})[trial] = run_id
        self._save()

    def _save(self) -> None:
        if self.state_path is None:
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.state_path)

    def _run_of(self, b: Backend, trial: str) -> str | None:
        key = (b.name, trial)
        if key not in self.opened:
            parent = self.state.get(b.name, {}).get("__sweep__")
            prior = self.state.get(b.name, {}).get(trial)
            run_id = self._call(b.name, b.open, self._trial(trial), prior, parent)
            if run_id is None:
                return None
            self.opened[key] = run_id
            self._remember(b.name, trial, run_id)
        return self.opened[key]

    def _trial(self, name: str) -> Trial:
        try:
            return self.trial_of(name)
        except Exception:  # a trial the sweep does not name (yet): its records still go to the trackers
            return Trial(name, {}, {"trial": name}, sweep=self.sweep.name if self.sweep else None)

    def push(self, records: list[dict]) -> None:
        with self.lock:
            last = self.state.setdefault("last_step", {})
            for r in records:
                trial, step = r.get("trial") or "run", int(r["step"])
                metrics = metrics_of(r)
                for b in self.backends:
                    run_id = self._run_of(b, trial)
                    done = last.get(b.name, {}).get(trial, -1)
                    if run_id is None or (b.ordered and step <= done):
                        continue
                    self._call(b.name, b.log, run_id, step, metrics, r.get("timestamp"))
                    last.setdefault(b.name, {})[trial] = max(step, done)
            if records:
                self._save()

    def close(self, summaries: dict[str, dict], files: list[Path], failed: bool = False) -> None:
        """The end of the run or sweep: each trial's summary (its trials.parquet row's figures), the
        figures, and the tracker runs ended."""
        with self.lock:
            for b in self.backends:
                for (name, trial), run_id in list(self.opened.items()):
                    if name != b.name:
                        continue
                    row = summaries.get(trial, {})
                    summary = {k: v for k, v in metrics_of(row).items() if k.endswith(("_to_target_s", "_to_target",
                               "_metric", "wall_time_s", "throughput", "steps", "epochs", "mfu", "target_reached"))}
                    self._call(b.name, b.close, run_id, summary, files if self.sweep is None else [],
                               failed or row.get("status") == "failed")
                if self.sweep is not None:
                    self._call(b.name, b.close_sweep, self.state.get(b.name, {}).get("__sweep__"), files, failed)
            self.opened.clear()


class Follow:
    """While a run or sweep trains: reads its metrics.parquet every `interval_s` on a thread of the
    driver and pushes the records not pushed yet (by trial, step and timestamp: a resumed run's repeated
    evaluation is a new record) to `tracking`."""

    def __init__(self, tracking: Tracking, metrics: Path, interval_s: float = 2.0):
        self.tracking, self.metrics, self.interval_s = tracking, metrics, interval_s
        self.seen: set[tuple] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="raytrain-par-tracking", daemon=True)

    def __enter__(self) -> "Follow":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()  # what the run wrote after the last look

    def _loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:  # never a traceback on the run's console; the next look tries again
                self.tracking.warn(f"raytrain-par: warning: tracking could not read the records ({type(e).__name__}: "
                                   f"{e}); it tries again")

    def poll(self) -> None:
        from .metrics.records import read_records

        if not self.metrics.exists():
            return
        try:
            records = read_records(self.metrics)
        except (OSError, ValueError):  # being replaced this very moment: the next look reads it
            return
        new = [r for r in records if _key(r) not in self.seen]
        self.seen.update(_key(r) for r in new)
        self.tracking.push(sorted(new, key=lambda r: (r.get("trial") or "", r["step"])))


def _key(r: dict) -> tuple:
    return r.get("trial"), r["step"], r.get("timestamp")


def provenance_tags(spec_dict: dict) -> dict[str, str]:
    """A tracker run's tags: the command, commit and machine that made it, and what it trained."""
    from .provenance import machine_text, provenance

    made = provenance()
    return {"command": made["command"], "commit": made["commit"], "machine": machine_text(made["machine"]),
            "experiment": str(spec_dict.get("name")), "strategy": str((spec_dict.get("strategy") or {}).get("name")),
            "num_workers": json.dumps((spec_dict.get("scaling") or {}).get("num_workers"))}


def for_run(spec, results_dir: Path, warn=None) -> Tracking | None:
    """The trackers of `raytrain-par run` (one tracker run, "run"), or None without `tracking:`."""
    if spec.tracking is None or not spec.tracking.configured():
        return None
    d = spec.to_dict()
    trial = Trial("run", flat({k: v for k, v in d.items() if k != "tracking"}), provenance_tags(d))
    return Tracking(spec.tracking, spec.name, results_dir, lambda name: trial, warn=warn)


def for_sweep(spec, plan, results_dir: Path, overrides_of: Callable[[str], dict], warn=None) -> Tracking | None:
    """The trackers of `raytrain-par sweep`: a tracker run per trial (its experiment's fields as
    parameters), grouped under the sweep (its base experiment and search space as parameters)."""
    if spec.tracking is None or not spec.tracking.configured():
        return None
    d = spec.to_dict()
    sweep = Trial(spec.name, flat({k: v for k, v in d.items() if k != "tracking"}), provenance_tags(d))

    def trial_of(name: str) -> Trial:
        t = plan.trial_spec(overrides_of(name)).to_dict()
        return Trial(name, flat({k: v for k, v in t.items() if k not in ("tracking", "sweep")}),
                     {**provenance_tags(t), "trial": name}, sweep=spec.name)

    return Tracking(spec.tracking, spec.name, results_dir, trial_of, sweep=sweep, warn=warn)


def push_results(results_dir: Path, spec: TrackingSpec, warn=None) -> Tracking:
    """`raytrain-par report DIR --to-mlflow URI`: an earlier run's or sweep's records, pushed to a
    tracker after the fact (new tracker runs; the experiment's fields from its latest checkpoint where
    it has one, else the columns that say what each trial trained)."""
    from .metrics.records import read_records
    from .provenance import machine_text, runs_of

    records = read_records(results_dir / "metrics.parquet")
    trials_file = results_dir / "trials.parquet"
    rows = read_records(trials_file) if trials_file.exists() else []
    name = records[0].get("experiment") or results_dir.name
    runs = runs_of(results_dir)
    tags = {"pushed_from": str(results_dir)}
    if runs:
        tags.update({"command": runs[0]["command"], "commit": runs[0]["commit"],
                     "machine": machine_text(runs[0]["machine"])})
    loops = sorted(results_dir.glob("train/checkpoint_*/loop.json"))
    experiment = json.loads(loops[-1].read_text()).get("experiment") if loops else None
    identity = ("strategy", "num_workers", "pipeline_parallel", "tensor_parallel", "data_parallel",
                "data_parallel_sharding", "global_batch_size")

    def trial_of(trial: str) -> Trial:
        first = next(r for r in records if (r.get("trial") or "run") == trial)
        params = flat({k: v for k, v in experiment.items() if k not in ("tracking", "sweep")}) if (
            experiment and len({r.get("trial") for r in records}) == 1) else {}
        params.update({k: str(first.get(k)) for k in identity if first.get(k) is not None})
        return Trial(trial, params, {**tags, "trial": trial}, sweep=name if sweep else None)

    names = list(dict.fromkeys(r.get("trial") or "run" for r in records))
    sweep = Trial(name, {}, tags, sweep=None) if len(names) > 1 or len(rows) > 1 else None
    tracking = Tracking(spec, name, results_dir, trial_of, sweep=sweep, warn=warn, remember=False)
    tracking.push(sorted(records, key=lambda r: (r.get("trial") or "", r["step"])))
    summaries = {r["trial"]: r for r in rows if r.get("trial")}
    if len(names) == 1 and len(rows) == 1:
        summaries = {names[0]: rows[0]}
    tracking.close(summaries, sorted(results_dir.glob("*.png")))
    return tracking
