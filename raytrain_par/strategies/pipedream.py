"""PipeDream: asynchronous pipeline parallel, 1F1B without flushes, with weight stashing
(Narayanan et al., SOSP 2019), and PipeDream-2BW (double-buffered weights, Narayanan et al., ICML 2021).

No maintained package implements it, so it is written here on torch's point-to-point operations
(`isend`/`irecv` in batches, as torch's own 1F1B schedule does, so that neighbours never wait on
each other's sends).

Each step feeds one new minibatch (this replica's rows, as `microbatches` pieces) into a pipeline
that never drains: stage p forwards microbatch j and then runs the backward pass of microbatch
j - (P - 1 - p), which its successor finished earlier. Gradients of a minibatch's microbatches
accumulate, and the stage takes its optimizer step as soon as the minibatch's last backward pass is
done, so every stage updates once per step, like the synchronous engines, on the same global batch.
What differs is the weights the gradients were computed with:

- weight stashing (default): a microbatch's forward pass uses the stage's newest weights, and its
  backward pass the same version (stashed), while newer versions go on being made. With one
  microbatch per step the update applied at step t on stage p was computed with the weights of
  P - 1 - p updates earlier: its staleness. Stage p keeps up to P - p versions.
- `weight_versions: 2` (PipeDream-2BW): every microbatch of a minibatch uses the version that was
  newest when its first microbatch started; with at least P - 1 microbatches per step only two
  versions are ever alive, and the staleness is one update on every stage but the last.

A version is not copied until it must be: when a stage updates while microbatches that used the
current weights are still in flight, those weights move aside (they are the stash) and the optimizer
steps a copy. Records carry the measured staleness per stage next to this theory, and the bytes of
stashed versions (`mem_stash_bytes`).

Tied weights (GPT-2's embedding and LM head) are untied as for the synchronous pipeline, but their
gradient sum cannot be one all-reduce: the last stage finishes a minibatch's backward passes before
the first does. The last stage sends its half to the first, which adds its own when it updates and
sends the sum back; the last stage applies it just before it forwards the first microbatch that the
first stage forwarded with the updated weights. So every microbatch meets the same version of both
copies, the tied pair behaves as a parameter of the first stage (its staleness, its stash), and the
copies stay equal. The last stage may wait for the sum: at most one backward pass of the first stage.

Every step returns the minibatch's loss on every rank: ranks wait for the last stage's loss at the
end of each step (a collective on a group of its own). That wait costs overlap: no stage starts the
next step's forward passes before the step's last microbatch has been through the last stage, so
only backward passes overlap across steps. Gradient clipping needs the whole gradient's
norm, which an asynchronous pipeline never holds at one moment, so it is refused. A checkpoint holds
the weights, optimizer state and counters; resuming restarts the pipeline empty (the microbatches in
flight when it was written are dropped), so a resumed run is not identical to an uninterrupted one.
The last step drains the pipeline, so the final model has every update.

Mixed precision (`train.precision: bf16`) is autocast inside each stage's forward over fp32 weights,
as for the synchronous pipeline (see pipeline.py: stashed versions, gradients and optimizer state stay
fp32; activations and gradients travel in the dtype the layers produce in fp32). Unlike there, the
autocast region is one forward pass, not the step: a stage updates its weights in place in the middle
of a step, and a region spanning the update would hand later forward passes autocast's cached bf16
copy of the old weights. Each microbatch in flight thus keeps its own bf16 copy of the weights it used
until its backward pass (counted in `mem_activation_bytes`). fp16 is refused (no loss scaler).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from ..metrics.memory import SavedActivations, Sharding, StateBytes, model_state_theory, optimizer_state_bytes
from .base import Engine, optimizer_description, split_batch
from .context import DistContext
from .optim import build_optimizer, lr_factor
from .layout import Layout
from .stages import Busy, Interval, Pipeline, validate_layout


@dataclass
class Options:
    """`strategy:` keys for pipedream."""

    stages: int = 2  # P: pipeline ranks; num_workers = P x data-parallel replicas
    microbatches: Optional[int] = None  # pieces of each step's rows in the pipeline (default 1; 2BW: stages)
    weight_versions: Optional[Literal[2]] = None  # None: a stashed version per minibatch in flight; 2: PipeDream-2BW
    split_points: Optional[list[int]] = None  # layer indices where stages 1.. begin; default: balanced
    balance: Literal["flops", "params"] = "flops"  # what the automatic split balances

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or (self.stages if self.weight_versions == 2 else 1)

    def validate(self, spec, error) -> None:
        P, M = self.stages, self.num_microbatches
        validate_layout(spec, error, P, P, M, self.split_points)
        if spec.train.grad_clip:
            error("train.grad_clip", spec.train.grad_clip, "pipedream updates each stage asynchronously, so the norm of "
                  "the whole gradient is never known", "set train.grad_clip: 0 (or use strategy pipeline)")
        if spec.train.gradient_accumulation_steps > 1:
            error("train.gradient_accumulation_steps", spec.train.gradient_accumulation_steps,
                  "pipedream cuts each step's rows into its own microbatches, whose gradients each stage adds up "
                  "before its update", f"use strategy.microbatches: {spec.train.gradient_accumulation_steps} "
                  "instead, and remove train.gradient_accumulation_steps")
        if self.weight_versions == 2 and M < P - 1:
            error("strategy.microbatches", M, f"PipeDream-2BW keeps two weight versions only with at least "
                  f"stages - 1 = {P - 1} microbatches per step", f"use {P} or more")

    def layout(self, num_workers: int) -> Layout:
        return Layout.of(num_workers, pipeline=self.stages, schedule="pipedream" if self.weight_versions is None
                         else "pipedream-2bw", microbatches=self.num_microbatches)

    stages_per_worker = 1

    @staticmethod
    def stages_of(pp_rank: int) -> list[int]:
        """Pipeline rank p holds stage p."""
        return [pp_rank]


def staleness_theory(j: int, lag: int, microbatches: int, two_versions: bool, start: int = 0) -> int:
    """Updates a stage makes between microbatch j's forward and backward passes: the backward passes
    in between are those of microbatches j - lag .. j - 1 (1F1B order; none before `start`, when the
    pipeline started), and an update follows each that ends a minibatch. Under 2BW the forward used
    the version of the minibatch's first microbatch, so count from there."""
    first = (j // microbatches) * microbatches if two_versions else j
    lo = max(start, first - lag)
    return sum(1 for k in range(lo, j) if (k + 1) % microbatches == 0)


@dataclass
class _InFlight:
    j: int
    x: torch.Tensor | None  # the stage's input (needs its gradient), None on the first stage
    out: torch.Tensor  # activation sent on, or the loss on the last stage
    version: int
    params: dict[str, torch.Tensor]  # the weights the forward pass used


class PipeDreamEngine(Engine):
    Options = Options
    profiles_steps = False  # sends complete two steps after they are posted (see _wait_for_sends)

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        super().__init__(model, task, train, options, ctx, total_steps)
        P = options.stages
        self.pipe = pipe = Pipeline(model, self.placement, self.device, P, options.stages_of, options.split_points,
                                    options.balance, train.precision)
        self.stage = pipe.local[0]
        self.module = pipe.modules[self.stage]
        self.lag = P - 1 - self.stage
        self.m = options.num_microbatches
        self.two_versions = options.weight_versions == 2
        self.lr_factor = lr_factor(train, total_steps)

        # Groups of their own for the loss and for evaluation: point-to-point messages of training can
        # be in flight between steps, and NCCL matches operations on one communicator in order.
        self.loss_group = self.placement.group_along("pp", tag="loss") if ctx.distributed else None
        self.eval_group = self.placement.group_along("pp", tag="eval") if ctx.distributed else None

        # Untied copies (on the last stage) take delayed updates of their own; see the module docstring.
        self.delayed = [self.module.get_parameter(name) for tie in pipe.ties for _, name in tie.copies]
        delayed_ids = {id(p) for p in self.delayed}
        self.optimizer = build_optimizer(_Params([p for p in self.module.parameters() if id(p) not in delayed_ids]),
                                         train)
        self.tied_optimizer = build_optimizer(_Params(self.delayed), train) if self.delayed else None
        self.exchange = [(tie, g) for tie, g in zip(pipe.ties, pipe.tie_groups) if g is not None]

        # Where the pipeline stands (absolute indices: microbatch j belongs to step j // m).
        self.calls = 0  # steps done
        self.start = 0  # first microbatch since the pipeline (re)started
        self.version = 0  # updates of this stage
        self.next_tied = 0  # last stage: next minibatch whose tied-gradient sum is due from the first stage
        self.in_flight: deque[_InFlight] = deque()
        self.fwd: tuple[int, dict] | None = None  # 2BW: the version the current minibatch's forwards use
        self.current = dict(self.module.named_parameters())
        self.sends: list = []  # (step, work, tensor) of activation and gradient sends
        self.tie_sends: dict = {}  # minibatch -> (work, tensor) of tied-gradient sends
        self.staleness: deque[tuple[int, int]] = deque(maxlen=4096)  # (microbatch, measured staleness)
        self.interval_staleness = Interval()
        self.busy, self.bubble = Busy(self.device), Interval()
        self.activations = SavedActivations()
        self.stash_now = self.stash_peak = 0

    @classmethod
    def estimate_pipeline(cls, options):
        return cls, options

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Not measured: the small batches' squares add up over every stage, and the stages update on a
        minibatch's gradient at different times (the last first), so collecting them each update would
        hold every stage back to the first one's pace; the tied embedding's halves meet only once reduced
        over the replicas."""
        return False

    @classmethod
    def estimate_rank(cls, pipe: Options, train, dp: int, pp_rank: int, params: dict[int, int],
                      micro: dict[int, float], fixed: dict[int, float],
                      loss: float = 0.0) -> tuple[StateBytes, float, float]:
        """What stage p holds (see PipelineEngine.estimate_rank for the arguments): its fp32 model
        states, plus the weight versions stashed for the microbatches in flight when it updates (lag =
        P - 1 - p of them in flight; with stashing, as many versions as minibatches they span,
        ceil(lag / m); with 2BW one); and the activations of the lag + 1 microbatches in flight after
        a forward pass, each with its own 16-bit weight copy under autocast (`fixed`: one region per
        forward pass)."""
        lag, m = pipe.stages - 1 - pp_rank, pipe.num_microbatches
        theory = model_state_theory(Sharding(), dp, train.precision, optimizer_state_bytes(train)) * params[pp_rank]
        versions = min(1, lag) if pipe.weight_versions == 2 else math.ceil(lag / m)
        stash = versions * 4 * params[pp_rank]
        return StateBytes(theory, theory + stash), (lag + 1) * (micro[pp_rank] + fixed[pp_rank]), 0.0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pipe.S - 1

    # -- one step -----------------------------------------------------------------------------------
    def train_step(self, batch):
        """PipeDream has no synchronous step: each stage updates on its own clock as its microbatches'
        backward passes finish (module docstring), so this engine does not run the shared step
        (base.Engine.train_step); clipping is refused before start and accumulation is its microbatches."""
        self._wait_for_sends()
        task, m = self.task, self.m
        total = torch.zeros((), device=self.device)
        t0 = time.perf_counter()
        chunks = split_batch(batch, m)
        pending_input = None
        for i, chunk in enumerate(chunks):
            j = self.calls * m + i
            prepared = task.prepare(chunk, self.device) if (self.first or self.last) else None
            # forward of microbatch j
            if self.first:
                x = prepared[task.input_key]
            else:
                x, work = pending_input or self._post_recv_input(task.samples_of(chunk))
                work.wait()
                x.requires_grad_()
            pending_input = None
            self._receive_tied_updates(before=j)
            version, params = self._forward_weights(j)
            with self.busy(), self.activations.track(params.values()):
                out = functional_call(self.module, params, (x,))
                if self.last:
                    out = task.loss_from(out, prepared[task.label_key]) / m
            if self.last:
                total += out.detach()
            self.in_flight.append(_InFlight(j, None if self.first else x, out, version, params))
            ops = [] if self.last else [dist.P2POp(dist.isend, out.detach(), group=self.pipe.pp_group,
                                                   group_peer=self.stage + 1)]
            backward = self.in_flight[0].j == j - self.lag
            grad = None
            if backward and not self.last:
                grad = torch.empty_like(self.in_flight[0].out)
                ops.append(dist.P2POp(dist.irecv, grad, group=self.pipe.pp_group, group_peer=self.stage + 1))
            self._run(ops, wait_recv=True)
            # backward of microbatch j - lag, then receive the next input along with sending the gradient
            if backward:
                next_rows = task.samples_of(chunks[i + 1]) if i + 1 < m and not self.first else None
                pending_input = self._backward(grad, next_rows)
        busy = self.busy.take()
        self.bubble.add(1.0 - busy / max(time.perf_counter() - t0, 1e-9))
        self.calls += 1
        if self.calls >= self.total_steps:
            self._drain()
        return self.pipe.from_last(total, self.loss_group)

    def _forward_weights(self, j: int) -> tuple[int, dict]:
        if not self.two_versions:
            return self.version, self.current
        if j % self.m == 0:  # a new minibatch takes the newest version ...
            self.fwd = (self.version, self.current)
        version, params = self.fwd
        if j % self.m == self.m - 1:  # ... and keeps it until its last forward pass
            self.fwd = None
        return version, params

    def _post_recv_input(self, rows: int):
        x = self.pipe.buffer(self.stage - 1, rows)
        (work,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, group=self.pipe.pp_group,
                                                     group_peer=self.stage - 1)])
        return x, work

    def _run(self, ops: list, wait_recv: bool) -> list:
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        for op, work in zip(ops, works):
            if op.op is dist.isend:
                self.sends.append((self.calls, work, op.tensor))
            elif wait_recv:
                work.wait()
        return works

    def _backward(self, grad: torch.Tensor | None, next_rows: int | None):
        """Backward of the oldest microbatch in flight with the weights its forward used; sends the input
        gradient back (and posts the receive of the next input with it); updates at a minibatch's end."""
        e = self.in_flight.popleft()
        done, staleness = e.j, self.version - e.version
        names = list(e.params)
        with self.busy():
            grads = torch.autograd.grad(e.out, ([e.x] if e.x is not None else []) + [e.params[n] for n in names],
                                        grad_outputs=None if self.last else grad, allow_unused=True)
            input_grad = grads[0] if e.x is not None else None
            for n, g in zip(names, grads[len(grads) - len(names):]):
                if g is not None:
                    p = self.current[n]
                    p.grad = g if p.grad is None else p.grad.add_(g)
        del e, grads  # the stashed weights this microbatch used are free from here
        self.staleness.append((done, staleness))
        self.interval_staleness.add(float(staleness))
        ops, pending = [], None
        if input_grad is not None:
            ops.append(dist.P2POp(dist.isend, input_grad, group=self.pipe.pp_group, group_peer=self.stage - 1))
        if next_rows is not None:
            x = self.pipe.buffer(self.stage - 1, next_rows)
            ops.append(dist.P2POp(dist.irecv, x, group=self.pipe.pp_group, group_peer=self.stage - 1))
        works = self._run(ops, wait_recv=False)
        if next_rows is not None:
            pending = (x, works[-1])
        if (done + 1) % self.m == 0:
            self._update(done // self.m)
        return pending

    def _drain(self) -> None:
        """Finish the backward passes still in flight (the end of training)."""
        while self.in_flight:
            grad = None
            if not self.last:
                grad = torch.empty_like(self.in_flight[0].out)
                self._run([dist.P2POp(dist.irecv, grad, group=self.pipe.pp_group, group_peer=self.stage + 1)], True)
            self._backward(grad, None)
        self._receive_tied_updates(final=True)
        for _, work, _ in self.sends:
            work.wait()
        for work, _ in self.tie_sends.values():
            work.wait()
        self.sends, self.tie_sends = [], {}

    # -- updates ------------------------------------------------------------------------------------
    def _update(self, u: int) -> None:
        """Step on minibatch u's gradient (complete with its last backward pass here)."""
        grads = [p.grad for p in self.current.values() if p.grad is not None]
        if self.pipe.D > 1:
            for g in grads:
                dist.all_reduce(g, group=self.pipe.dp_group)
                g.div_(self.pipe.D)
        for tie, group in self.exchange:
            if self.first:  # add the last stage's half, send the sum back
                (w,) = self.pipe.tied(tie)
                half = torch.empty_like(w)
                dist.recv(half, group_src=1, group=group)
                w.grad.add_(half)
                total = w.grad.clone()
                self.tie_sends[u] = (dist.isend(total, group_dst=1, group=group), total)
                # The last stage has received the sum of minibatch v once it sent this half (it applies
                # sums before forward passes, and it sent u's half after forwarding all of u).
                lag0 = self.pipe.S - 1
                for v in [v for v in self.tie_sends if (v + 1) * self.m <= u * self.m - lag0]:
                    self.tie_sends.pop(v)[0].wait()
            else:
                for w in self.pipe.tied(tie):
                    self.tie_sends[u] = (dist.isend(w.grad, group_dst=0, group=group), w.grad)
                    w.grad = None
        pinned = {e.version for e in self.in_flight} | ({self.fwd[0]} if self.fwd else set())
        if self.version in pinned:
            self._stash()
        for group in self.optimizer.param_groups:
            group["lr"] = self.train.lr * self.lr_factor(u)
        self.optimizer_step()
        self.version += 1
        del grads

    def _stash(self) -> None:
        """Move the current weights aside for the microbatches in flight that used them; the optimizer
        steps a copy from here on."""
        delayed = {id(p) for p in self.delayed}
        moved = {}
        for module in self.module.modules():
            for name, old in list(module._parameters.items()):
                if old is None or id(old) in delayed:
                    continue
                if id(old) not in moved:
                    new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
                    new.grad, old.grad = old.grad, None
                    moved[id(old)] = (old, new)
                    nbytes = old.untyped_storage().nbytes()
                    self.stash_now += nbytes
                    self.stash_peak = max(self.stash_peak, self.stash_now)
                    weakref.finalize(old, self._unstash, nbytes)
                module._parameters[name] = moved[id(old)][1]
        swap = {id(old): new for old, new in moved.values()}
        for group in self.optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        for old, new in moved.values():
            if old in self.optimizer.state:
                self.optimizer.state[new] = self.optimizer.state.pop(old)
        self.current = dict(self.module.named_parameters())

    def _unstash(self, nbytes: int) -> None:
        self.stash_now -= nbytes

    def _receive_tied_updates(self, before: int = 0, final: bool = False) -> None:
        """Last stage: bring the untied copies to the version the first stage's originals have when it
        forwards microbatch `before` (its forward weights under 2BW), i.e. apply the tied-gradient sums
        of the minibatches whose last backward pass the first stage has run by then (1F1B order: the
        one of microbatch before - 1 - (P - 1)); at the end of training, all of them."""
        if self.tied_optimizer is None:
            return
        if self.two_versions:
            before = before // self.m * self.m
        lag0 = self.pipe.S - 1
        while self.next_tied < self.calls if final else (self.next_tied + 1) * self.m <= before - lag0:
            u = self.next_tied
            for tie, group in self.exchange:
                copies = self.pipe.tied(tie)
                total = torch.empty_like(copies[0])
                dist.recv(total, group_src=0, group=group)
                for w in copies:
                    w.grad = total
            for group in self.tied_optimizer.param_groups:
                group["lr"] = self.train.lr * self.lr_factor(u)
            self.tied_optimizer.step()
            self.tied_optimizer.zero_grad(set_to_none=True)
            self.next_tied += 1
            work, _ = self.tie_sends.pop(u)  # the first stage has received this minibatch's half
            work.wait()

    def _wait_for_sends(self) -> None:
        """Finish the sends of activations and gradients made two steps ago or earlier. (Gloo's send
        works complete only once waited for, so they are waited for where their receives are known to
        be posted: a neighbour receives them in the same step or the next.)"""
        keep = []
        for sent in self.sends:
            if sent[0] + 2 > self.calls:
                keep.append(sent)
            else:
                sent[1].wait()
        self.sends = keep

    # -- evaluation and records -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches):
        self._receive_tied_updates(before=self.calls * self.m)  # the copies as the next forward passes see them
        sums = self.dp_sum(self.pipe.eval_sums(batches, self.task, self.eval_group))
        return self.task.summarize(*[float(x) for x in sums])

    def model_state(self) -> dict[str, int]:
        # A stage updates while microbatches are in flight (the pipeline never drains): the activations
        # autograd holds for them are in the allocator's count then, and are not model state.
        out = super().model_state()
        out["mem_model_state_bytes"] = max(out["mem_model_state_census_bytes"],
                                           out["mem_model_state_bytes"] - self.activations.now)
        return out

    def census(self) -> dict[str, int]:
        from ..metrics.memory import model_state_census, optimizer_tensors

        tied = optimizer_tensors(self.tied_optimizer) if self.tied_optimizer is not None else ()
        return model_state_census(self.module.parameters(), self.optimizer, extra_optim=tied)

    def memory(self) -> dict:
        """Memory of this worker, plus per-stage figures gathered over the pipeline (every rank calls
        this at every record)."""
        out = super().memory()
        out["mem_activation_bytes"] = activation = self.activations.take_peak()
        out["mem_stash_bytes"] = self.stash_peak
        self.stash_peak = self.stash_now
        staleness, bubble = self.interval_staleness.take(), self.bubble.take()
        mine = {"param": out["mem_param_bytes"], "activation": activation, "stash": out["mem_stash_bytes"],
                "staleness": staleness, "bubble": bubble, "layers": self.pipe.layers_of(self.pipe.pp_rank),
                "theory": self.staleness_theory_mean()}
        ranks = self.pipe.gather(mine)
        for key in ("layers", "param", "activation", "stash"):
            out[f"stage_{key}" + ("" if key == "layers" else "_bytes")] = [r[key] for r in ranks]
        measured = all(r["bubble"] is not None for r in ranks)
        out["stage_staleness"] = [r["staleness"] for r in ranks] if measured else None
        out["stage_staleness_theory"] = [r["theory"] for r in ranks]
        out["stage_bubble_fraction"] = [r["bubble"] for r in ranks] if measured else None
        out["bubble_fraction"] = sum(r["bubble"] for r in ranks) / len(ranks) if measured else None
        return out

    def staleness_theory_mean(self) -> float:
        """Steady-state mean staleness of this stage: lag / m updates with stashing, ceil(lag / m) with 2BW."""
        return float(math.ceil(self.lag / self.m)) if self.two_versions else self.lag / self.m

    # -- the one checkpoint format (strategies/state.py) ---------------------------------------------
    def held_tensors(self):
        return self.pipe.held_tensors()

    def held_parameters(self):
        delayed = {id(p) for p in self.delayed}
        return ((name, p, self.tied_optimizer if id(p) in delayed else self.optimizer)
                for name, p in self.pipe.named_parameters())

    def aliases(self):
        """The last stage's untied copy of a tied embedding (updated with a delay, by an optimizer of its own)
        by its original's name: the plain model holds the first stage's, and the copy resumes from it."""
        return {**super().aliases(), **self.pipe.copy_names()}

    def load_pieces(self, source):
        super().load_pieces(source)
        self.current = dict(self.module.named_parameters())

    def format_extras(self):
        """No schedule object: each update sets its rate from the schedule's factor of its minibatch."""
        return {**optimizer_description(self.optimizer), "scheduler": {"last_epoch": self.calls}}

    def load_format_extras(self, index):
        """The pipeline restarts empty at the next step's first microbatch (the microbatches in flight
        when the checkpoint was written are dropped, also when this engine wrote it)."""
        self.calls = self.version = self.next_tied = int(index["step"])
        self.start = self.calls * self.m
        self.in_flight.clear()
        self.fwd = None
        for p in self.module.parameters():
            p.grad = None

    def full_state_dict(self):
        return self.pipe.full_state_dict()


class _Params(nn.Module):
    """A module over given parameters, for build_optimizer's parameter groups."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)

