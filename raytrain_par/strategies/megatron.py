"""Megatron-style tensor parallel for transformer LMs, alone or combined with data parallel (T x D workers).

`tensor_parallel: T` splits a transformers causal LM over T ranks the way Megatron-LM does, by its
family's plan (models/plans.py; GPT-2 and the Llama-style families have one): each rank holds
n_head/T attention heads (its slices of q, k and v; with grouped-query attention also of the
key/value heads), 1/T of the MLP units, and vocab/T rows of the token embedding and of the LM head
(one matrix when they are tied; tensor_split.py splits it); the loss is a vocabulary-parallel
cross-entropy, so no rank holds the full logits. Per layer that costs two all-reduces of the
activations [b, s, h] forward and two backward (see tensor_parallel.py for the operators).

With num_workers = T x D, rank r sits at (dp = r // T, tp = r % T): the T ranks of a
tensor-parallel group are adjacent (within a node first, where links are fastest) and read the
same data-parallel slice; each tensor-parallel shard is wrapped in DDP over its D replicas, so
gradients are averaged only within the data-parallel group. With `data_parallel_sharding: fsdp`
the shard is instead split once more over the D replicas by FSDP2 (each transformer block a unit,
then the rest), torchtitan's 2D layout: tensor parallel inside, sharded data parallel outside.

Randomness: the default generator is seeded identically on every rank (models.build), so dropout
of replicated activations (embedding, residual) draws the same mask on all ranks of a group and
the same as a single process would; attention dropout, on each rank's own heads, draws from a
per-rank stream (seed + 2718 + tp rank, as Megatron-LM) forked out of the default one, so heads
on different ranks get independent masks and the default stream advances exactly as with T = 1.

Checkpoints are the one format (strategies/state.py): every weight and optimizer state of the plain
model whole, by its name (the tensor-parallel shards joined, the vocabulary padding cut off, under
fsdp first gathered over the replicas), and at load each rank reads only its pieces (this run's cut by
T, pieces.py); so a run resumes with another tensor_parallel, data_parallel_sharding, number of workers, or as
another strategy. Each tensor rank's attention-dropout stream rides in its rank's random state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import models
from ..metrics.memory import SavedActivations
from ..models import causal_lm
from ..models.causal_lm import SPLIT_FAMILIES
from ..models.initial import materialise
from . import tensor_parallel as tp_ops
from .layout import Layout, check_sharding
from .pipeline import Schedule
from .base import Engine
from .context import DistContext
from .dtensor import local_tensor, whole_tensor
from .optim import build_optimizer, lr_factor
from .tensor_parallel import TPGroup
from .tensor_split import TP_RNG_OFFSET, ShapesOnly, SplitState, split_lm
from .weights import one_by_one


@dataclass
class Options:
    """`strategy:` keys for megatron."""

    tensor_parallel: int  # T: ranks each layer is split over; num_workers = T x P x data-parallel replicas
    bucket_cap_mb: float = 25.0  # DDP buckets of the data-parallel gradient all-reduce
    # How the data-parallel replicas hold each tensor-parallel shard: `none` replicates it (DDP,
    # Megatron-LM's layout), `fsdp` shards it again over the replicas with FSDP2 (torchtitan's 2D:
    # parameters, gradients and optimizer state / D per worker; all-gathers and reduce-scatters).
    data_parallel_sharding: str = "none"
    # P: pipeline stages, each of them split over T ranks (Megatron-LM's 3D: tensor x pipeline x data).
    # With stages > 1 the pipeline engine's schedules run the stages (megatron_pipeline.py).
    stages: int = 1
    schedule: Schedule = "1f1b"  # as strategy pipeline's (stages > 1)
    microbatches: Optional[int] = None  # per step and pipeline (default 4 x stages)
    split_points: Optional[list[int]] = None  # layer indices where stages 1.. begin; default: balanced
    virtual_stages: Optional[int] = None  # stages per worker, interleaved-1f1b / zero-bubble (default 2)

    def pipeline_options(self):
        """The schedule of the stages, as strategy pipeline's options say it."""
        from .pipeline import Options as PipelineOptions

        return PipelineOptions(stages=self.stages, schedule=self.schedule, microbatches=self.microbatches,
                               split_points=self.split_points, data_parallel_sharding=self.data_parallel_sharding,
                               virtual_stages=self.virtual_stages)

    def validate(self, spec, error) -> None:
        t, p = self.tensor_parallel, self.stages
        if t < 1:
            error("strategy.tensor_parallel", t, "must be >= 1", "use e.g. 2")
        if p < 1:
            error("strategy.stages", p, "must be >= 1", "use 1 (no pipeline), or e.g. 2")
        check_sharding(self.data_parallel_sharding, ("none", "fsdp"), "strategy.data_parallel_sharding", error)
        if self.bucket_cap_mb <= 0:
            error("strategy.bucket_cap_mb", self.bucket_cap_mb, "must be > 0", "use e.g. 25 (PyTorch's default)")
        m = spec.model
        plan = models.tensor_parallel_plan(m)
        if plan is None:
            error("model.name", m.name, "megatron splits transformer layers (attention heads, MLP units, vocabulary) "
                  f"by a plan, and {m.name}{_model_type(m)} has none",
                  f"use a GPT-2 model ({', '.join(models.GPT2_NAMES)}) or a causal-lm config of model_type "
                  f"{', '.join(SPLIT_FAMILIES)}, or strategy ddp / zero-3 / fsdp, which train any model")
        for field_, value, what in plan.divisible:
            if value % t:
                error(field_, value, f"the {what} do not split over tensor_parallel {t}",
                      f"use a multiple of {t} (e.g. {_next_multiple(value, t)}), or a tensor_parallel dividing {value}")
        if spec.train.optimizer == "lamb" and t > 1:
            error("train.optimizer", "lamb", "LAMB scales each tensor's step by the norm of the whole tensor, and "
                  "tensor parallel holds slices of them", "use adamw or sgd with megatron, or tensor_parallel: 1")
        if self.data_parallel_sharding == "fsdp" and spec.train.optimizer == "lamb":
            error("train.optimizer", "lamb", "data_parallel_sharding fsdp holds slices of every tensor, and LAMB "
                  "scales each tensor's step by the norm of the whole tensor", "use adamw or sgd")
        if spec.train.precision == "fp16":
            error("train.precision", "fp16", "megatron computes in 16 bits by autocast and has no loss scaler",
                  "use bf16 (autocast, no scaling needed) or fp32")
        n, k = spec.scaling.num_workers, t * p
        if n % k:
            what = f"tensor_parallel {t}" if p == 1 else f"tensor_parallel x stages = {t} x {p}"
            error("scaling.num_workers", n, f"not a multiple of {what} (workers = tensor x pipeline x data parallel)",
                  f"use {_next_multiple(n, k)} workers ({_next_multiple(n, k) // k} data-parallel replicas of {k}), "
                  f"or degrees whose product divides {n}")
        if p > 1:  # the pipeline's own checks: stages against layers, microbatches against rows
            self.pipeline_options().validate(spec, error)
        elif (self.schedule, self.microbatches, self.split_points, self.virtual_stages) != ("1f1b", None, None, None):
            error("strategy.stages", p, "schedule, microbatches, split_points and virtual_stages arrange pipeline "
                  "stages",
                  "set stages: 2 or more, or remove them")

    def layout(self, num_workers: int) -> Layout:
        schedule = self.pipeline_options().schedule_layout() if self.stages > 1 else {}
        return Layout.of(num_workers, self.stages, self.tensor_parallel, self.data_parallel_sharding, **schedule)

    @property
    def engine(self) -> str | None:
        """The engine of these options (strategies.engine_class): with stages, tensor x pipeline x data
        on the pipeline engine's schedules (megatron_pipeline.py); without, MegatronEngine (None)."""
        return "raytrain_par.strategies.megatron_pipeline:MegatronPipelineEngine" if self.stages > 1 else None


def _model_type(m) -> str:
    config = getattr(m.options, "config", None)
    return f" (model_type {causal_lm.load(m.options).model_type})" if config else ""


def _next_multiple(n: int, k: int) -> int:
    return max(k, -(-n // k) * k)

def _count_ddp_allreduce(engine: "MegatronEngine", bucket):
    """DDP comm hook: PyTorch's default all-reduce, counting the bytes it sends; where the gradient
    noise scale is measured, first adding the squared norm of this replica's own gradient (split
    parameters apart from those every tensor-parallel rank holds alike)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if engine.measures_noise:
        for replicated in (False, True):
            own = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())
                   if (engine.names[p] not in engine.splits) == replicated]
            engine.add_parameter_squares([p for p, _ in own], [g for _, g in own], replicated=replicated)
    engine.dp_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(engine.dp_group, bucket)

class MegatronEngine(SplitState, Engine):
    Options = Options

    @classmethod
    def estimate_inputs(cls, model, task, options):
        split = split_lm(model, ShapesOnly(None, options.tensor_parallel, 0),
                         tp_ops.ParallelRNG(0, torch.device("cpu")))
        return (lambda batch: split.model(batch["input_ids"], batch["labels"])), list(split.model.parameters())

    @classmethod
    def model_state_bytes(cls, options, train, dp, num_params):
        """`num_params`: one rank's tensor-parallel shard; replicated over the D replicas, or sharded
        over them by FSDP (data_parallel_sharding)."""
        from ..metrics.memory import Sharding, StateBytes, model_state_theory, optimizer_state_bytes

        every = options.data_parallel_sharding == "fsdp"
        sharding = Sharding(params=every, grads=every, optim=every)
        theory = model_state_theory(sharding, dp, train.precision, optimizer_state_bytes(train)) * num_params
        return StateBytes(theory, theory)

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        super().__init__(model, task, train, options, ctx, total_steps)
        place = self.placement
        self.fsdp = options.data_parallel_sharding == "fsdp" and self.dp_size > 1
        self.tp = TPGroup(place.tp_group, self.layout.tensor, place.tp_rank)
        self.vocab_size = model.config.vocab_size
        self.rng = tp_ops.ParallelRNG(train.seed + TP_RNG_OFFSET + self.tp.rank, self.device)
        self.plain_keys = list(model.state_dict())  # names (and order) of the plain model's state dict
        split = split_lm(model, self.tp, self.rng)
        self.model, self.splits, self.vocab_names, self.tied_head = split.model, split.cuts, split.vocab, split.tied_head
        materialise(self.model, self.device)  # this rank's cut only, for a model built on the meta device
        self.dp_bytes = 0
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            from .fsdp import shard_units

            mesh = place.mesh_of("dp")
            for unit in shard_units(self.model):
                fully_shard(unit, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.module = self.model
        elif self.dp_size > 1:
            self.module = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self.dp_group, bucket_cap_mb=options.bucket_cap_mb, gradient_as_bucket_view=True)
            if self.measures_noise_scale(options, train, self.layout):
                self._start_noise(self.model.parameters())
            self.module.register_comm_hook(self, _count_ddp_allreduce)
        else:
            self.module = self.model
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train, total_steps))
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.activation_bytes: int | None = None
        self.step_comm = {"comm_tp_allreduce_bytes_per_step": 0,
                          "comm_dp_allreduce_bytes_per_step": None if self.fsdp else 0}

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Each data-parallel replica's gradient over its whole local batch against the reduced one: 2 or
        more replicas held by DDP (data_parallel_sharding none), or, with stages, 2 or more replicas of
        each stage (megatron_pipeline.py, as the pipeline engine measures it)."""
        return options.data_parallel_sharding == "none" and layout.data > 1

    # -- the shared step's operations (base.Engine.train_step) -------------------------------------
    def begin_step(self) -> None:
        self.tp.bytes_reduced, self.dp_bytes = 0, 0

    def end_step(self, loss):
        self.step_comm = {"comm_tp_allreduce_bytes_per_step": self.tp.bytes_reduced,
                          "comm_dp_allreduce_bytes_per_step": None if self.fsdp else self.dp_bytes}
        return loss

    def no_sync(self, hold):
        if self.fsdp:  # reduce-scatter on the last micro-batch only; the others accumulate
            self.module.set_requires_gradient_sync(not hold)
        elif self.dp_size > 1 and hold:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def forward_backward(self, batch, parts):
        # Activations: what autograd keeps for backward in one micro-batch's forward (measured once;
        # under fsdp it includes the gathered weights the backward pass needs).
        saved = SavedActivations() if self.activation_bytes is None else None
        with saved.track(map(local_tensor, self.model.parameters())) if saved else contextlib.nullcontext():
            prepared = self.task.prepare(batch, self.device)
            with self.autocast():
                loss = self.module(prepared["input_ids"], prepared["labels"]) / parts
        if saved is not None:
            self.activation_bytes = saved.peak
        loss.backward()
        return loss.detach()

    def counted_grads(self):
        """Split parameters' gradients (this rank's slices), and those every tensor-parallel rank holds
        alike (layer norms, position embeddings, row-parallel biases)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return ([local_tensor(p.grad) for p in params if self.names[p] in self.splits],
                [local_tensor(p.grad) for p in params if self.names[p] not in self.splits])

    def reduce_over_tensor(self, t):
        return self.tp.all_reduce(t)  # counted with the step's tensor-parallel bytes

    @torch.no_grad()
    def eval_module(self):
        return self.model

    def eval_sums(self, module, batch):
        prepared = self.task.prepare(batch, self.device)
        return module(prepared["input_ids"], prepared["labels"], sums=True)

    def memory(self) -> dict[str, int | None]:
        # Every key from the first record on (None until measured): records.parquet takes its columns
        # from the first record.
        return {**super().memory(), "mem_activation_bytes": self.activation_bytes, **self.step_comm}

    def plain_weights(self, everywhere=False):
        """The plain model's tensors (transformers' names, a tied LM head by the embedding's), one at a
        time: under fsdp gathered over the replicas, then the tensor-parallel shards joined (collectives:
        every rank goes through them)."""
        shard = dict(self.held_tensors())
        yield from one_by_one({k: shard[k] for k in self.plain_keys},
                              lambda name, t: self.whole_of(name, whole_tensor(t)), keep=everywhere or self.ctx.rank == 0)

    # -- the one checkpoint format (strategies/state.py): each rank's cut by name ----------------------
    def held_tensors(self):
        """The split model's tensors by the plain model's names, a tied LM head also under its own."""
        shard = self.model.state_dict(keep_vars=True)
        if self.tied_head:
            shard[self.tied_head] = shard[next(iter(self.vocab_names))]
        return shard.items()


