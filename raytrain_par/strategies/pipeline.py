"""Pipeline parallel with synchronous schedules: torch.distributed.pipelining's GPipe, 1F1B,
interleaved 1F1B and zero-bubble schedules.

The model is split into stages (see stages.py: by layers, balanced by FLOPs or parameters, tied
weights untied with a gradient all-reduce); each step's rows are cut into `microbatches` that flow
through the stages; gradients are complete when the schedule flushes, and every rank then takes an
ordinary optimizer step on its own stages. The result equals training the plain model on the whole
batch. With num_workers = stages x D, each stage's gradients are averaged over its D replicas by an
explicit all-reduce on the stage's data-parallel group (a DDP-wrapped stage fails from the second
step on under torch's schedules). With D >= 2 the gradient noise scale is measured (base.py): a
replica's own gradient is whole just before that all-reduce, and its squares add over the stages,
the tied embedding counted once. Not under `data_parallel_sharding: fsdp`: there a replica's whole
gradient of the tied embedding exists nowhere (its halves are reduce-scattered apart, on two stages),
and joining them would send a whole embedding gradient each step.

Mixed precision (`train.precision: bf16`) is autocast over fp32 parameters, as ddp does it: the
weights, gradients, optimizer state and checkpoints stay fp32 (the master weights), each stage's
forward computes in bf16 (stages.Stage), the loss is computed from fp32 logits, and evaluation runs
the same stages, so in the same precision. What travels between stages keeps the dtype the layers
produce in fp32: torch's shape inference runs the stages on meta tensors, which autocast leaves
alone, so it declares fp32 buffers, and a stage's output is cast to that dtype before it is sent.
For GPT-2 that costs nothing (its residual stream is fp32 under autocast anyway: the adds promote);
a VGG stage ending in a convolution sends its bf16 output as fp32, exactly (twice the bytes of
sending bf16, and the receiving convolution rounds it back to the same bf16 values). Sending bf16
instead would round GPT-2's residual stream at every stage boundary, which autocast in one process
does not do. The whole schedule step runs inside one autocast region so that autocast's cache of
bf16 weight copies is shared by every microbatch in flight: measured on 2 stages of gpt2-tiny, GPipe
with 4 microbatches, the activation bytes per stage were 8.4 / 8.9 MB in fp32, 6.4 / 7.5 MB with
autocast entered per stage forward (a bf16 copy of the stage's weights kept per microbatch until
its backward pass) and 4.9 / 5.9 MB with one region per step. (`mem_activation_bytes` counts that
one copy: it is not model state.) Over 8 steps bf16 losses stayed within 2e-5 relative of fp32's;
against single-process ddp in bf16 they agree to 1e-6 with one microbatch, and within 1e-4 with 8
(smaller matmuls sum in another order, and bf16 roundings flip on the difference). fp16 is refused: it
needs loss scaling, agreed on by every stage before any of them steps, which these engines do not do.

Every record carries, per pipeline rank (`stage_*` lists, rank order), the parameter bytes,
the peak activation bytes autograd held, and the measured bubble: the fraction of the schedule's
time a rank was not computing (idle while waiting for its neighbours), to set against the ideal
(P - 1) / (M + P - 1) of GPipe and 1F1B.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed.pipelining as pipelining
from torch import nn

from ..metrics.memory import (SavedActivations, Sharding, StateBytes, model_state_theory,
                              optimizer_state_bytes)
from .base import Engine
from .context import DistContext
from .dtensor import local_tensor
from .optim import build_optimizer, lr_factor
from .layout import Layout, check_sharding
from .stages import Busy, Interval, Pipeline, validate_layout

SCHEDULES = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved-1f1b": pipelining.ScheduleInterleaved1F1B,
    "zero-bubble": pipelining.ScheduleInterleavedZeroBubble,
    "zbv": pipelining.ScheduleZBVZeroBubble,
}
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"]
# Schedules that hold several stages per worker (virtual stages).
MULTI = ("interleaved-1f1b", "zero-bubble", "zbv")


@dataclass
class Options:
    """`strategy:` keys for pipeline."""

    stages: int = 2  # P: pipeline ranks; num_workers = P x data-parallel replicas
    schedule: Schedule = "1f1b"
    microbatches: Optional[int] = None  # M per step and pipeline (default 4 x stages)
    virtual_stages: Optional[int] = None  # stages per worker, interleaved-1f1b / zero-bubble (default 2); zbv: 2
    split_points: Optional[list[int]] = None  # layer indices where stages 1.. begin; default: balanced
    balance: Literal["flops", "params"] = "flops"  # what the automatic split balances
    # How a stage's data-parallel replicas hold it: `none` replicates it (gradients all-reduced), `fsdp`
    # shards it over them with FSDP2 (parameters, gradients and optimizer state / D per worker)
    data_parallel_sharding: str = "none"

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or 4 * self.stages

    @property
    def stages_per_worker(self) -> int:
        return self.virtual_stages or (2 if self.schedule in MULTI else 1)

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices pipeline rank `pp_rank` holds (Layout.stages_of)."""
        return Layout(self.stages, schedule=self.schedule, virtual_stages=self.stages_per_worker).stages_of(pp_rank)

    def validate(self, spec, error) -> None:
        P, M, V = self.stages, self.num_microbatches, self.stages_per_worker
        if self.virtual_stages is not None:
            if self.schedule not in MULTI:
                error("strategy.virtual_stages", self.virtual_stages, f"schedule {self.schedule} holds one stage per "
                      "worker", "remove it, or use schedule interleaved-1f1b or zero-bubble")
            if self.virtual_stages < 1:
                error("strategy.virtual_stages", self.virtual_stages, "must be >= 1", "use e.g. 2")
            if self.schedule == "zbv" and self.virtual_stages != 2:
                error("strategy.virtual_stages", self.virtual_stages, "zbv holds exactly 2 stages per worker",
                      "remove it, or use schedule zero-bubble for other counts")
        validate_layout(spec, error, P, P * V, M, self.split_points)
        check_sharding(self.data_parallel_sharding, ("none", "fsdp"), "strategy.data_parallel_sharding", error)
        if self.data_parallel_sharding == "fsdp" and spec.train.optimizer == "lamb":
            error("train.optimizer", "lamb", "data_parallel_sharding fsdp holds slices of every tensor, and LAMB "
                  "scales each tensor's step by the norm of the whole tensor", "use adamw or sgd")
        if self.schedule in ("1f1b", "zbv") and M < P:
            error("strategy.microbatches", M, f"{self.schedule} needs at least as many microbatches as stages ({P})",
                  f"use {P} or more, or schedule gpipe")
        if self.schedule in ("interleaved-1f1b", "zero-bubble"):
            rounds = max(1, M // P)
            if M % rounds:
                error("strategy.microbatches", M, f"{self.schedule} runs microbatches in rounds of {P} stages and "
                      f"needs a multiple of the {rounds} rounds", f"use a multiple of {P}, e.g. {rounds * P}")

    def layout(self, num_workers: int) -> Layout:
        return Layout.of(num_workers, pipeline=self.stages, sharding=self.data_parallel_sharding,
                         **self.schedule_layout())

    def schedule_layout(self) -> dict:
        """The schedule's part of the layout: schedule, microbatches and stages per worker."""
        return {"schedule": self.schedule, "microbatches": self.num_microbatches,
                "virtual_stages": self.stages_per_worker}

    def bubble_theory(self) -> float | None:
        """The idle share of a step in theory, with forward and backward of every stage equally long:
        (P - 1) / (V M + P - 1) for P workers holding V stages each and M microbatches (GPipe and
        1F1B: V = 1; Narayanan et al. 2021 for the interleaved schedule). None for the zero-bubble
        schedules, whose idle time depends on how long each stage's weight gradients take."""
        if self.schedule in ("zero-bubble", "zbv"):
            return None
        P, V, M = self.stages, self.stages_per_worker, self.num_microbatches
        return (P - 1) / (V * M + P - 1)


def schedule_actions(options: Options, pp_rank: int) -> list[tuple[int, str]]:
    """(stage, computation) in the order pipeline rank `pp_rank` runs them in torch's schedule: F
    forward, B full backward, I and W the input and weight halves of a split backward. Read from the
    schedule's own order (the one torch checks and draws): torch builds it only from live stages in a
    process group, so its private order functions (checked against torch 2.13) are called here on an
    object given just the degrees they read."""
    return list(_schedule_actions(options.schedule, options.stages, options.stages_per_worker,
                                  options.num_microbatches, pp_rank))


@functools.lru_cache(maxsize=256)
def _schedule_actions(schedule: str, P: int, V: int, M: int, pp_rank: int) -> tuple[tuple[int, str], ...]:
    """`schedule_actions` by the degrees it reads, kept: a single-stage schedule's order is worked out for
    every rank at once (`_get_pipeline_order`), and an estimate asks for each rank of a deep pipeline in turn."""
    from torch.distributed.pipelining import schedules

    cls = SCHEDULES[schedule]
    if issubclass(cls, schedules.PipelineScheduleSingle):
        actions = _single_stage_order(schedule, P, V, M)[pp_rank]
    else:
        actions = _order(cls, P, V, M, pp_rank)._calculate_single_rank_operations(pp_rank)
    return tuple((a.stage_index, a.computation_type.value) for a in actions if a is not None)


@functools.lru_cache(maxsize=8)
def _single_stage_order(schedule: str, P: int, V: int, M: int) -> dict:
    return _order(SCHEDULES[schedule], P, V, M, 0)._get_pipeline_order()


def _order(cls, P: int, V: int, M: int, pp_rank: int):
    """An object of schedule class `cls` given just the degrees its order functions read."""
    rounds = max(1, M // P)
    order = cls.__new__(cls)
    order.__dict__.update(pp_group_size=P, n_local_stages=V, _n_microbatches=M, number_of_rounds=rounds,
                          microbatches_per_round=M // rounds, rank=pp_rank, num_stages=P * V, _num_stages=P * V)
    return order


def held_activations(actions: list[tuple[int, str]], micro: dict[int, float], loss: float = 0.0) -> float:
    """The most activation bytes alive at once over a rank's actions: a microbatch's activations in
    stage s (`micro[s]`) live from its forward pass to its full backward, or, split, to its weight
    half: the input half keeps the stage's graph for it. What the loss saves (`loss` bytes of the last
    stage's `micro`) lies above every weight of the stage, and goes with the input half."""
    last = max(micro)
    now = peak = 0.0
    for stage, kind in actions:
        if kind == "F":
            now += micro[stage]
        elif kind == "B":
            now -= micro[stage]
        elif kind == "I" and stage == last:
            now -= loss
        elif kind == "W":
            now -= micro[stage] - (loss if stage == last else 0.0)
        peak = max(peak, now)
    return peak


class _TimedStage(pipelining.PipelineStage):
    """torch's PipelineStage, timing its forward and backward computation (not the waits between)."""

    def __init__(self, *args, busy: Busy, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = busy

    def forward_one_chunk(self, *args, **kwargs):
        with self.busy():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.busy():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.busy():
            return super().backward_weight_one_chunk(*args, **kwargs)


class PipelineEngine(Engine):
    Options = Options
    #: transforms the whole model in place before the stages take their layers (see stages.Pipeline)
    split_layers = None

    @classmethod
    def schedule_options(cls, options) -> Options:
        """The options of the stages' schedule (an engine built on this one may hold them in its own)."""
        return options

    @classmethod
    def estimate_pipeline(cls, options):
        return cls, cls.schedule_options(options)

    @classmethod
    def estimate_rank(cls, pipe: Options, train, dp: int, pp_rank: int, params: dict[int, int],
                      micro: dict[int, float], fixed: dict[int, float],
                      loss: float = 0.0) -> tuple[StateBytes, float, float]:
        """What pipeline rank `pp_rank` holds, from its stages' parameter counts (`params`; the later
        stage's copy of a tied weight counted there), the activation bytes one microbatch saves in each
        stage (`micro`; `loss` of them the loss's, in the last stage) and those saved once per step
        whatever the microbatches (`fixed`: autocast's 16-bit weight copies, one per step as the
        schedule runs in one autocast region): model states
        (fp32 parameters, gradients and optimizer state, divided over the D replicas under fsdp), the
        activations of the microbatches the schedule keeps in flight at once, and the whole parameters
        and gradients that FSDP holds during a step (torch's stages keep a sharded stage gathered from
        its first forward pass to its last backward, and its gradients unreduced until then)."""
        local = pipe.stages_of(pp_rank)
        n = sum(params[s] for s in local)
        every = pipe.data_parallel_sharding == "fsdp" and dp > 1
        theory = model_state_theory(Sharding(every, every, every), dp, train.precision,
                                    optimizer_state_bytes(train)) * n
        activations = held_activations(schedule_actions(pipe, pp_rank), micro, loss) + sum(fixed[s] for s in local)
        return StateBytes(theory, theory), activations, (4 + 4) * n if every else 0.0

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Each replica's gradient over its rows against the reduced one: 2 or more data-parallel
        replicas, not sharded (module docstring). (With one, no smaller batch's gradient is ever whole:
        torch's schedules add each microbatch's gradient into `.grad` as its backward pass runs, the
        stages in interleaved order.)"""
        return layout.data > 1 and layout.sharding == "none"

    def stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of one microbatch from the last stage's output."""
        return self.task.loss_from(logits, labels)

    @property
    def eval_task(self):
        """What evaluation's last stage computes its sums with (`sums_from`): the task."""
        return self.task

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        super().__init__(model, task, train, options, ctx, total_steps)
        self.pipeline_options = o = self.schedule_options(options)
        self.pipe = Pipeline(model, self.placement, self.device, o.stages * o.stages_per_worker, o.stages_of,
                             o.split_points, o.balance, train.precision, self.split_layers)
        if self.measures_noise_scale(options, train, self.layout):
            self._start_noise()
        if o.data_parallel_sharding == "fsdp" and self.dp_size > 1:
            self.pipe.shard()
        self.microbatches = o.num_microbatches
        self.busy, self.bubble = Busy(self.device), Interval()
        self.activations = SavedActivations()
        # Each microbatch's loss is divided by all microbatches of the step (scale_grads=False): the
        # gradients then sum to the mean over the step's rows, also across gradient-accumulation chunks
        # (scale_grads=True would divide what earlier chunks accumulated once more).
        # (self.train's accumulation: an adaptive run changes it between steps)
        def loss_fn(logits, labels):
            with self.busy():
                return self.stage_loss(logits, labels) / (self.microbatches * self.train.gradient_accumulation_steps)

        stages = [_TimedStage(module, s, self.pipe.S, self.device, group=self.pipe.pp_group, busy=self.busy)
                  for s, module in self.pipe.modules.items()]
        schedule = SCHEDULES[o.schedule]
        if o.schedule in MULTI:
            self.schedule = schedule(stages, self.microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = schedule(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)
        self.module = nn.ModuleList(self.pipe.modules.values())
        self.optimizer = build_optimizer(self.module, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train, total_steps))

    # -- the shared step's operations (base.Engine.train_step) -------------------------------------
    # A micro-batch of the step (gradient accumulation) is one run of the schedule over its own
    # microbatches; the stages' gradients are complete, and reduced over the replicas, after the last.
    def begin_step(self) -> None:
        self.activations.step()
        self._t0 = time.perf_counter()

    def forward_backward(self, batch, parts):
        pipe, task = self.pipe, self.task
        prepared = task.prepare(batch, self.device)
        args = (prepared[task.input_key],) if pipe.has_first else ()
        target = prepared[task.label_key] if pipe.has_last else None
        losses: list | None = [] if pipe.has_last else None
        # One autocast region for the whole schedule (the stages enter their own, nested): autocast
        # caches its 16-bit copy of each weight until the outermost region ends, so every
        # microbatch in flight shares one copy instead of holding its own for its backward pass.
        with self.activations.track(map(local_tensor, self.module.parameters())), self.autocast():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        # each microbatch's loss is already divided by every microbatch of the step (see __init__)
        return torch.stack(losses).detach().sum() if losses else torch.zeros((), device=self.device)

    def finish_gradients(self, own):
        busy = self.busy.take()  # waits for the device before the step's time is read
        self.bubble.add(1.0 - busy / max(time.perf_counter() - self._t0, 1e-9))
        # The noise scale's small batch: a replica's gradient summed over its microbatches, before it is
        # averaged over the replicas (once tied copies are summed).
        self.pipe.reduce_grads(local=(lambda: self._local_sq.add_(own())) if own else None)

    def end_step(self, loss):
        return self.pipe.from_last(loss)

    def grads(self):
        return [local_tensor(p.grad) for p in self.pipe.parameters() if p.grad is not None]

    def counted_grads(self):
        """Every parameter once over the pipeline (tied copies left out)."""
        return [local_tensor(p.grad) for p in self.pipe.counted() if p.grad is not None], []

    @torch.no_grad()
    def evaluate(self, batches):
        batches = list(batches)
        passes = self._eval_passes(len(batches)) if self.pipe.sharded else None
        sums = self.dp_sum(self.pipe.eval_sums(batches, self.eval_task, passes=passes))
        return self.task.summarize(*[float(x) for x in sums])

    # -- records ----------------------------------------------------------------------------------
    def memory(self) -> dict:
        """Memory of this worker, plus per-pipeline-rank figures gathered over the pipeline (every rank
        calls this at every record)."""
        out = super().memory()
        out["mem_activation_bytes"] = activation = self.activations.take()
        bubble = self.bubble.take()
        mine = {"param": out["mem_param_bytes"], "activation": activation, "bubble": bubble,
                "layers": self.pipe.layers_of(self.pipe.pp_rank)}
        ranks = self.pipe.gather(mine)
        out["stage_layers"] = [r["layers"] for r in ranks]
        out["stage_param_bytes"] = [r["param"] for r in ranks]
        out["stage_activation_bytes"] = [r["activation"] for r in ranks]
        measured = all(r["bubble"] is not None for r in ranks)  # not before the first step
        out["stage_bubble_fraction"] = [r["bubble"] for r in ranks] if measured else None
        out["bubble_fraction"] = sum(r["bubble"] for r in ranks) / len(ranks) if measured else None
        out["bubble_theory"] = self.pipeline_options.bubble_theory()
        return out

    # -- the one checkpoint format (strategies/state.py) -------------------------------------------
    def held_tensors(self):
        return self.pipe.held_tensors()

    def held_parameters(self):
        return ((name, p, self.optimizer) for name, p in self.pipe.named_parameters())

    def aliases(self):
        """Tied names, and the untied copies of a tied parameter (on a later stage), by their originals."""
        return {**super().aliases(), **self.pipe.copy_names()}

    def full_state_dict(self):
        return self.pipe.full_state_dict()

