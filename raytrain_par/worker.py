"""The training loop every worker runs, the same for every strategy.

`Trainer` is the loop: batches -> engine.train_step, periodic evaluation, one record and (maybe) a
checkpoint per evaluation. It does not know Ray: a `Reporter` delivers records and checkpoints.
`train_loop_per_worker` is the Ray Train entry point: it reads the Ray Data shards and reports
through `ray.train.report`. `LocalReporter` serves torchrun and tests.

Timing: `wall_time_s` counts training only (steps, including their communication), not the time
spent evaluating, checkpointing or reporting, so that curves of validation quality against wall
time compare strategies rather than evaluation schedules; `elapsed_s` is the plain elapsed time
since training started, and `startup_s` the time before it (model build, data load, wrapping).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import checkpoints, strategies
from .config import ExperimentSpec
from .data.loader import MemoryLoader, StreamLoader, eval_batches
from .data.shards import DatasetInfo
from .metrics import adaptive, flops
from .metrics.throughput import Probe, fit_strategy
from .metrics.records import RecordWriter, merge, progress_line
from .metrics.timeline import profiled_step, warm_up_profiler
from .strategies import DistContext, Engine
from .strategies.context import DTYPES
from .strategies.optim import lr_factor
from .strategies import state as one_format
from .saving import Save


@dataclass
class LoopState:
    """Where training stands; saved with every checkpoint so that a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    samples_seen: int = 0
    wall_time_s: float = 0.0
    elapsed_s: float = 0.0
    eval_time_s: float = 0.0
    checkpoint_time_s: float = 0.0
    evals: int = 0
    target_met: bool = False
    # Steps of the starting batch the learning-rate schedule and the run's length count (`step` for a
    # fixed batch; an adaptive run's step at batch M advances it by its lr_scale, metrics/adaptive.py).
    progress: float = 0.0
    # The gradient noise scale's running averages (metrics/goodput.py NoiseScale.state)
    noise: dict | None = None
    # -- an adaptive batch (train.adaptive_batch): what it trains with now and what decided it
    global_batch_size: int | None = None
    accumulation: int | None = None
    rows_in_epoch: int = 0
    lr_scale: float = 1.0
    workers: int | None = None  # the worker count of the decision (an elastic resize decides again)
    # timed intervals, [workers, rows per replica, accumulation steps, seconds per step]: replayed by a
    # resumed run, never measured again
    probes: list = field(default_factory=list)
    choice: dict | None = None  # the latest decision (metrics/adaptive.py Choice)


class Reporter:
    """Where records and checkpoints go."""

    log: Callable[[str], None] = print

    def report(self, metrics: dict, save: Save | None) -> None:
        """Deliver an evaluation's record, with the checkpoint `save` took at it: `save.run(hand_over)`
        writes the checkpoint and hands it over, on the training thread (a sync save) or in the
        background, after which `save.fill(metrics)` puts its times into the record. Records are
        delivered in the order reported; a record without a checkpoint never waits on the training
        thread for one being written."""
        raise NotImplementedError

    def close(self) -> None:
        """Once everything reported has been delivered; a failure to deliver raised here."""

    def candidates(self) -> list:
        """Checkpoints to resume from, newest first (whatever `open` takes)."""
        return []

    @contextmanager
    def open(self, candidate) -> Iterator[Path]:
        yield Path(candidate)

    @contextmanager
    def restored(self) -> Iterator[Path | None]:
        """The newest intact checkpoint directory, if any; damaged ones are reported and skipped."""
        for candidate in self.candidates():
            with self.open(candidate) as directory:
                bad = checkpoints.problem(directory)
                if bad is None:
                    yield directory
                    return
                self.log(f"WARNING: checkpoint {candidate} is damaged: {bad}; trying the one before it")
        if self.candidates():
            self.log("WARNING: no intact checkpoint left: training starts from the beginning")
        yield None


class Trainer:
    def __init__(self, spec: ExperimentSpec, info: DatasetInfo, ctx: DistContext, reporter: Reporter,
                 train_loader: Callable[[Engine], MemoryLoader | StreamLoader], val_arrays: dict[str, torch.Tensor],
                 trial: str = "run", startup_s: float = 0.0, log: Callable[[str], None] = print):
        self.spec, self.info, self.ctx, self.reporter = spec, info, ctx, reporter
        self.val_arrays, self.trial, self.log = val_arrays, trial, log
        self.t_setup = time.perf_counter() - startup_s
        self.total_steps = spec.total_steps(steps_per_epoch(spec, info))
        if strategies.engine_class(spec.strategy.name, spec.strategy.options).profiles_steps:
            # The profiler's first use keeps tens of MB of host memory for good: take it before the
            # engine notes what the allocator holds, so that it does not count as model state.
            warm_up_profiler(ctx.device)
        # filled in `run`: from the checkpoint it resumes from, else with the weights the run starts from
        self.engine, self.task = strategies.start_engine(spec, info, ctx, self.total_steps, fill=False)
        # Counted and probed once, before training: a second or less on any model and device.
        self.flops_per_step = flops.model_flops_per_step(spec.model, info, spec.train.global_batch_size)
        self.peak_tflops, self.peak_source, self.probe_tflops = flops.peak(ctx.device, DTYPES[spec.train.precision])
        self.comm_fraction: float | None = None  # of the latest profiled step
        self.train_loader = train_loader
        self.loader = train_loader(self.engine)
        assert self.loader.steps_per_epoch == steps_per_epoch(spec, info)
        self.state = LoopState()
        self.adaptive = spec.train.adaptive_batch
        self.resized = False  # the batch changed at the latest evaluation: the epoch goes on at the new one
        self.settling = 0  # steps left before the step time an adaptive run decides on is timed (_timed_from)
        if self.adaptive is not None:
            self.lr_factor = lr_factor(spec.train, self.total_steps)
            lo = self.adaptive.min_global_batch_size or spec.train.global_batch_size
            self.shapes = type(self.engine).batch_layout(spec.train, self.engine.layout, self._max_rows()).shapes(
                lo, self.adaptive.max_global_batch_size)
            self.state.global_batch_size = spec.train.global_batch_size
            self.state.accumulation = spec.train.gradient_accumulation_steps
            self.state.workers = ctx.world_size
            self.last_lr: float | None = None
        self.resumed_from: int | None = None
        self.records: list[dict] = []
        self.writing: Save | None = None  # the latest checkpoint, maybe still being written
        self.snapshot_buffers: dict = {}  # host memory of async checkpoints, reused by each (state.snapshot)
        self.staging = None  # the thread allocating them ahead of the first async checkpoint (state.stage_buffers)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        with self.reporter.restored() as directory:
            if directory is not None:
                self._load(directory)
                self.resumed_from = self.state.step
                self.log(f"resumed from {directory} at step {self.state.step}")
            else:
                strategies.start_from_initial(self.engine, self.spec, self.info)
        if self.adaptive is not None:
            self._resume_batch()
        spec, state = self.spec, self.state
        self.startup_s = time.perf_counter() - self.t_setup
        self.started_at = time.time()
        t_begin = time.perf_counter() - state.elapsed_s
        if state.step == 0 and spec.train.eval_at_start and state.evals == 0:
            self._evaluate_and_report(train_loss=None, interval_s=0.0, interval_steps=0, t_begin=t_begin)
        every = spec.train.eval_every_steps
        # The loss stays on the device until an evaluation: reading it every step would make the
        # host wait for the device every step (on GPUs, a stall of its own).
        running, steps_in_interval, t_interval = torch.zeros((), device=self.engine.device), 0, time.perf_counter()
        timed = (t_interval, 0)  # when and after how many of the interval's steps its timing for the batch starts
        self.settling = self.SETTLING_STEPS if self.adaptive is not None else 0
        stop, start_step = False, state.step
        while not self._finished() and not stop:
            for batch in self._epoch():
                self.engine.measure_memory = self._measures_memory(state.step, start_step)
                if self.adaptive is not None:
                    self.last_lr = spec.train.lr * self.lr_factor(state.progress) * state.lr_scale
                    self.engine.set_lr(self.last_lr)
                if self._profiles(state.step, start_step):
                    with profiled_step(self.engine.device) as sample:
                        loss = self.engine.train_step(batch)
                    self.comm_fraction = sample["comm_fraction"]
                else:
                    loss = self.engine.train_step(batch)
                running = running + loss.detach().float()
                steps_in_interval += 1
                if self.settling:
                    self.settling -= 1
                    timed = self._timed_from(running, steps_in_interval)
                state.step += 1
                if state.step == start_step + 1 and spec.train.checkpoint_mode == "async" \
                        and spec.train.checkpoint_every_evals:
                    self.staging = one_format.stage_buffers(self.engine, self.snapshot_buffers)
                state.step_in_epoch += 1
                state.samples_seen += self.loader.global_batch
                state.rows_in_epoch += self.loader.global_batch
                before, state.progress = state.progress, state.progress + state.lr_scale
                epoch_done = self._epoch_ends(0)
                if epoch_done:
                    state.epoch, state.step_in_epoch, state.rows_in_epoch = state.epoch + 1, 0, 0
                last = self._finished()
                if last or (every and state.progress // every > before // every) or (every is None and epoch_done):
                    local_mean = (running / steps_in_interval).cpu()  # waits for the device's last step
                    t_end = time.perf_counter()
                    interval_s = t_end - t_interval
                    state.wall_time_s += interval_s
                    train_loss = float(self.engine.dp_sum(local_mean.to(self.engine.device)).cpu()) / self.engine.dp_size
                    stop = self._evaluate_and_report(train_loss, interval_s, steps_in_interval, t_begin, last,
                                                     timed=(t_end - timed[0], steps_in_interval - timed[1]))
                    running = torch.zeros((), device=self.engine.device)
                    steps_in_interval, t_interval = 0, time.perf_counter()
                    timed = (t_interval, 0)
                if epoch_done or last or stop or self.resized:
                    self.resized = False
                    break
        if self.writing is not None:
            self.writing.wait()
        self.reporter.close()
        return self.records

    #: steps at the start of each run (and of each resumed run) whose model states are measured
    MEASURED_FIRST_STEPS = 3

    def _measures_memory(self, step: int, start_step: int) -> bool:
        """Whether the step after `step` measures model states: the first few steps of this process
        (the optimizer's state appears on the first, so states have settled by the second) and the
        last step before each evaluation, so that every record's figure is fresh. Other steps skip
        the measurement; it costs a census of every tensor and the allocator's statistics."""
        if step - start_step < self.MEASURED_FIRST_STEPS:
            return True
        now, every = self.state.progress, self.spec.train.eval_every_steps
        nxt = now + self.state.lr_scale
        if nxt >= self.total_steps:
            return True
        if every:
            return nxt // every > now // every
        return self._epoch_ends(1)

    # -- where the run stands: steps of a fixed batch, progress and rows of an adaptive one ------------
    def _finished(self) -> bool:
        """The run's length is in steps of the starting batch (`progress`: the step count, at a fixed batch)."""
        return self.state.progress >= self.total_steps

    def _epoch(self):
        if self.adaptive is None:
            return self.loader.epoch(self.state.epoch, self.state.step_in_epoch)
        return self.loader.epoch(self.state.epoch, start_row=self.state.rows_in_epoch)

    def _epoch_ends(self, after: int) -> bool:
        """Whether the epoch has no rows left for a step after `after` more steps at the current batch."""
        if self.adaptive is None:
            return self.state.step_in_epoch + after == self.loader.steps_per_epoch
        return self.state.rows_in_epoch + (after + 1) * self.loader.global_batch > self.loader.n

    def _epoch_fraction(self) -> float:
        if self.adaptive is None:
            return self.state.step / self.loader.steps_per_epoch
        return self.state.epoch + self.state.rows_in_epoch / self.loader.n

    #: steps between two profiled steps (see `_profiles`)
    PROFILE_EVERY = 100

    def _profiles(self, step: int, start_step: int) -> bool:
        """Whether the step after `step` runs under torch's profiler, which tells how much of it was
        spent waiting for communication (`comm_fraction`, see metrics/timeline.py): the first step
        after those that measure memory, then every PROFILE_EVERY steps. A profiled step runs a
        little slower and counts in the wall time like any other; sampling keeps that cost small.
        Never for an engine whose communication outlives its steps (`Engine.profiles_steps`)."""
        if not self.engine.profiles_steps:
            return False
        done = step - start_step - self.MEASURED_FIRST_STEPS
        return done >= 0 and done % self.PROFILE_EVERY == 0

    def _evaluate_and_report(self, train_loss: float | None, interval_s: float, interval_steps: int, t_begin: float,
                             last: bool = False, timed: tuple[float, int] | None = None) -> bool:
        """Evaluate, take the record (and a checkpoint where one is due) and report them; whether the run stops
        at its target. `timed`: the seconds and steps of the interval an adaptive run's timing counts
        (`_timed_from`), by default the whole interval."""
        spec, state = self.spec, self.state
        t0 = time.perf_counter()
        val = self.engine.evaluate(eval_batches(self.val_arrays, spec.per_worker_batch, self.engine.dp_rank,
                                                self.engine.dp_size, spec.data.max_val_samples))
        state.eval_time_s += time.perf_counter() - t0
        state.evals += 1
        target = spec.target
        met = bool(target is not None and target.met(val[target.metric]))
        state.target_met = state.target_met or met
        stop = met and spec.train.stop_at_target
        record = {
            "experiment": spec.name, "trial": self.trial, "strategy": spec.strategy.name,
            "num_workers": spec.scaling.num_workers, **self.engine.layout.columns(),
            "global_batch_size": self.loader.global_batch, "gradient_accumulation_steps": self.engine.train.gradient_accumulation_steps,
            "epoch": self._epoch_fraction(), "step": state.step, "progress": state.progress, "samples_seen": state.samples_seen,
            "wall_time_s": state.wall_time_s, "startup_s": self.startup_s, "train_loss": train_loss,
            "val_loss": val["val_loss"], "val_perplexity": val.get("val_perplexity"),
            "val_accuracy": val.get("val_accuracy"),
            "lr": self.engine.lr if self.adaptive is None or self.last_lr is None else self.last_lr,
            "throughput": interval_steps * self.loader.global_batch / interval_s if interval_s else None,
            "step_time_s": interval_s / interval_steps if interval_steps else None,
            "eval_time_s": state.eval_time_s, "target_met": met, **self._utilisation(interval_s, interval_steps),
            "timestamp": time.time(), "started_at": self.started_at, "resumed_from_step": self.resumed_from,
            **self.engine.memory(), **self.engine.statistics(),
        }
        if self.adaptive is not None:
            # an interval of settling steps only is timed whole
            record.update(self._adapt(*(timed if timed and timed[1] else (interval_s, interval_steps)), last or stop))
        save = None
        every = spec.train.checkpoint_every_evals
        if every and state.step > 0 and (state.evals % every == 0 or last or stop):
            save = self._checkpoint(t_begin)
        record["checkpoint_time_s"] = state.checkpoint_time_s
        # a save's, once it is written (Save.fill)
        record["checkpoint_stall_s"] = record["checkpoint_wait_s"] = record["checkpoint_write_s"] = None
        record["elapsed_s"] = time.perf_counter() - t_begin
        self.records.append(record)
        try:
            self.reporter.report(record, save)
        finally:
            if save is not None and not save.background:
                state.checkpoint_time_s += save.write_s or 0.0
                shutil.rmtree(save.directory, ignore_errors=True)
        return stop

    # -- an adaptive batch (train.adaptive_batch, metrics/adaptive.py) ----------------------------------
    def _adapt(self, interval_s: float, interval_steps: int, final: bool) -> dict:
        """At an evaluation: the interval's step time joins the run's timings, and every `every_evals`
        evaluations the batch of greatest goodput is chosen for the next interval. Returns the record's
        columns: what the interval trained with and what was decided."""
        state, a = self.state, self.adaptive
        trained = {"lr_scale": state.lr_scale, "batch_decision": None, "next_global_batch_size": None}
        if interval_steps:
            state.probes.append([self.ctx.world_size, self.loader.global_batch // self.engine.dp_size,
                                 self.engine.train.gradient_accumulation_steps,
                                 self._seconds_per_step(interval_s, interval_steps)])
        step_time = self._step_time_model()
        noise = self.engine.noise.value()
        now = adaptive.Shape(self.loader.global_batch, self.engine.train.gradient_accumulation_steps)
        trained["statistical_efficiency"] = adaptive.efficiency(noise, now.batch, self.spec.train.global_batch_size)
        trained["predicted_goodput"] = (None if step_time is None
                                        else now.batch / step_time(now) * trained["statistical_efficiency"])
        if not final and state.evals % a.every_evals == 0:
            choice = self._choose(step_time)
            trained["batch_decision"], trained["next_global_batch_size"] = choice.reason, choice.batch
        return trained

    def _max_rows(self) -> int | None:
        """The most rows a replica computes at once: the experiment's limit, else, on a GPU, what the memory
        estimate says fits in this device's memory (never fewer than the start); no limit on a CPU."""
        if self.adaptive.max_micro_batch_rows is not None or self.ctx.device.type != "cuda":
            return self.adaptive.max_micro_batch_rows
        from .estimate import rows_that_fit

        fits = rows_that_fit(self.spec, torch.cuda.get_device_properties(self.ctx.device).total_memory)
        start = self.spec.per_worker_batch // self.spec.train.gradient_accumulation_steps
        if fits is not None:
            self.log(f"adaptive batch: at most {max(fits, start)} rows per replica at once (memory estimate)")
        return None if fits is None else max(fits, start)

    #: steps after the start of a process, and after each change of batch, left out of the step time an
    #: adaptive run decides on: the first steps at a new shape allocate their buffers and warm the
    #: allocator's and the kernels' caches, and run up to a fifth slower than the steady steps (gpt2-tiny
    #: at batch 16 on 2 CPU ranks: 0.126 s a step over the first interval after 8 -> 16, 0.105 s throughout
    #: a run at 16), which would judge the new batch by its start. Counted in the wall time all the same.
    SETTLING_STEPS = 2

    def _timed_from(self, running: torch.Tensor, steps: int) -> tuple[float, int]:
        """The moment a settling step has ended (it waits for the device to finish it: reading the running
        loss) and how many of the interval's steps were taken by then."""
        running.cpu()
        return time.perf_counter(), steps

    def _seconds_per_step(self, interval_s: float, interval_steps: int) -> float:
        """The interval's seconds per step, the same figure on every rank (the slowest's), so that every
        rank decides alike."""
        step_s = interval_s / interval_steps
        if self.ctx.world_size > 1:
            t = torch.tensor([step_s], dtype=torch.float64, device=self.engine.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            step_s = float(t)
        return step_s

    def _step_time_model(self):
        """Seconds per step of a shape, fitted to this run's timings on its current worker count
        (metrics/throughput.py); None until two batch sizes have been timed."""
        world, dp = self.ctx.world_size, self.engine.dp_size
        probes = [Probe("run", w, rows, t, acc) for w, rows, acc, t in self.state.probes if w == world]
        try:
            model = fit_strategy(probes)
        except (ValueError, IndexError):
            return None
        return lambda shape: model.step_time(world, shape.batch // dp, shape.accumulation)

    def _choose(self, step_time) -> adaptive.Choice:
        state = self.state
        choice = adaptive.decide(self.shapes, self.spec.train.global_batch_size, state.global_batch_size,
                                 self.engine.noise.value(), self.adaptive.lr_scaling, step_time)
        state.choice, state.lr_scale = choice.as_dict(), choice.lr_scale
        if (choice.batch, choice.accumulation) != (state.global_batch_size, state.accumulation):
            self.log(f"step {state.step}: global batch {state.global_batch_size} -> {choice.batch}"
                     f" ({choice.accumulation} accumulation steps, lr x {choice.lr_scale:.3g}, {choice.reason})")
            self._resize(adaptive.Shape(choice.batch, choice.accumulation))
        return choice

    def _resize(self, shape: adaptive.Shape) -> None:
        state = self.state
        state.global_batch_size, state.accumulation = shape.batch, shape.accumulation
        self.engine.resize_batch(shape)
        self.loader = self.train_loader(self.engine, shape.batch)
        self.flops_per_step = flops.model_flops_per_step(self.spec.model, self.info, shape.batch)
        self.resized = True
        self.settling = self.SETTLING_STEPS

    def _resume_batch(self) -> None:
        """The batch the checkpoint's last decision chose; on another worker count (an elastic resize), the
        decision taken again for the new one, from the timings made on it (Pollux's co-adaptation)."""
        state = self.state
        if state.global_batch_size is None:  # a checkpoint of a run at a fixed batch: this file's start
            state.global_batch_size = self.spec.train.global_batch_size
            state.accumulation = self.spec.train.gradient_accumulation_steps
        shape = adaptive.Shape(state.global_batch_size, state.accumulation)
        if state.workers != self.ctx.world_size or self.shapes and shape not in self.shapes:
            state.workers = self.ctx.world_size
            self._choose(self._step_time_model())
        # the engine and loader were built at the file's starting batch
        shape = adaptive.Shape(state.global_batch_size, state.accumulation)
        if (shape.batch, shape.accumulation) != (self.loader.global_batch, self.engine.train.gradient_accumulation_steps):
            self._resize(shape)
        self.resized = False

    def _utilisation(self, interval_s: float, interval_steps: int) -> dict:
        """Model FLOPs per step, what this worker achieved of them over the interval, its peak and
        MFU (see metrics/flops.py); no utilisation for a record without steps."""
        out = {"model_flops_per_step": self.flops_per_step, "peak_tflops": self.peak_tflops,
               "peak_source": self.peak_source, "probe_tflops": self.probe_tflops,
               "achieved_tflops": None, "mfu": None, "comm_fraction": self.comm_fraction}
        if interval_steps and interval_s > 0:
            step_s, workers = interval_s / interval_steps, self.ctx.world_size
            out["achieved_tflops"] = flops.achieved_tflops(self.flops_per_step, step_s, workers)
            out["mfu"] = flops.mfu(self.flops_per_step, step_s, workers, self.peak_tflops)
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint(self, t_begin: float) -> Save:
        """Take a checkpoint of this point of training (saving.py): under `checkpoint_mode: async` a
        snapshot in host memory, written in the background; under `sync` written as the reporter
        delivers it, on this thread. Waits first for the previous one's write to end."""
        t0 = time.perf_counter()
        if self.writing is not None:
            self.writing.wait()
        waited = time.perf_counter() - t0
        background = self.spec.train.checkpoint_mode == "async"
        if self.staging is not None:  # the first async checkpoint's host memory, allocated since the first step
            self.staging.join()
            self.staging = None
        directory = Path(tempfile.mkdtemp(prefix="raytrain-par-ckpt-"))
        self.state.elapsed_s = time.perf_counter() - t_begin
        # Every rank's own pieces of the plain model's weights and optimizer states, by name (state.py):
        # `raytrain-par export` and a resume under any layout read them without the group that wrote them
        part = one_format.snapshot(self.engine, self.snapshot_buffers) if background else one_format.parts(self.engine)
        write = functools.partial(self._write, part=part, step=self.state.step, rng=self._rng_state(),
                                  loop=self._loop_state() if self.ctx.rank == 0 else None)
        save = Save(directory, self.state.step, write, background)
        save.stall_s, save.wait_s = time.perf_counter() - t0, waited
        self.state.checkpoint_time_s += save.stall_s
        if background:
            self.writing = save
        return save

    def _rng_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        engine_rng = self.engine.rng_state()
        if engine_rng is not None:
            rng["engine"] = engine_rng
        return rng

    def _loop_state(self) -> str:
        self.state.noise = self.engine.noise.state()
        return json.dumps({"state": asdict(self.state), "experiment": self.spec.to_dict(),
                           "data": self.info.to_json(), "format": 1}, indent=1)

    def _write(self, directory: Path, part: one_format.Parts, step: int, rng: dict, loop: str | None) -> None:
        """This rank's files of a checkpoint, its manifest last (on any thread: it reads only what it is given)."""
        written = one_format.write_parts(directory, part, step, self.ctx.rank)
        torch.save(rng, directory / f"rng-rank{self.ctx.rank}.pt")
        if loop is not None:
            (directory / "loop.json").write_text(loop)
        checkpoints.write_manifest(directory, self.ctx.rank, self.ctx.world_size, step, written)

    def _load(self, directory: Path) -> None:
        meta = json.loads((directory / "loop.json").read_text())
        saved = meta["state"]
        self.state = LoopState(**saved)
        if "progress" not in saved:  # written before progress was kept: a fixed batch's steps
            self.state.progress = float(self.state.step)
            self.state.rows_in_epoch = self.state.step_in_epoch * self.spec.train.global_batch_size
        if self.state.noise is not None and self.engine.measures_noise:
            self.engine.noise.load_state(self.state.noise, self.engine.device)
        one_format.load(self.engine, directory)
        rng_file = directory / f"rng-rank{self.ctx.rank}.pt"
        if not rng_file.exists():  # a worker the run did not have before: streams start equal on every rank
            rng_file = directory / "rng-rank0.pt"
        if rng_file.exists():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.ctx.device)
            if "engine" in rng:
                self.engine.load_rng_state(rng["engine"])


class LocalReporter(Reporter):
    """Reporter without Ray (torchrun, tests): rank 0 writes records; checkpoints go to <root>/checkpoint_N,
    every rank writing its own files into the same directory. Records and background writes are
    delivered in order by one thread."""

    def __init__(self, root: str | Path, rank: int, world_size: int, resume: bool = False, log=print):
        from concurrent.futures import ThreadPoolExecutor

        self.root, self.rank, self.world, self.log = Path(root), rank, world_size, log
        self.resume = resume
        self.writer = RecordWriter(self.root / "metrics.parquet") if rank == 0 else None
        self.count = len(list(self.root.glob("checkpoint_*/"))) if self.root.exists() else 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="raytrain-par-reporter")
        self.failure: BaseException | None = None

    def report(self, metrics, save):
        self._raise_failed()
        target = None
        if save is not None:
            target = self.root / f"checkpoint_{self.count:06d}"
            self.count += 1
        delivering = self.pool.submit(self._deliver, metrics, save, target)
        if save is not None and not save.background:
            delivering.result()
        if self.world > 1:
            torch.distributed.barrier()

    def _deliver(self, metrics, save, target):
        if self.failure is not None:  # after a failed write nothing more is delivered: records stay in order
            return
        try:
            if save is not None:
                try:
                    save.run(functools.partial(_copy_dir, save.directory, target))
                finally:
                    shutil.rmtree(save.directory, ignore_errors=True)
                save.fill(metrics)
            if self.writer is not None:
                self.writer.append(merge([metrics]))
                self.log(progress_line(metrics))
        except BaseException as e:
            self.failure = e
            raise

    def _raise_failed(self):
        if self.failure is not None:
            raise self.failure

    def close(self):
        self.pool.shutdown(wait=True)
        self._raise_failed()

    def candidates(self):
        return sorted(self.root.glob("checkpoint_*/"), reverse=True) if self.resume else []


def _copy_dir(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        shutil.copy2(f, target / f.name)


def steps_per_epoch(spec: ExperimentSpec, info: DatasetInfo) -> int:
    """Optimizer steps in one pass over the training rows (incomplete global batches are dropped)."""
    return info.num_train // spec.train.global_batch_size


def memory_train_loader(spec: ExperimentSpec, arrays: dict[str, torch.Tensor]):
    """Loader factory for the in-memory loader: this rank's slice of each seeded global batch."""
    def make(engine: Engine, global_batch: int | None = None) -> MemoryLoader:
        return MemoryLoader(arrays, global_batch or spec.train.global_batch_size, engine.dp_rank, engine.dp_size,
                            spec.train.seed)
    return make


def time_steps(spec: ExperimentSpec, info: DatasetInfo, ctx: DistContext, arrays: dict[str, torch.Tensor],
               warmup: int, steps: int) -> tuple[float, float]:
    """Seconds per optimizer step of `spec`'s engine over `steps` steps after `warmup` (the engine's
    start-up and first steps, which allocate and compile, excluded): the throughput probe of
    `raytrain-par plan`. Each step is timed to its loss on the host (a device that runs ahead is waited
    for) and the probe's time is the median step, the slowest worker's: a probe of a few steps on a
    machine others share reads one step the host slowed as a slower engine otherwise, and the runs it
    predicts report their median step too. Every worker starts and ends the timed window together. Also
    the cores the machine's other processes kept busy meanwhile (Ray's own, the driver's): the machine's
    busy CPU time less the workers' own, over the window (`background_cores`; meaningful where the
    workers share one machine, as on a local cluster)."""
    import psutil

    me = psutil.Process()
    engine, _ = strategies.start_engine(spec, info, ctx, warmup + steps)
    engine.measure_memory = False
    loader = MemoryLoader(arrays, spec.train.global_batch_size, engine.dp_rank, engine.dp_size, spec.train.seed)
    batches = (b for epoch in itertools.count() for b in loader.epoch(epoch))
    t0 = last = None
    times = []
    for i, batch in enumerate(itertools.islice(batches, warmup + steps)):
        if i == warmup:  # waits for the device and for every worker
            float(engine.dp_sum(torch.zeros((), device=engine.device)))
            t0, busy0, own0 = time.perf_counter(), _machine_busy_s(), sum(me.cpu_times()[:2])
            last = t0
        loss = engine.train_step(batch)
        if last is not None:
            float(loss.detach().float())
            now = time.perf_counter()
            times.append(now - last)
            last = now
    float(engine.dp_sum(loss.detach().float()))
    wall = time.perf_counter() - t0
    own = torch.tensor([sum(me.cpu_times()[:2]) - own0], dtype=torch.float64, device=engine.device)
    step = torch.tensor([statistics.median(times)], dtype=torch.float64, device=engine.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(own)  # every worker's own CPU seconds
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX)
    background = max(0.0, (_machine_busy_s() - busy0 - float(own)) / wall)
    return float(step), background


def _machine_busy_s() -> float:
    """CPU seconds this machine's cores have been busy (every process, niced ones too)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


# -- Ray Train entry point ---------------------------------------------------------------------

class RayReporter(Reporter):
    def __init__(self, log=print):
        self.log = log

    def report(self, metrics, save):
        """Through `ray.train.report`: a record without a checkpoint, or with one saved in the background,
        in Ray Train's ASYNC mode (its one upload thread writes the checkpoint and copies it to the run's
        storage, then delivers the record, in the order reported); a sync save in its SYNC mode, written
        and copied by this thread. Either way the checkpoint is written by `checkpoint_upload_fn`, so
        that Ray Train registers it only once written."""
        import ray.train

        if save is None:
            ray.train.report(metrics, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            return

        def write_and_upload(checkpoint, name):
            from .ray_private import storage_context

            persisted = save.run(lambda: storage_context().persist_current_checkpoint(checkpoint, name))
            save.fill(metrics)
            return persisted

        mode = ray.train.CheckpointUploadMode.ASYNC if save.background else ray.train.CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(save.directory)),
                         checkpoint_upload_mode=mode, checkpoint_upload_fn=write_and_upload,
                         delete_local_checkpoint_after_upload=True)

    def candidates(self):
        import ray.train

        if ray.train.get_checkpoint() is None:
            return []
        reported = ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        return [r.checkpoint for r in reversed(reported)] or [ray.train.get_checkpoint()]

    @contextmanager
    def open(self, candidate):
        with candidate.as_directory() as d:
            yield Path(d)


def quiet_ray_logs() -> None:
    """Keep Ray Data's per-dataset and Ray Train's per-report INFO lines off the console: a run
    prints one progress line per evaluation instead. (Ray Train names that logger after its file,
    outside the `ray.train` hierarchy that RunConfig's LoggingConfig filters.)"""
    import logging

    from .ray_private import DATA_PROGRESS_LOGGER, train_context_logger_name

    level = os.environ.get("RAYTRAIN_PAR_RAY_LOG_LEVEL", "WARNING")
    logging.getLogger(train_context_logger_name()).setLevel(level)
    logging.getLogger("ray.data").setLevel(level)
    # Ray Data (2.60) warns once per worker that progress bars are off: we turned them off.
    logging.getLogger(DATA_PROGRESS_LOGGER).setLevel(max(logging.ERROR, logging.getLevelName(level)))


def _read_shard(name: str, info: DatasetInfo) -> dict[str, torch.Tensor]:
    import ray.train

    from .data.shards import concat, decode

    shard = ray.train.get_dataset_shard(name)
    return concat(decode(info, b) for b in shard.iter_batches(batch_size=4096, batch_format="numpy"))


def _worker_context(config: dict) -> tuple[DatasetInfo, DistContext]:
    """What every Ray Train entry point starts with: quiet logs, threads, the data set, this worker's place."""
    import ray.train
    import ray.train.torch

    quiet_ray_logs()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    context = ray.train.get_context()
    ctx = DistContext(context.get_world_rank(), context.get_world_size(), context.get_local_rank(),
                      ray.train.torch.get_device())
    return DatasetInfo.from_json(config["data"]), ctx


def train_loop_per_worker(config: dict) -> None:
    """What each Ray Train worker runs. `config`: {"experiment": spec dict, "data": DatasetInfo dict, "trial": str}."""
    from .config import from_dict
    from .data.shards import decode

    t0 = time.perf_counter()
    spec = from_dict(config["experiment"])
    info, ctx = _worker_context(config)
    # An elastic run's worker group is as large as Ray Train could make it this time: the data-parallel
    # size, each worker's rows and the records follow the live count, not the configured range.
    spec = replace(spec, scaling=spec.scaling.at(ctx.world_size))
    val = _read_shard("val", info)
    if spec.data.effective_loader == "memory":
        train_loader = memory_train_loader(spec, _read_shard("train", info))
    else:
        def train_loader(engine: Engine, global_batch: int | None = None) -> StreamLoader:
            return StreamLoader(info.train_path, functools.partial(decode, info),
                                global_batch or spec.train.global_batch_size, engine.dp_rank, engine.dp_size,
                                spec.train.seed)

    log = print if ctx.rank == 0 else (lambda *_: None)
    trainer = Trainer(spec, info, ctx, RayReporter(log), train_loader, val, trial=config.get("trial", "run"),
                      startup_s=time.perf_counter() - t0, log=log)
    trainer.run()


def probe_loop_per_worker(config: dict) -> None:
    """Ray Train entry point of the throughput probes: `config["probes"]` maps a name to an experiment
    dict (all on this run's workers and data); reports {"step_times": {name: seconds per step}}."""
    import gc

    import ray.train

    from .config import from_dict

    info, ctx = _worker_context(config)
    arrays = _read_shard("train", info)
    times, background = {}, {}
    for name, experiment in config["probes"].items():
        times[name], background[name] = time_steps(from_dict(experiment), info, ctx, arrays, config["warmup"],
                                                   config["steps"])
        gc.collect()  # the engine of one probe is gone before the next is built
    ray.train.report({"step_times": times, "background_cores": background})
