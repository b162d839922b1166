"""Runs an experiment on a Ray cluster: data -> Ray Data, TorchTrainer, records -> metrics.parquet.

By default an embedded local cluster is started (`ray.init()`); `address` (or RAY_ADDRESS) joins an
existing one. Results of an experiment live in <output_dir>/<name>/:

    metrics.parquet     one record per evaluation (see metrics/records.py)
    train/              Ray Train's run directory: checkpoints and its own state

A new run of an experiment whose directory exists moves the old directory aside (nothing is
overwritten); `resume=True` continues it from its latest checkpoint instead.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import ray
import ray.train
from ray.train import CheckpointConfig, DataConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from . import checkpoints
from . import data as data_sets
from . import tracking
from .config import ExperimentSpec
from .data.shards import DatasetInfo
from .errors import ConfigError, UserError
from .local_group import free_port
from .metrics.efficiency import summarize
from .metrics.memory import CACHING_ALLOCATOR_ENV, RETURNING_ALLOCATOR_ENV
from .metrics.records import RecordWriter, merge, progress_line, read_records, table, write_table
from .provenance import record_run
from .strategies import state as one_format
from .strategies.pieces import PieceError
from .worker import quiet_ray_logs, steps_per_epoch, train_loop_per_worker

RUN_SUBDIR = "train"
# Ray Train's controller polls workers every 2 s by default, so that every report after the first
# waits up to 2 s; a short interval keeps short evaluation intervals from being dominated by it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


@dataclass
class RunResult:
    results_dir: Path
    records: list[dict]
    error: BaseException | None = None


class RecordCallback(ray.train.UserCallback):
    """Runs on the Train controller (on the driver's node): merges the workers' reports of each
    evaluation into one record, appends it to metrics.parquet and prints a progress line."""

    def __init__(self, path: str):
        self.path = path
        self.writer: RecordWriter | None = None

    def after_report(self, run_context, metrics, checkpoint):
        if not metrics or not metrics[0]:
            return
        if self.writer is None:
            self.writer = RecordWriter(self.path)
        record = merge(metrics)
        self.writer.append(record)
        print(progress_line(record), flush=True)


# What keeps a run's console to the lines its user needs (each can be overridden from the environment):
QUIET = {
    # Ray 2.60's preemption watcher only logs drained nodes (recovery goes through FailureConfig), and
    # creating it prints a core-worker ERROR line about actor restarts (ray-project/ray#53727).
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0"),
    # Kineto, under the profiler that samples steps for the communication share, prints a USDT line at
    # every start and stop and an "External init callback" error when first used from another thread;
    # 6 is above every level it prints at.
    "KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", "6"),
    # Ray Train's own data configuration sets an option Ray Data 2.60 deprecates, and every run would
    # print the warning.
    "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore:`ExecutionOptions.exclude_resources` is deprecated:Warning"),
}


def worker_env(spec: ExperimentSpec | None = None) -> dict[str, str]:
    """Environment of every Ray process of a run (Ray passes it through the job's runtime_env)."""
    cpus = spec.scaling.cpus_per_worker if spec else 1
    env = {
        "OMP_NUM_THREADS": str(max(1, int(cpus))),
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
        **QUIET,
    }
    if not (spec and spec.scaling.use_gpu):
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would otherwise look for CUDA
        allocator = spec.scaling.host_allocator if spec else "caching"  # CPU workers only: on GPUs never measured
        env.update({"caching": CACHING_ALLOCATOR_ENV, "returning": RETURNING_ALLOCATOR_ENV}.get(allocator, {}))
    return env


def start_local_cluster(num_cpus: int, env: dict[str, str]) -> None:
    """An embedded single-node Ray cluster, reachable from this host only.

    Ray binds its servers to the node's address, which on Linux is the machine's network address.
    Ray's single-machine mode (the default on macOS and Windows, switched by an environment
    variable and a constant Ray reads at start) uses the loopback address instead; it is switched
    on only while the cluster starts, so that its processes inherit it and nothing else does.
    The dashboard, which serves the state API Ray Train cleans up stopped runs with, listens on
    127.0.0.1 as well. Not Ray's own: while a run trains, its rank-0 worker's torch.distributed store
    (torch's TCPStore, started by the env:// rendezvous Ray Train uses) listens on every interface;
    torch gives that rendezvous no address to bind.

    Ray Train's placement-group cleaner asks that state API without an address, so with a second
    Ray cluster on the machine it would find the wrong one (or none) and print a traceback. The
    cluster's GCS therefore starts on a port chosen here, and its workers get RAY_ADDRESS naming
    it; this process's own environment is left as it was.
    """
    from .ray_private import gcs_port_env_var, single_machine_mode

    port = free_port()
    env = {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    with single_machine_mode(), _environ({gcs_port_env_var(): str(port)}):
        # address "local": a new cluster always, never one `ray start` left running or recorded
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                 runtime_env={"env_vars": env}, log_to_driver=True, logging_level="WARNING")
    _start_autoscaling_coordinator()


def _loopback_only(address: str) -> bool:
    """Whether `address` is a cluster of this machine that listens on the loopback address only (an
    embedded one). Ray rewrites 127.0.0.1 to the machine's network address before it connects, and
    would wait for minutes where nothing listens there."""
    from .ray_private import node_ip_address_from_perspective

    host, _, port = address.rpartition(":")
    if "://" in address or host not in ("127.0.0.1", "localhost") or not port.isdigit():
        return False
    node_ip = node_ip_address_from_perspective()  # what Ray rewrites to, whether or not this process is connected
    if node_ip.startswith("127."):
        return False
    try:
        socket.create_connection((node_ip, int(port)), timeout=1.0).close()
        return False
    except OSError:
        return True


@contextmanager
def _environ(values: dict[str, str]):
    """These environment variables set for the block only (child processes started in it keep them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def ray_cluster(spec: ExperimentSpec, address: str | None = None, log=print):
    """Join the cluster at `address` / RAY_ADDRESS, reuse an initialised one, or start an embedded one."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        from .ray_private import single_machine_mode

        log(f"joining the Ray cluster at {address}")
        try:
            with single_machine_mode() if _loopback_only(address) else nullcontext():
                ray.init(address=address, runtime_env={"env_vars": worker_env(spec)}, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise _no_cluster(address, e) from None
        if not address.startswith("ray://"):
            # Ray Data keeps one detached stats actor per cluster, on the node of whoever first runs
            # a dataset. Made by a training worker it would keep that (GPU) node busy for good and
            # the autoscaler would never remove it: make it now, on the driver's node.
            from .ray_private import create_data_stats_actor

            create_data_stats_actor()
            _start_autoscaling_coordinator()
    else:
        need = spec.scaling.num_workers * spec.scaling.cpus_per_worker
        # Logical CPUs: training workers plus one for Ray Data's read tasks, which hang when
        # workers hold every CPU.
        num_cpus = max(os.cpu_count() or 1, math.ceil(need) + 1)
        log(f"starting an embedded Ray cluster ({num_cpus} CPUs)")
        start_local_cluster(num_cpus, worker_env(spec))
    try:
        yield
    finally:
        ray.shutdown()


def _start_autoscaling_coordinator() -> None:
    """A run's controller asks Ray's autoscaling coordinator (one detached actor per cluster) for its
    workers, and waits 5 s for the answer; the first ask also starts the actor's process, which on a
    busy machine takes longer, and Ray prints the timeout with a traceback. Started here, on the
    driver's node (where the controller runs and would start it), the ask finds it ready."""
    from .ray_private import autoscaling_coordinator

    ray.get(autoscaling_coordinator().__ray_ready__.remote(), timeout=120)


def preflight(spec: ExperimentSpec, address: str | None, log=print) -> None:
    """What can be refused before data is prepared or earlier results are moved aside."""
    from .checked import unchecked

    for warning in unchecked():
        log(f"warning: {warning}")
    place_results(spec, log)
    if address:  # also when this process is already connected: the address given must answer
        check_reachable(address)
    elif not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):
        check_reachable(os.environ["RAY_ADDRESS"], "RAY_ADDRESS")


def _no_cluster(address: str, reason, name: str = "--address") -> UserError:
    return UserError(f"{name} {address}: no Ray cluster answered ({reason}).\n"
                     "  fix: start one (`ray start --head`, `ray up clusters/...`), check the address, "
                     "or leave --address out to run on an embedded local cluster")


def check_reachable(address: str, name: str = "--address", timeout_s: float = 5.0) -> None:
    """Fail in seconds where nothing listens: ray.init retries such an address for minutes."""
    if address.startswith(("http://", "https://")):
        raise UserError(f"{name} {address}: that is the dashboard's job API, which `ray job submit` talks to.\n"
                        "  fix: give the cluster's GCS address (HOST:6379) or Ray client address (ray://HOST:10001), "
                        f"or submit the run as a job: ray job submit --address {address} --working-dir . -- "
                        "raytrain-par run ...")
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # Ray finds (or refuses) these itself, quickly
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise _no_cluster(address, e, name) from None


JOB_RESULTS_ENV = "RAYTRAIN_PAR_JOB_RESULTS"


def place_results(spec: ExperimentSpec, log=print) -> None:
    """Inside a Ray job the working directory is the job's temporary copy of --working-dir, which Ray
    deletes later: a relative output_dir goes under $RAYTRAIN_PAR_JOB_RESULTS instead, by default
    ~/ray_results/raytrain-par (Ray Train's own default storage root) on the node running the job."""
    # Ray's job supervisor sets this variable in the environment of every job's entrypoint.
    if not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or Path(spec.output_dir).expanduser().is_absolute():
        return
    root = Path(os.environ.get(JOB_RESULTS_ENV) or "~/ray_results/raytrain-par").expanduser()
    spec.output_dir = str(root / spec.output_dir)
    log(f"output_dir is relative inside a Ray job: results go to {spec.results_dir} on the node running the job "
        f"(set {JOB_RESULTS_ENV}, or give an absolute output_dir on storage every node mounts, for a multi-node "
        "cluster)")


def prepare_results_dir(spec: ExperimentSpec, resume: bool, log=print, run_subdir: str = RUN_SUBDIR) -> Path:
    results = spec.results_dir
    if resume:
        if not (results / run_subdir).exists():
            raise UserError(f"--resume: {results} holds no earlier run of {spec.name!r} to continue.\n"
                            "  fix: run without --resume to start it, or point output_dir at the earlier results")
        check_resumable(spec, results / run_subdir, log)
        record_run(results)
        return results
    if results.exists() and any(results.iterdir()):
        stamp = datetime.fromtimestamp(results.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        archive = results.with_name(f"{results.name}.{stamp}")
        n = 1
        while archive.exists():
            archive, n = results.with_name(f"{results.name}.{stamp}-{n}"), n + 1
        shutil.move(str(results), str(archive))
        log(f"earlier results of {spec.name!r} moved to {archive}")
    results.mkdir(parents=True, exist_ok=True)
    record_run(results)  # the command and commit every figure of these records is labelled with
    return results


# The optimizer's settings: a checkpoint's optimizer and schedule states hold the values they were
# written with (torch restores them with the state), so a changed value would silently not apply.
OPTIMIZER_KEYS = ("train.lr", "train.weight_decay", "train.momentum", "train.betas", "train.eps")
# The schedule's shape: the resumed run's schedule is the experiment's own, continued from the
# checkpoint's step (a longer run stretches a decaying schedule from there): said, not refused.
SCHEDULE_KEYS = ("train.max_steps", "train.epochs", "train.lr_schedule", "train.warmup_steps", "train.min_lr_ratio")
# What a checkpoint must agree on with the experiment that resumes it (the strategy and
# scaling.num_workers may change: strategies/state.py).
RESUME_KEYS = ("model", "data.name", "data.path", "data.format", "data.field", "data.tokenizer", "data.seq_len",
               "data.vocab_size", "data.seed", "data.val_fraction", "train.optimizer", "train.global_batch_size",
               "train.seed", *OPTIMIZER_KEYS)


def check_resumable(spec: ExperimentSpec, run_dir: Path, log=None) -> None:
    """Refuse, before any worker starts, to resume from checkpoints of another model, data or optimizer
    settings, or of an earlier release's format; say (through `log`) where the learning-rate schedule
    changes. The strategy, its options and the number of workers may change: a checkpoint holds every
    tensor whole by the plain model's names (strategies/state.py)."""
    import json

    found = sorted(run_dir.glob("checkpoint_*/loop.json"))
    if not found:
        return  # nothing checkpointed yet: the run restarts from the beginning
    # the newest checkpoint whose files are all there at their sizes (the workers check the sums too)
    damaged = {c.parent: checkpoints.problem(c.parent, checksums=False) for c in found}
    intact = [c for c in found if damaged[c.parent] is None]
    if not intact:
        newest = found[-1].parent
        raise UserError(f"--resume: no checkpoint in {run_dir} is intact; the newest, {newest.name}: "
                        f"{damaged[newest]}.\n  fix: restore its files, or start a new run without --resume "
                        "(the earlier results are kept aside)")
    if intact[-1] != found[-1] and log is not None:
        log(f"--resume: {found[-1].parent.name} is damaged ({damaged[found[-1].parent]}): the run continues "
            f"from {intact[-1].parent.name}")
    found = intact
    written = json.loads(found[-1].read_text())["experiment"]
    now = spec.to_dict()

    def get(d, path):
        for p in path.split("."):
            d = d.get(p) if isinstance(d, dict) else None
        return d

    why = one_format.old_format(found[-1].parent)
    if why:
        raise UserError(f"--resume: {why}.\n  fix: {one_format.OLD_FORMAT_FIX}")
    try:  # every tensor's stored pieces make it whole (their headers and the index; nothing read)
        one_format.source(found[-1].parent)
    except PieceError as e:
        raise UserError(f"--resume: {found[-1].parent} cannot be resumed: {e}.\n  fix: restore the files every "
                        "rank wrote into it (pieces-rank<r>.safetensors and .json), or start a new run without "
                        "--resume (the earlier results are kept aside)") from None
    diffs, notes = [], []
    loader = data_sets.loader_of(get(written, "data.name"), get(written, "data.loader"))
    if loader != spec.data.effective_loader:  # the defaults differ by data set: compare what ran
        diffs.append(f"data.loader: checkpoint {loader!r}, experiment {spec.data.effective_loader!r}: the two "
                     "loaders draw the rows of a step in different orders")
    diffs += [f"{key}: checkpoint {get(written, key)!r}, experiment {get(now, key)!r}" for key in RESUME_KEYS
              if get(written, key) != get(now, key) and key != "model"]
    if get(written, "model") != get(now, "model"):  # another model, or the same weights (e.g. other dropout)
        misfit = _misfit(spec, found[-1].parent)
        if misfit:
            diffs.append(f"model: checkpoint {get(written, 'model')!r}, experiment {get(now, 'model')!r}: {misfit}")
        elif log is not None:
            log(f"--resume: model {get(written, 'model')!r} -> {get(now, 'model')!r}: the checkpoint's weights fit "
                "the experiment's model (every name and shape)")
    if any(get(written, key) != get(now, key) for key in OPTIMIZER_KEYS):
        notes.append("the checkpoints' optimizer state holds the learning rate and optimizer settings it was "
                     "written with: a new value would not take effect")
    changed = [f"{key} {get(written, key)!r} -> {get(now, key)!r}" for key in SCHEDULE_KEYS
               if get(written, key) != get(now, key)]
    if changed and not diffs and log is not None:
        log(f"--resume: {', '.join(changed)}: the learning-rate schedule is the experiment's new one, "
            "continued from the checkpoint's step")
    if diffs:
        raise UserError(f"--resume: the checkpoints in {run_dir} were written by another setup:\n    "
                        + "\n    ".join(diffs) + "".join(f"\n  note: {n}" for n in notes)
                        + "\n  fix: resume with the settings the run started with, or "
                        "start a new run without --resume (the earlier results are kept aside)")


def _misfit(spec: ExperimentSpec, checkpoint: Path) -> str | None:
    """How the experiment's model differs from a checkpoint's weights (the first name or shape), or None
    where every weight fits: its shapes from a build on the meta device, the checkpoint's from its file's
    header (nothing loaded)."""
    import json

    from . import models
    from .strategies import state

    try:
        info = DatasetInfo.from_json(json.loads((checkpoint / "loop.json").read_text())["data"])
        wanted = {k: tuple(v.shape) for k, v in models.build_on_meta(spec.model, info)[0].state_dict().items()}
    except Exception as e:  # noqa: BLE001 - a model that cannot be built here differs for this check
        return f"its weights cannot be compared with the experiment's model ({type(e).__name__}: {e})"
    held = state.names_and_shapes(state.source(checkpoint))
    for name, shape in wanted.items():
        if name not in held:
            return f"the checkpoint has no {name}"
        if held[name] != shape:
            return f"its {name} is {list(held[name])}, the experiment's model's {list(shape)}"
    extra = sorted(set(held) - set(wanted))
    return f"the experiment's model has no {extra[0]}" if extra else None


def check_prepared(spec: ExperimentSpec, info: DatasetInfo) -> None:
    """Checks that need the prepared data: an epoch holds at least one global batch."""
    if steps_per_epoch(spec, info) < 1:
        raise ConfigError("train.global_batch_size", spec.train.global_batch_size,
                          f"larger than the {info.num_train} training rows of {info.name}",
                          "use a smaller global batch")


def ray_datasets(spec: ExperimentSpec, info: DatasetInfo) -> tuple[dict, DataConfig]:
    """Ray Data datasets over the Parquet shards.

    Splits every worker reads whole (both with the memory loader, `val` with the stream loader)
    are read here with pyarrow and handed to Ray Data as Arrow tables: for data that fits in
    memory that takes a fraction of a second, where `read_parquet` starts read tasks that take
    seconds to tens of seconds on a small cluster. The stream loader's `train` split is not a
    dataset: each worker reads its shards from `info.train_path` in one global order
    (data/loader.py says why Ray Data's streaming split cannot give one)."""
    import pyarrow.parquet as pq
    import ray.data

    from .data.shards import decode_image_files

    ray.data.DataContext.get_current().enable_progress_bars = False
    quiet_ray_logs()
    splits = [("val", info.val_path)]
    if spec.data.effective_loader == "memory":
        splits.insert(0, ("train", info.train_path))
    datasets = {}
    for name, path in splits:
        if info.encoded_images:
            ds = ray.data.read_parquet(path)
            if name == "val" and spec.data.max_val_samples:
                ds = ds.limit(spec.data.max_val_samples)
        else:
            table = pq.read_table(path)
            if name == "val" and spec.data.max_val_samples:
                table = table.slice(0, spec.data.max_val_samples)
            ds = ray.data.from_arrow(table)
        if info.encoded_images:
            ds = ds.map_batches(decode_image_files, fn_args=(info,), batch_format="numpy", batch_size=64)
        datasets[name] = ds
    return datasets, DataConfig(datasets_to_split=[])


def scaling_config(s) -> ScalingConfig:
    """A fixed worker group, or an elastic one (Ray Train chooses its size in [MIN, MAX] from the
    cluster's resources, and looks again every resize_interval_s)."""
    resources = {"CPU": s.cpus_per_worker}
    if s.use_gpu:
        resources["GPU"] = s.gpus_per_worker
    return ScalingConfig(num_workers=(s.min_workers, s.num_workers) if s.elastic else s.num_workers,
                         elastic_resize_monitor_interval_s=s.resize_interval_s, use_gpu=s.use_gpu,
                         resources_per_worker=resources)


def make_trainer(spec: ExperimentSpec, info: DatasetInfo, storage: Path, name: str = RUN_SUBDIR, trial: str = "run",
                 callbacks: list | None = None, loop=train_loop_per_worker, loop_config: dict | None = None,
                 datasets: tuple[dict, DataConfig] | None = None) -> TorchTrainer:
    """A TorchTrainer of `spec`'s workers running `loop` (by default the training loop, on the
    experiment's datasets)."""
    t = spec.train
    datasets, data_config = datasets or ray_datasets(spec, info)
    return TorchTrainer(
        loop,
        train_loop_config={"experiment": spec.to_dict(), "data": info.to_json(), "trial": trial, **(loop_config or {})},
        torch_config=TorchConfig(backend=spec.scaling.effective_backend),
        scaling_config=scaling_config(spec.scaling),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
            failure_config=FailureConfig(max_failures=t.max_failures, max_preemption_failures=t.max_preemptions),
            callbacks=callbacks or [],
            logging_config=LoggingConfig(log_level=os.environ.get("RAYTRAIN_PAR_RAY_LOG_LEVEL", "WARNING")),
        ),
        datasets=datasets,
        dataset_config=data_config,
    )


def tracked_figures(results: Path) -> list[Path]:
    """The report's figures of a run or sweep, for its trackers (written beside its records)."""
    from .report import write_report

    try:
        return [f for f in write_report(results) if f.suffix == ".png"]
    except Exception as e:  # the records are complete whatever the figures do; say why there are none
        print(f"raytrain-par: warning: no figures for the trackers ({type(e).__name__}: {e})", file=sys.stderr)
        return []


def _workers_text(s) -> str:
    return f"{s.min_workers} to {s.num_workers} (elastic)" if s.elastic else str(s.num_workers)


def run_experiment(spec: ExperimentSpec, address: str | None = None, resume: bool = False, log=print) -> RunResult:
    """Run one experiment end to end; returns its records (also in <results>/metrics.parquet)."""
    preflight(spec, address, log)
    info = data_sets.prepare(spec.data, spec.data.cache_dir, log=log)
    check_prepared(spec, info)
    results = prepare_results_dir(spec, resume, log=log)
    metrics_path = results / "metrics.parquet"
    log(f"{spec.name}: {spec.model.name} on {spec.data.name}, strategy {spec.strategy.name}, "
        f"{_workers_text(spec.scaling)} worker(s), global batch {spec.train.global_batch_size} "
        f"({spec.per_worker_batch} per data-parallel worker); results in {results}")
    t0 = time.perf_counter()
    error = None
    trackers = tracking.for_run(spec, results)
    with ray_cluster(spec, address, log=log):
        trainer = make_trainer(spec, info, results, callbacks=[RecordCallback(str(metrics_path))])
        with tracking.Follow(trackers, metrics_path) if trackers else nullcontext():
            try:
                trainer.fit()
            except (ray.train.TrainingFailedError, ray.train.ControllerError) as e:
                error = e
    records = read_records(metrics_path) if metrics_path.exists() else []
    row = None
    if records:
        t = spec.target
        row = summarize(records, t.metric if t else "val_loss", t.value if t else None, t.mode if t else "min")
        row.update({"lr": spec.train.lr, "status": "failed" if error else "completed",
                    "error": str(error) if error else None})
        write_table(results / "trials.parquet", [row])
    if trackers:
        trackers.close({"run": row or {}}, tracked_figures(results) if records else [], failed=error is not None)
    log("")
    log(table(records))
    if spec.target is not None:
        met = [r for r in records if r.get("target_met")]
        log(f"target {spec.target}: " + (f"met at step {met[0]['step']}, {met[0]['wall_time_s']:.1f} s of training"
                                          if met else "not met"))
    log(f"{len(records)} records in {metrics_path} ({time.perf_counter() - t0:.0f} s in all)")
    if error is not None:
        print(f"training failed: {error}", file=sys.stderr)
    return RunResult(results, records, error)
