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
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import ray
import ray.train
from ray.train import CheckpointConfig, DataConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from . import data as data_sets
from .config import ExperimentSpec
from .data.shards import DatasetInfo
from .errors import ConfigError, UserError
from .metrics.memory import MALLOC_ENV
from .metrics.records import RecordWriter, merge, progress_line, read_records, table
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


def worker_env(spec: ExperimentSpec | None = None) -> dict[str, str]:
    """Environment of every Ray process of a run (Ray passes it through the job's runtime_env)."""
    cpus = spec.scaling.cpus_per_worker if spec else 1
    env = {
        **MALLOC_ENV,  # large tensors as mmaps of their own: memory accounting sees what is held
        "OMP_NUM_THREADS": str(max(1, int(cpus))),
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
    }
    if not (spec and spec.scaling.use_gpu):
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would otherwise look for CUDA
    return env


def start_local_cluster(num_cpus: int, env: dict[str, str]) -> None:
    """An embedded single-node Ray cluster, reachable from this host only."""
    # The dashboard serves Ray's state API, which Ray Train uses to clean up after stopped runs;
    # it listens on 127.0.0.1 only.
    ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=True, logging_level="WARNING")


@contextmanager
def ray_cluster(spec: ExperimentSpec, address: str | None = None, log=print):
    """Join the cluster at `address` / RAY_ADDRESS, reuse an initialised one, or start an embedded one."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log(f"joining the Ray cluster at {address}")
        try:
            ray.init(address=address, runtime_env={"env_vars": worker_env(spec)}, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"--address {address}: no Ray cluster answered ({e}).\n"
                            "  fix: start one (`ray start --head`, `ray up clusters/...`), check the address, "
                            "or leave --address out to run on an embedded local cluster") from None
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


def prepare_results_dir(spec: ExperimentSpec, resume: bool, log=print) -> Path:
    results = spec.results_dir
    if resume:
        if not (results / RUN_SUBDIR).exists():
            raise UserError(f"--resume: {results} holds no earlier run of {spec.name!r} to continue.\n"
                            "  fix: run without --resume to start it, or point output_dir at the earlier results")
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
    return results


def check_prepared(spec: ExperimentSpec, info: DatasetInfo) -> None:
    """Checks that need the prepared data: an epoch holds at least one global batch."""
    if steps_per_epoch(spec, info) < 1:
        raise ConfigError("train.global_batch_size", spec.train.global_batch_size,
                          f"larger than the {info.num_train} training rows of {info.name} "
                          f"({'per worker' if spec.data.effective_loader == 'stream' else 'in all'})",
                          "use a smaller global batch")


def ray_datasets(spec: ExperimentSpec, info: DatasetInfo) -> tuple[dict, DataConfig]:
    """Ray Data datasets over the Parquet shards. With the memory loader every worker reads both
    splits whole (and takes its slice of each global batch); the stream loader splits `train`."""
    import ray.data

    from .data.shards import decode_image_files

    ray.data.DataContext.get_current().enable_progress_bars = False
    quiet_ray_logs()

    datasets = {"train": ray.data.read_parquet(info.train_path), "val": ray.data.read_parquet(info.val_path)}
    if info.encoded_images:
        for k in datasets:
            datasets[k] = datasets[k].map_batches(decode_image_files, fn_args=(info,), batch_format="numpy",
                                                  batch_size=64)
    if spec.data.max_val_samples:
        datasets["val"] = datasets["val"].limit(spec.data.max_val_samples)
    split = ["train"] if spec.data.effective_loader == "stream" else []
    # Splits every worker reads whole are read once, here, into the object store: workers then
    # fetch blocks instead of each running its own read tasks.
    for name in datasets:
        if name not in split:
            datasets[name] = datasets[name].materialize()
    return datasets, DataConfig(datasets_to_split=split)


def make_trainer(spec: ExperimentSpec, info: DatasetInfo, storage: Path, name: str = RUN_SUBDIR, trial: str = "run",
                 callbacks: list | None = None) -> TorchTrainer:
    s, t = spec.scaling, spec.train
    resources = {"CPU": s.cpus_per_worker}
    if s.use_gpu:
        resources["GPU"] = s.gpus_per_worker
    datasets, data_config = ray_datasets(spec, info)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"experiment": spec.to_dict(), "data": info.to_json(), "trial": trial},
        torch_config=TorchConfig(backend=s.effective_backend),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
            failure_config=FailureConfig(max_failures=t.max_failures),
            callbacks=callbacks or [],
            logging_config=LoggingConfig(log_level=os.environ.get("RAYTRAIN_PAR_RAY_LOG_LEVEL", "WARNING")),
        ),
        datasets=datasets,
        dataset_config=data_config,
    )


def run_experiment(spec: ExperimentSpec, address: str | None = None, resume: bool = False, log=print) -> RunResult:
    """Run one experiment end to end; returns its records (also in <results>/metrics.parquet)."""
    info = data_sets.prepare(spec.data, spec.data.cache_dir, log=log)
    check_prepared(spec, info)
    results = prepare_results_dir(spec, resume, log=log)
    metrics_path = results / "metrics.parquet"
    log(f"{spec.name}: {spec.model.name} on {spec.data.name}, strategy {spec.strategy.name}, "
        f"{spec.scaling.num_workers} worker(s), global batch {spec.train.global_batch_size} "
        f"({spec.per_worker_batch} per data-parallel worker); results in {results}")
    t0 = time.perf_counter()
    error = None
    with ray_cluster(spec, address, log=log):
        trainer = make_trainer(spec, info, results, callbacks=[RecordCallback(str(metrics_path))])
        try:
            trainer.fit()
        except (ray.train.TrainingFailedError, ray.train.ControllerError) as e:
            error = e
    records = read_records(metrics_path) if metrics_path.exists() else []
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
