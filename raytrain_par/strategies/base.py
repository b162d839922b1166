"""The Engine interface every strategy implements, and what strategies share.

An engine takes a plain model (identical on every rank) and owns everything that differs between
ways of parallelising: how the model is wrapped or split, the optimizer and its state, how
gradients are reduced, what a checkpoint of this rank holds, and which slice of each global batch
this rank reads. The worker loop only calls `train_step`, `evaluate`, `memory`, `save` and `load`.

Nothing here imports Ray: an engine runs the same under Ray Train, torchrun, or a test's
torch.multiprocessing group, given an initialised default process group (or none, for one process).
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..metrics import adaptive
from ..metrics.goodput import NoiseScale
from ..metrics.memory import (Sharding, StateBytes, allocated_bytes, held_bytes, model_state_census,
                              model_state_theory, optimizer_state_bytes, peak_bytes, settle_collector, storage_bytes)
from .. import models
from ..models import checkpoint_activations, parameter_count
from .context import DTYPES, DistContext
from .dtensor import local_tensor
from .layout import Layout, Placement, place
from .pieces import Piece, Source, dtensor_piece
from .state import read_states
from .weights import as_state_dict, tied


def padded(batches: list, passes: int) -> Iterator[tuple[dict, bool]]:
    """(batch, counted) for `passes` forward passes: `batches`, then its last one again, not counted.
    A sharded engine's forward pass gathers parameters from every data-parallel rank, so each rank
    makes as many as the one with the most validation batches (`Engine._eval_passes`)."""
    for i in range(passes):
        yield batches[min(i, len(batches) - 1)], i < len(batches)


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    if parts == 1:
        return [batch]
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


class Engine(ABC):
    """One way of parallelising training. Subclasses set up `self.module` (what forward runs),
    `self.optimizer`, `self.scheduler`, and override what differs."""

    #: options dataclass of the strategy (the keys allowed under `strategy:` besides `name`)
    Options: type
    #: which model states the strategy divides among its data-parallel ranks, for the theory beside
    #: the measured bytes; None (no theory) unless the engine declares it
    sharding: Sharding | None = None
    #: whether the next steps measure model states (see `note_memory`); the training loop switches
    #: it on for a few chosen steps, tests and benchmarks that step an engine by hand keep it on
    measure_memory: bool = True
    #: whether a step can run under torch's profiler (the loop samples `comm_fraction` that way). Not
    #: for an engine whose collectives outlive the step that posted them: the profiler attaches to
    #: each communication work it sees, and a work finished after the profiler has closed touches
    #: freed memory (seen as segfaults and corrupted tensors with gloo's sends)
    profiles_steps: bool = True

    def __init__(self, model: nn.Module, task, train, options, ctx: DistContext, total_steps: int):
        self.task, self.train, self.options, self.ctx = task, train, options, ctx
        self.total_steps = total_steps
        self.device = ctx.device
        # The layout and this rank's groups, first: their communication buffers are not model state.
        self.layout: Layout = self.layout_for(options, ctx.world_size)
        self.placement: Placement = place(self.layout, ctx.rank, ctx.world_size, ctx.device.type)
        if self.device.type == "cuda" and train.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"train.precision = 'bf16': {torch.cuda.get_device_name(self.device)} has no bf16 "
                             "support (it needs compute capability 8.0 or newer); use fp16 or fp32")
        self.num_params = parameter_count(model)
        # Engines that see a worker's own gradient before it is reduced feed this (metrics/goodput.py).
        self.noise = NoiseScale()
        # Here, on the plain model, before any engine wraps, shards or splits it: every strategy
        # recomputes the same modules (train.activation_checkpointing; models/checkpointing.py).
        checkpoint_activations(model, train.activation_checkpointing)
        self._peak_state: dict[str, int] = {}
        # What the allocator held before this engine existed, not counting the model it was handed
        # (whose storages the engine takes over, moves or replaces): model states held later are
        # measured against it. The first optimizer a process builds imports torch._dynamo (tens of
        # MB of modules, not model state): import it first (by importlib: an `import torch._dynamo`
        # here would make `torch` a local name of this method, unbound in the lines above it).
        importlib.import_module("torch._dynamo")
        # Garbage of what ran before (an earlier engine's cycles) freed, and the rest frozen, so that the
        # counts below, each after a full collection, cost a millisecond (metrics/memory.py).
        settle_collector()
        in_use = allocated_bytes(self.device)
        on_device = [t for t in [*model.parameters(), *model.buffers()] if t.device.type == self.device.type]
        self._baseline = None if in_use is None else in_use - storage_bytes(on_device)

    @classmethod
    def layout_for(cls, options, workers: int) -> Layout:
        """The layout this strategy's name and options stand for on `workers` workers (layout.py)."""
        return options.layout(workers)

    # -- data-parallel layout: which slice of each global batch this rank reads (layout.py) ----------
    @property
    def dp_rank(self) -> int:
        return self.placement.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.data

    @property
    def dp_group(self):
        return self.placement.dp_group

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a metric tensor over the data-parallel ranks (every rank gets the result)."""
        if self.dp_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t, group=self.dp_group)
        return t

    # -- training: one step, written once (Accelerate's `accumulate` for every engine) ---------------
    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One optimizer step on this rank's part of a global batch (stored rows, on the CPU); returns
        this rank's mean loss, detached.

        The rows are cut into `train.gradient_accumulation_steps` micro-batches; each one's forward
        and backward pass is the engine's (`forward_backward`), with the gradient's reduction held
        back until the last (`no_sync`). Then, once the gradients are complete (`finish_gradients`),
        the squares of the gradient's parts this rank holds (`grad_squares`) give the gradient noise
        scale's sample and the global norm that clipping uses, summed over the layout's groups
        (`global_grad_norm`), and the optimizer steps with the model states measured around it. An
        engine supplies those few operations; only an engine whose library owns the whole step
        (DeepSpeed) or that has no synchronous step (PipeDream) overrides this."""
        self.begin_step()
        micro = split_batch(batch, self.train.gradient_accumulation_steps)
        total = torch.zeros((), device=self.device)
        for i, part in enumerate(micro):
            with self.no_sync(i < len(micro) - 1):
                total += self.forward_backward(part, len(micro))
        own = self.grad_squares if self.measures_noise else None
        self.finish_gradients(own)
        if self.measures_noise or self.train.grad_clip:
            squares = self.grad_squares() if self.measures_noise or not self.holds_whole_gradient else None
            if self.measures_noise:  # before clipping: the gradients as the rows gave them
                copies = 1 if self.layout.sharding == "fsdp" else self.dp_size
                self.note_noise(self.task.samples_of(batch), squares, copies=copies)
            if self.train.grad_clip:
                self.clip_grads(self.global_grad_norm(squares), self.train.grad_clip)
        self.optimizer_step(self.step_optimizer)
        return self.end_step(total)

    # -- the global batch of an adaptive run (metrics/adaptive.py) -----------------------------------
    @classmethod
    def batch_layout(cls, train, layout: Layout, max_rows: int | None = None) -> adaptive.Layout:
        """Which global batches this engine can train with under `layout`: any that splits over the
        data-parallel replicas, its rows per replica in accumulation steps of at most `max_rows`; a
        pipeline keeps the rows of one accumulation step its schedule was built for (the stages' buffers
        have that shape) and changes how many it accumulates."""
        if layout.pipeline > 1:
            rows = train.global_batch_size // layout.data // train.gradient_accumulation_steps
            return adaptive.Layout(layout.data, fixed_rows=rows)
        return adaptive.Layout(layout.data, max_rows=max_rows)

    def resize_batch(self, shape: adaptive.Shape) -> None:
        """Train the following steps with `shape.batch` rows a step, in `shape.accumulation` steps each."""
        self.train = replace(self.train, global_batch_size=shape.batch, gradient_accumulation_steps=shape.accumulation)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next step (an adaptive run sets it before every step; the engine's
        own schedule, which steps after it, is overridden)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def begin_step(self) -> None:
        """Before a step's first forward pass (an engine's per-step counters)."""

    def end_step(self, loss: torch.Tensor) -> torch.Tensor:
        """After the optimizer step: this rank's mean loss of the step (the sum of its micro-batches')."""
        return loss

    def no_sync(self, hold: bool):
        """The context of one micro-batch's forward and backward pass: with `hold`, gradients are kept
        local (accumulated, not yet reduced over the data-parallel replicas)."""
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict[str, torch.Tensor], parts: int) -> torch.Tensor:
        """One micro-batch's forward and backward pass, its loss divided by the `parts` micro-batches of
        the step (so that the gradients sum to the step's mean); returns that loss, detached."""
        with self.autocast():
            loss = self.task.loss(self.module, self.prepare(batch)) / parts
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_gradients(self, own: Callable[[], torch.Tensor] | None) -> None:
        """After the last backward pass, before the norm: what completes the gradients (the reductions
        an engine makes itself, a loss scale taken off). `own`, where the noise scale is measured and
        the engine reduces here, gives the squares of this replica's own gradient (`grad_squares`'s
        parts) for `_local_sq` while it is still unreduced."""

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank holds (local slices of sharded ones), which clipping scales."""
        return [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]

    def counted_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients the norm counts, as (those this rank alone holds in its tensor-parallel group,
        those every rank of it holds alike); each parameter of the model once."""
        return self.grads(), []

    def grad_squares(self) -> torch.Tensor:
        """[squared norm of `counted_grads`' own, of its replicated] on this rank."""
        zero = torch.zeros((), device=self.device)
        return torch.stack([torch.nn.utils.get_total_norm(g).pow(2).to(zero) if g else zero
                            for g in self.counted_grads()])

    def reduce_over_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's tensor-parallel group."""
        if self.layout.tensor > 1:
            dist.all_reduce(t, group=self.placement.tp_group)
        return t

    def global_grad_norm(self, squares: torch.Tensor) -> torch.Tensor:
        """The norm of the whole model's gradient, as clip_grad_norm_ on the plain model takes it, from
        this rank's `grad_squares` and the layout: split parts summed over the tensor group, replicated
        ones once, slices summed over the data-parallel replicas where they hold slices (fsdp), stages
        over the pipeline. Where this rank holds the whole gradient (data parallel, replicated), it is
        clip_grad_norm_'s own norm of it, to the bit."""
        layout = self.layout
        if self.holds_whole_gradient:
            own, replicated = self.counted_grads()
            return torch.nn.utils.get_total_norm(own + replicated)
        total = self.reduce_over_tensor(squares[:1].clone()) + squares[1:]
        if layout.sharding == "fsdp" and layout.data > 1:  # each replica holds a slice of every gradient
            dist.all_reduce(total, group=self.dp_group)
        if layout.pipeline > 1:
            dist.all_reduce(total, group=self.placement.pp_group)
        return total.sqrt().reshape(())

    @property
    def holds_whole_gradient(self) -> bool:
        """Whether this rank's gradients are the whole model's, reduced (no tensor or pipeline split,
        no slices over the replicas)."""
        layout = self.layout
        return layout.tensor == 1 and layout.pipeline == 1 and not (layout.sharding == "fsdp" and layout.data > 1)

    def clip_grads(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale every gradient by clip_grads_with_norm_'s coefficient (on local slices, so that sharded
        and split gradients take the plain model's coefficient)."""
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = self.grads()
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))

    def step_optimizer(self) -> None:
        self.optimizer.step()

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored rows -> model inputs on this rank's device."""
        return self.task.prepare(batch, self.device)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def eval_module(self) -> nn.Module:
        return self.module

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Validation metrics over the whole split: each rank evaluates its rows, sums are reduced."""
        module = self.eval_module()
        module.eval()
        batches = list(batches)
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        for batch, counted in padded(batches, self._eval_passes(len(batches))):
            with self.autocast():
                part = self.eval_sums(module, batch).double()
            if counted:
                sums += part
        module.train()
        sums = self.dp_sum(sums)
        return self.task.summarize(*[float(x) for x in sums])

    def eval_sums(self, module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[summed loss, predictions, correct predictions] of one batch of stored rows."""
        return self.task.eval_sums(module, self.prepare(batch))

    def _eval_passes(self, own: int) -> int:
        """Forward passes this rank makes in an evaluation: as many as the data-parallel rank with the
        most validation batches, since a sharded engine's forward pass (FSDP, ZeRO-3) gathers
        parameters from every rank, and one rank with a batch fewer (the split's rows do not divide by
        the data-parallel size) would leave the others waiting for it."""
        if self.dp_size == 1:
            return own
        most = torch.tensor([own], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
        if own == 0 and int(most) > 0:
            raise ValueError(f"data-parallel rank {self.dp_rank} has no validation rows: the split has fewer rows "
                             f"than the {self.dp_size} data-parallel ranks (raise data.max_val_samples)")
        return int(most)

    def autocast(self):
        """Mixed precision by autocast (`train.precision` bf16 / fp16), for engines that compute in
        16 bits from fp32 parameters; a no-op in fp32."""
        if self.train.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.train.precision])

    # -- memory --------------------------------------------------------------------------------
    def census(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state behind live tensors this engine can
        name (engines holding flat buffers or partitions of their own override this)."""
        return model_state_census(self.module.parameters(), self.optimizer)

    def model_state(self) -> dict[str, int]:
        """Model states this rank holds right now: the allocator's count (see metrics/memory.py),
        the census of live tensors, and the theory for this strategy and worker count."""
        out = self.census()
        census = out["mem_param_bytes"] + out["mem_grad_bytes"] + out["mem_optim_bytes"]
        in_use = held_bytes(self.device)
        held = in_use - self._baseline if in_use is not None and self._baseline is not None else census
        out["mem_model_state_bytes"] = held
        out["mem_model_state_census_bytes"] = census
        theory = self.model_state_theory_bytes()
        if theory is not None:
            out["mem_model_state_theory_bytes"] = theory
        return out

    def model_state_theory_bytes(self) -> int | None:
        est = self.model_state_bytes(self.options, self.train, self.dp_size, self.num_params)
        return None if est is None else int(est.theory)

    @classmethod
    def estimate_inputs(cls, model: nn.Module, task, options) -> tuple[Callable, list[nn.Parameter]]:
        """What `raytrain-par estimate` measures on a model with shapes only (meta or fake tensors):
        the loss of a prepared batch as one worker computes it, and the parameters one worker holds
        before any data-parallel sharding. An engine that splits the model itself says how."""
        return (lambda batch: task.loss(model, batch)), list(model.parameters())

    @classmethod
    def estimate_pipeline(cls, options) -> tuple[type["Engine"], object] | None:
        """For an engine that runs the model as pipeline stages: the engine class that does, and the
        options of its pipeline (`stages`, `stages_of`, `num_microbatches`, `split_points`, `balance`).
        `estimate` splits the model by them, counts each stage's parameters and the activations one
        microbatch saves in it, and asks that class's `estimate_rank` what one pipeline rank holds.
        None for engines that do not split the model into stages."""
        return None

    @classmethod
    def estimate_stage_inputs(cls, model: nn.Module, task, options) -> tuple[list[nn.Module], Callable]:
        """A pipeline engine's layers as its stages hold them (shapes only; an engine that splits each
        layer further says how) and the last stage's loss of (output, labels)."""
        return models.pipeline_layers(model), task.loss_from

    @classmethod
    def model_state_bytes(cls, options, train, dp: int, num_params: int) -> StateBytes | None:
        """Model-state bytes per worker before anything runs: the textbook figure for this sharding,
        and what this implementation is expected to hold (engines add their own buffers and copies).
        None where the engine cannot say."""
        if cls.sharding is None:
            return None
        theory = model_state_theory(cls.sharding, dp, train.precision, optimizer_state_bytes(train)) * num_params
        return StateBytes(theory, theory)

    def optimizer_step(self, step: Callable[[], None] | None = None) -> None:
        """The optimizer step (`step`, default `self.optimizer.step`) with the model states measured
        right before and right after it, then the gradients freed and the schedule (if the engine
        has one) advanced."""
        self.note_memory()
        (step or self.optimizer.step)()
        self.note_memory()
        self.optimizer.zero_grad(set_to_none=True)
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.step()

    def load_scheduler(self, state: dict) -> None:
        """The learning-rate schedule's place from a checkpoint, and the rate of the next step from this
        run's schedule: the optimizer state restored beside it holds the rate the checkpoint's own
        schedule set, which a resume that changes the schedule (max_steps, warm-up, shape) would
        otherwise train its first step with."""
        s = self.scheduler
        # the place only: the rates come from the experiment (train.lr cannot change on resume), the
        # same whichever engine wrote the checkpoint
        s.last_epoch, s._step_count = state["last_epoch"], state.get("_step_count", state["last_epoch"] + 1)
        s._last_lr = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, s._last_lr):
            group["lr"] = lr

    def note_memory(self) -> None:
        """Called right before and right after the optimizer step (before gradients are freed):
        model states peak at one of the two moments, once the optimizer has its state. Does nothing
        while `measure_memory` is off: the training loop measures a few chosen steps only, since a
        census of every tensor and the allocator's statistics on every step would tax training."""
        if not self.measure_memory:
            return
        now = self.model_state()
        # the allocator's count less its count at start can be negative (memory freed since that had
        # been allocated before the engine): the first snapshot is kept whatever its sign
        if not self._peak_state or now["mem_model_state_bytes"] >= self._peak_state["mem_model_state_bytes"]:
            self._peak_state = now

    # -- the gradient noise scale (metrics/goodput.py) -------------------------------------------
    # A sample per optimizer step compares the gradient of a small batch -- one data-parallel
    # replica's own rows, before they are reduced -- with the reduced gradient of the global batch.
    # Engines collect the small batches' squared norms into `_local_sq` where the local gradient is
    # whole (a communication hook, or tensor hooks on the parameters), as [squares this rank alone
    # holds in its tensor-parallel group, squares every rank of that group holds alike], and call
    # `note_noise` after the backward passes of a step: one all-reduce of four scalars.

    #: whether this engine, as built, measures the noise scale (see `measures_noise_scale`)
    measures_noise: bool = False

    @classmethod
    def measures_noise_scale(cls, options, train, layout: Layout) -> bool:
        """Whether training with these options measures the gradient noise scale (the `plan`
        reference run needs it). It takes a batch smaller than the global one whose gradient the
        engine sees before it is reduced: another data-parallel replica's, or a micro-batch's."""
        return False

    def _start_noise(self, slots: Iterable[nn.Parameter] | None = None) -> None:
        """`slots`: every parameter whose squares `add_parameter_squares` will add, in a fixed order."""
        self.measures_noise = True
        self._local_sq = torch.zeros(2, device=self.device)
        if slots is not None:
            self._slot = {p: i for i, p in enumerate(slots)}
            self._param_sq = torch.zeros(2, len(self._slot), device=self.device)
            self._slot_index: dict[tuple[int, ...], torch.Tensor] = {}  # per group of parameters, made once

    def add_parameter_squares(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                              replicated: bool = False) -> None:
        """As `add_local_squares`, each parameter's squares kept apart and summed in the order of `slots`
        at the step's end: so the sum does not depend on how the gradients were grouped when they came.
        (DDP builds its buckets again after a process's first step, in the order gradients arrived; sums
        of bucket-sized parts would differ in their last bits between a run and its resumed copy, and an
        adaptive batch's learning rate follows the noise scale.)"""
        if params:
            squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]) ** 2
            slots = tuple(self._slot[p] for p in params)
            index = self._slot_index.get(slots)
            if index is None:  # (not copied to the device again every step)
                index = self._slot_index[slots] = torch.tensor(slots, device=self.device)
            self._param_sq[int(replicated)].index_add_(0, index, squares.to(self._param_sq))

    def add_local_squares(self, grads: list[torch.Tensor], replicated: bool = False) -> None:
        """Add the squared norm of gradients not yet reduced (`replicated`: the same on every rank of
        the tensor-parallel group, counted once)."""
        if grads:
            self._local_sq[int(replicated)] += torch.nn.utils.get_total_norm(grads).to(self._local_sq) ** 2

    def watch_local_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Tensor hooks: autograd calls them with each backward pass's gradient of a parameter,
        before it is accumulated into `.grad` and before any hook that reduces it. (For an engine
        that reduces gradients in hooks of its own, where the local gradient is never whole after
        the backward pass.)"""
        for p in params:
            if p.requires_grad:
                p.register_hook(self._local_square_hook)

    def _local_square_hook(self, grad: torch.Tensor) -> None:
        self._local_sq[0] += torch.linalg.vector_norm(grad, dtype=torch.float32).to(self._local_sq) ** 2

    def note_noise(self, local_rows: int, reduced: torch.Tensor, copies: int | None = None,
                   small_batches: int = 1) -> None:
        """One sample of the noise scale, after the backward passes of a step and before clipping.

        `local_rows`: the rows this data-parallel replica trained on in the step; `small_batches`: how
        many gradients of them went into `_local_sq` (the micro-batches, each of the loss divided by
        their number, where an engine sees them one by one; 1 where it sees their sum).
        `reduced`: the squared norm of the reduced gradient, or, with `copies`, this rank's part of
        it as [own, replicated over the tensor-parallel group] squares, each held by `copies`
        data-parallel ranks (the replicas where it is replicated, 1 where it is sharded)."""
        if getattr(self, "_param_sq", None) is not None:
            self._local_sq += self._param_sq.sum(1)
            self._param_sq.zero_()
        if copies is None:
            parts = torch.cat([self._local_sq, torch.zeros_like(self._local_sq)])
        else:
            parts = torch.cat([self._local_sq, reduced.reshape(2).to(self._local_sq)])
        dist.all_reduce(parts)  # every rank: the replicas, and their tensor-parallel ranks
        t, d, n = self.layout.tensor, self.dp_size, small_batches
        # mean over the d x n small batches; each gradient of the loss / n: squares times n^2
        small = n * (parts[0] + parts[1] / t) / d
        big = reduced.to(small) if copies is None else (parts[2] + parts[3] / t) / copies
        self.noise.update(local_rows // n, small, local_rows * d, big)
        self._local_sq.zero_()

    def statistics(self) -> dict[str, float | None]:
        """Training statistics for the record: the gradient noise scale, where this engine measures
        it (None where it does not, or cannot: one worker sees no second batch size)."""
        return {"grad_noise_scale": self.noise.value()}

    def memory(self) -> dict[str, int]:
        out = dict(self._peak_state or self.model_state())
        out["mem_peak_bytes"] = peak_bytes(self.device)
        return out

    # -- checkpoints: the one format (strategies/state.py) ----------------------------------------
    def plain_weights(self, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor | str | None]]:
        """The plain model's weights by name, one tensor at a time: (name, whole tensor) on rank 0 (on every
        rank with `everywhere`; None elsewhere), or (name, the name of an earlier entry it is tied to).
        Every rank iterates it (the gathers are collectives). An engine supplies this or
        `full_state_dict`: by default, from it."""
        yield from tied(self.full_state_dict())

    # -- pieces: what this rank holds of each of the plain model's tensors (strategies/pieces.py) -------
    def held_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor of the plain model's state dict this rank holds (its parameters and buffers, whole,
        a DTensor's shard or a split layer's cut), by the plain model's name; a tensor the model ties under
        two names under each of them (`aliases`). By default the plain model's (`self.model`, sharded or
        wrapped in place)."""
        return self.model.state_dict(keep_vars=True).items()

    def held_parameters(self) -> Iterable[tuple[str, nn.Parameter, torch.optim.Optimizer]]:
        """Every parameter this rank's optimizers step, by the plain model's name, with the optimizer."""
        return ((name, p, self.optimizer) for name, p in self.model.named_parameters())

    def aliases(self) -> dict[str, str]:
        """The names of `held_tensors` whose tensor is another name's (a tied LM head; a pipeline's untied
        copy of one, which resumes from its original): name -> that name. A checkpoint keeps the tensor
        once, under its original's name."""
        first, out = {}, {}
        for name, t in self.held_tensors():
            if id(t) in first:
                out[name] = first[id(t)]
            else:
                first[id(t)] = name
        return out

    def saved_pieces(self) -> Iterator[tuple[str, Piece, torch.Tensor | object]]:
        """What this rank holds that a checkpoint keeps (strategies/state.py): (name, piece, this rank's
        tensor) of each of the plain model's tensors, then of each parameter's optimizer states, named
        `<parameter>/<state>` (a 0-dim one, the step, whole; one that is a number, with no piece). A tied
        name is left out: its original holds the tensor."""
        aliases = self.aliases()
        for name, t in self.held_tensors():
            if name not in aliases:
                yield name, self.piece_of(name, t), local_tensor(t)
        for name, p, optimizer in self.held_parameters():
            if name in aliases:
                continue
            piece = self.piece_of(name, p)
            for key, v in (optimizer.state.get(p) or {}).items():
                if not isinstance(v, torch.Tensor):
                    yield f"{name}/{key}", None, v
                else:
                    yield f"{name}/{key}", piece if v.dim() else Piece.whole(()), local_tensor(v)

    def piece_of(self, name: str, t: torch.Tensor) -> Piece:
        """Which part of the plain model's tensor `name` this rank's `t` holds: the whole, or a DTensor's
        shard (an engine that cuts layers itself adds its cut)."""
        return dtensor_piece(t)

    def load_pieces(self, source: Source) -> None:
        """Resume from a checkpoint (written by any engine, on any number of workers): each tensor this rank
        holds filled from the stored pieces that overlap its piece, then each parameter's optimizer states
        made and filled alike (strategies/state.py `read_states`). No rank reads more than its own pieces."""
        aliases = self.aliases()
        with torch.no_grad():
            for name, t in self.held_tensors():
                name = aliases.get(name, name)
                source.read_into(name, self.piece_of(name, t), local_tensor(t))
        for name, p, optimizer in self.held_parameters():
            name = aliases.get(name, name)
            states = read_states(source, name, self.piece_of(name, p), p)
            if states:
                optimizer.state[p] = states

    def format_extras(self) -> dict:
        """What index.json holds beside the tensors: the optimizer's class and hyper-parameters, the
        schedule's place and the loss scaler's state."""
        scaler = getattr(self, "scaler", None)
        return {**optimizer_description(self.optimizer), "scheduler": self.scheduler.state_dict(),
                **({"scaler": scaler.state_dict()} if scaler is not None else {})}

    def load_format_extras(self, index: dict) -> None:
        self.load_scheduler(index["scheduler"])
        scaler = getattr(self, "scaler", None)
        if scaler is not None and "scaler" in index:
            scaler.load_state_dict(index["scaler"])

    def rng_state(self) -> dict | None:
        """Random state of the engine's own beside torch's (a tensor-parallel rank's dropout stream),
        kept in this rank's random-state file of a checkpoint."""
        return None

    def load_rng_state(self, state: dict) -> None:
        """`rng_state` of the rank of this number that wrote the checkpoint (or of rank 0, where none did)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict (gathered where it is sharded), on every rank."""
        return as_state_dict(self.plain_weights(everywhere=True))


def optimizer_description(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's class and each parameter group's hyper-parameters (numbers, flags), for index.json."""
    plain = (int, float, bool, str, type(None))

    def kept(v):
        return isinstance(v, plain) or isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v)

    return {"optimizer": type(optimizer).__name__,
            "hyperparameters": [{k: v for k, v in g.items() if k != "params" and kept(v)}
                                for g in optimizer.param_groups]}
