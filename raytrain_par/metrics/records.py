"""The evaluation record: one row per evaluation, the same columns for every strategy.

Workers each report a dict; `merge` turns the reports of one evaluation into one record (the
training figures are the same on every rank; memory differs per worker, so the record keeps the
largest and the per-worker list). `RecordWriter` keeps `metrics.parquet` complete after every
evaluation, so a crash leaves every record written so far readable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from ..tables import text_table

# Columns every record has, in order. Memory columns (these, and any other `mem_*` column a strategy
# adds) and the hardware-efficiency figures of PER_WORKER are per worker, reduced by max.
COLUMNS = [
    "experiment", "trial", "strategy", "num_workers", "pipeline_parallel", "tensor_parallel", "data_parallel",
    "data_parallel_sharding", "global_batch_size", "gradient_accumulation_steps", "epoch", "step", "progress",
    "samples_seen",
    "wall_time_s", "elapsed_s", "startup_s", "train_loss", "val_loss", "val_perplexity", "val_accuracy", "lr",
    "throughput", "step_time_s", "eval_time_s", "checkpoint_time_s",
    "checkpoint_stall_s", "checkpoint_wait_s", "checkpoint_write_s", "target_met", "timestamp", "started_at",
    "resumed_from_step",
    "model_flops_per_step", "achieved_tflops", "peak_tflops", "peak_source", "probe_tflops", "mfu", "comm_fraction",
    "mem_peak_bytes", "mem_model_state_bytes", "mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes",
    "mem_model_state_census_bytes", "mem_model_state_theory_bytes",
]
MEMORY = [c for c in COLUMNS if c.startswith("mem_")]
# Each worker probes its own peak, times its own steps and profiles its own waits: the record keeps
# the largest of each (for comm_fraction, the worker that waited longest; for a checkpoint's stall and
# write, the slowest worker's, rank 0's that writes the tensors).
PER_WORKER = ["achieved_tflops", "peak_tflops", "probe_tflops", "mfu", "comm_fraction", "checkpoint_stall_s",
              "checkpoint_wait_s", "checkpoint_write_s"]


def merge(reports: list[dict]) -> dict:
    """The reports of all workers for one evaluation -> one record."""
    first = reports[0]
    record = {c: first.get(c) for c in COLUMNS if c not in MEMORY}
    # Strategy-specific memory columns (e.g. a pipeline's activation bytes) are per worker like the rest.
    memory = MEMORY + [k for k in first if k.startswith("mem_") and k not in MEMORY]
    for c in memory + PER_WORKER:
        values = [r.get(c) for r in reports if r.get(c) is not None]
        record[c] = max(values) if values else None
        record[f"{c}_per_worker"] = values
    for k, v in first.items():  # strategy-specific extras (e.g. a pipeline's bubble) travel along
        if k not in record:
            record[k] = v
    return record


class RecordWriter:
    """Appends records to <directory>/metrics.parquet, rewriting it atomically each time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = read_records(self.path) if self.path.exists() else []

    def append(self, record: dict) -> None:
        # A resumed run repeats the evaluation of the checkpoint it resumed from: keep one per (trial, step).
        self.records = [r for r in self.records if (r.get("trial"), r.get("step")) != (record.get("trial"), record.get("step"))]
        self.records.append(record)
        write_table(self.path, self.records)


def write_table(path: str | Path, rows: list[dict]) -> Path:
    """Rows -> a Parquet file, replaced atomically (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every column any row has (a strategy may add one from its second record on): pyarrow would
    # take the columns of the first row only.
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp)
    os.replace(tmp, path)
    return path


def read_records(path: str | Path) -> list[dict]:
    # Read the file's bytes at once: given a path, pyarrow may open it again between the footer and the
    # pages, and a writer replacing the file in between (a run's records, read while it trains) would
    # make it read the pages of one file by the footer of another. Then parsed on this thread, from
    # memory, with no pre-buffering: pyarrow's thread pools' tasks (pq.read_table's dataset scan; the
    # pre-buffering reads ParquetFile submits to its I/O pool by default, as of pyarrow 26) can outlive
    # the call and abort the interpreter at exit ("terminate called without an active exception"; 4
    # exits in 5 with read_table, 1 in 6 within the test suite with ParquetFile's defaults).
    with open(path, "rb") as f:
        data = pa.BufferReader(f.read())
    return pq.ParquetFile(data, pre_buffer=False).read(use_threads=False).to_pylist()


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _metric_text(r: dict) -> str:
    parts = [f"val_loss {r['val_loss']:.4f}"] if r.get("val_loss") is not None else []
    if r.get("val_perplexity") is not None:
        parts.append(f"ppl {r['val_perplexity']:.1f}")
    if r.get("val_accuracy") is not None:
        parts.append(f"acc {r['val_accuracy']:.3f}")
    return "  ".join(parts)


def progress_line(r: dict) -> str:
    train = "" if r.get("train_loss") is None else f"train_loss {r['train_loss']:.4f}  "
    return (f"[{r['experiment']}/{r['trial']}] step {r['step']:>6}  epoch {r['epoch']:.2f}  "
            f"wall {r['wall_time_s']:7.1f}s  {train}{_metric_text(r)}  "
            f"{r['throughput'] or 0:8.1f} samples/s" + (f"  MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else "")
            + (f"  batch {r['global_batch_size']} -> {r['next_global_batch_size']}"
               if r.get("next_global_batch_size") is not None else "")
            + f"  mem/worker {mib(r['mem_peak_bytes'])} MiB peak, {_states_text(r)}"
            + ("  [target met]" if r.get("target_met") else ""))


def _states_text(r: dict) -> str:
    """Model states as the engine's live tensors count them (parameters, gradients, optimizer state),
    beside the theory for the strategy and what the allocator holds since the engine was built (adds
    buffers no tensor names, and on CPU whatever else the process allocated): docs/memory.md."""
    census = r.get("mem_model_state_census_bytes")
    if census is None:
        return f"{mib(r['mem_model_state_bytes'])} MiB model states (allocator)"
    extra = [f"theory {mib(r['mem_model_state_theory_bytes'])}"] if r.get("mem_model_state_theory_bytes") else []
    extra.append(f"allocator {mib(r['mem_model_state_bytes'])}")
    return f"model states {mib(census)} MiB ({', '.join(extra)})"


def table(records: Iterable[dict]) -> str:
    """A fixed-width table of records for the terminal."""
    head = ["step", "epoch", "wall_s", "train_loss", "val_loss", "val_ppl", "val_acc", "samples/s", "MFU_%",
            "peak_MiB", "states_MiB", "theory_MiB", "allocator_MiB"]
    rows = []
    for r in records:
        rows.append([
            str(r["step"]), f"{r['epoch']:.2f}", f"{r['wall_time_s']:.1f}",
            "-" if r.get("train_loss") is None else f"{r['train_loss']:.4f}",
            "-" if r.get("val_loss") is None else f"{r['val_loss']:.4f}",
            "-" if r.get("val_perplexity") is None else f"{r['val_perplexity']:.1f}",
            "-" if r.get("val_accuracy") is None else f"{r['val_accuracy']:.3f}",
            f"{r.get('throughput') or 0:.1f}", "-" if not r.get("mfu") else f"{100 * r['mfu']:.1f}",
            mib(r.get("mem_peak_bytes")), mib(r.get("mem_model_state_census_bytes")),
            mib(r.get("mem_model_state_theory_bytes")), mib(r.get("mem_model_state_bytes")),
        ])
    return text_table(head, rows)
