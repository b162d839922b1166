"""What the pipeline engines share: splitting a model into stages, the (pipeline x data) grid of
ranks, weights tied across stages, a forward-only pass for evaluation, and per-stage records.

`pipeline` (torch.distributed.pipelining's schedules) and `pipedream` (asynchronous, hand-written)
build a `Pipeline` and differ only in how they run training steps on it.

Layout. The engine's `Placement` (layout.py) says which ranks form this rank's pipeline (`pp_group`)
and which hold replicas of its stages (`dp_group`): with num_workers = P x D, rank = p * D + d for
pipeline rank p and data-parallel replica d, so the D replicas of one stage are neighbouring ranks
(one node, for their gradient all-reduce) and the stages of one pipeline talk point to point.

Split. Models list their layers (models.pipeline_layers: GPT-2 embeddings / blocks / norm + head,
Llama-style embeddings / decoder layers / norm + head, VGG convolutions / classifier layers); a stage is a contiguous run of layers. The split balances
the stages' forward FLOPs (`balance: flops`, counted by torch's FlopCounterMode on meta-device
copies of the layers: no compute, and every rank and every resumed run derives the same split) or their parameter counts (`balance: params`), or follows `split_points`.

Tied weights. A parameter used by layers on two stages (GPT-2's token embedding, which is also the
LM head) is untied as Megatron-LM does: the later stage holds a copy, and after every backward the
copies' gradients are summed (all-reduce between the stages holding them), so both copies take
identical optimizer steps and stay equal. The copy costs the later stage one more vocab x width
matrix (with its gradient and optimizer state); `full_state_dict` returns both names, equal.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .. import models
from ..models.initial import materialise
from .base import padded
from .context import DTYPES
from .dtensor import local_tensor, whole_tensor
from .layout import Placement

# -- options shared by the pipeline engines -----------------------------------------------------


def validate_layout(spec, error, stages: int, stages_total: int, microbatches: int,
                    split_points: list[int] | None) -> None:
    """Checks every pipeline engine makes before anything starts: P, the workers, the layers, M."""
    n = spec.scaling.num_workers
    if spec.train.precision == "fp16":
        error("train.precision", "fp16", "the pipeline engines compute in 16 bits by autocast and have no loss "
              "scaler, which fp16 gradients need", "use train.precision: bf16 (fp32's range: no loss scaling)")
    if stages < 2:
        error("strategy.stages", stages, "a pipeline has at least 2 stages",
              "use 2 or more (strategy ddp trains the whole model on every worker)")
    if n % stages:
        lo = max(stages, n // stages * stages)
        error("scaling.num_workers", n, f"does not split into pipelines of {stages} stages "
              "(num_workers = stages x data-parallel replicas)", f"use a multiple of {stages}, e.g. {lo}")
    layers = models.pipeline_layer_count(spec.model)
    if layers is None:
        from ..models.causal_lm import SPLIT_FAMILIES, load

        error("model.config", spec.model.options.config, f"a pipeline cannot split model_type "
              f"{load(spec.model.options).model_type!r}: it knows the layers of {', '.join(SPLIT_FAMILIES)}",
              "use a config of one of those families, or a strategy that trains the whole model "
              "(ddp, zero-1/2/3, fsdp)")
        return
    what = models.family_of(spec.model.name).LAYERS
    if stages_total > layers:
        error("strategy.stages", stages, f"{stages_total} stages but {spec.model.name} has {layers} layers "
              f"({what}) to split between", f"use at most {layers} stages in all (stages x virtual_stages)")
    if split_points is not None:
        bounds = [0, *split_points, layers]
        if len(split_points) != stages_total - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            error("strategy.split_points", split_points,
                  f"expected {stages_total - 1} increasing layer indices in 1..{layers - 1} (where stages 1.."
                  f"{stages_total - 1} begin; layers: {what})",
                  f"e.g. {even_split(layers, stages_total)}, or remove it to balance the stages automatically")
    if microbatches < 1:
        error("strategy.microbatches", microbatches, "must be >= 1", f"use e.g. {4 * stages}")
    t = spec.train
    replicas = spec.data_parallel_size
    if t.global_batch_size % (replicas * t.gradient_accumulation_steps) == 0:  # otherwise config reports it
        rows = t.global_batch_size // (replicas * t.gradient_accumulation_steps)
        if rows % microbatches:
            divisors = [m for m in range(1, rows + 1) if rows % m == 0]
            near = min(divisors, key=lambda m: (abs(m - microbatches), m))
            error("strategy.microbatches", microbatches,
                  f"does not divide the {rows} rows a pipeline trains on per step (global batch "
                  f"{t.global_batch_size} / {replicas} data-parallel replicas / {t.gradient_accumulation_steps} "
                  "accumulation steps)", f"use a divisor of {rows}, e.g. {near}, or change train.global_batch_size")


def even_split(layers: int, parts: int) -> list[int]:
    return [round(i * layers / parts) for i in range(1, parts)]


# -- splitting ------------------------------------------------------------------------------------


def measure_layers(model: nn.Module, layers: list[nn.Module]) -> tuple[list[float], list[tuple]]:
    """Forward FLOPs of one sample through each layer, and each layer's output (sample shape, dtype):
    counted by torch's FlopCounterMode on meta-device copies of the layers, one at a time, so nothing
    is computed and only one layer is copied at a time."""
    x = models.example_input(model, "meta")
    flops, outputs = [], []
    for layer in layers:
        meta = copy.deepcopy(layer).to("meta")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            x = meta(x)
        flops.append(float(counter.get_total_flops()))
        outputs.append((tuple(x.shape[1:]), x.dtype))
        del meta
    return flops, outputs


def partition(costs: list[float], parts: int) -> list[int]:
    """Split points (where parts 1.. begin) cutting `costs` into `parts` contiguous non-empty runs with
    the smallest largest sum (dynamic programming; a few dozen layers)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    arg = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cand = max(best[k - 1][j], prefix[i] - prefix[j])
                if cand < best[k][i]:
                    best[k][i], arg[k][i] = cand, j
    points, i = [], n
    for k in range(parts, 0, -1):
        i = arg[k][i]
        points.append(i)
    return sorted(points)[1:]


def split_model(model: nn.Module, num_stages: int, split_points: list[int] | None = None,
                balance: str = "flops") -> tuple[list[int], list[tuple[int, int]], list[tuple]]:
    """Where the stages begin (`split_points`, or the balanced split), each stage's range of layers,
    and what each stage sends on: (shape of one sample, dtype); a message of b rows is [b, *shape]."""
    layers = models.pipeline_layers(model)
    flops, outputs = measure_layers(model, layers)
    costs = flops if balance == "flops" else [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    split = list(split_points) if split_points else partition(costs, num_stages)
    bounds = [0, *split, len(layers)]
    ranges = [(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    return split, ranges, [outputs[b - 1] for _, b in ranges]


class Pipeline:
    """A model split into `num_stages` stages over the pipeline ranks of a placement; this rank's stages.

    `stages_of(p)` lists the stage indices pipeline rank p holds (one, or several for interleaved
    schedules). Only this rank's stages are kept (moved to the device); the rest of the model is
    dropped with the caller's reference to it. `split_layers(model)`, if given, transforms the whole
    model in place after the split is chosen and before the stages take their layers (megatron's
    tensor parallel inside each stage); the split is measured on the plain model."""

    def __init__(self, model: nn.Module, placement: Placement, device: torch.device, num_stages: int,
                 stages_of: Callable[[int], list[int]], split_points: list[int] | None = None,
                 balance: str = "flops", precision: str = "fp32",
                 split_layers: Callable[[nn.Module], None] | None = None):
        layout, S = placement.layout, num_stages
        self.placement, self.P, self.D, self.S, self.device = placement, layout.pipeline, layout.data, S, device
        P = self.P
        self.pp_rank, self.dp_rank = placement.pp_rank, placement.dp_rank
        self.pp_group, self.dp_group = placement.pp_group, placement.dp_group
        self.owner = {s: p for p in range(P) for s in stages_of(p)}
        assert sorted(self.owner) == list(range(S)), "every stage needs exactly one pipeline rank"
        self.local = sorted(stages_of(self.pp_rank))

        self.split, self.layer_ranges, self.outputs = split_model(model, S, split_points, balance)
        if split_layers is not None:
            split_layers(model)
        layers = models.pipeline_layers(model)
        every = [Stage(*layers[a:b], out_dtype=self.outputs[s][1], device_type=device.type, precision=precision)
                 for s, (a, b) in enumerate(self.layer_ranges)]

        # Original names of each stage's state (by the model's own module paths) and tied parameters.
        paths: dict[int, str] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), path)
        slots = [_slots(stage, paths) for stage in every]
        covered = {orig for stage_slots in slots for (_, _, _, orig) in stage_slots}
        missing = set(model.state_dict()) - covered
        assert not missing, f"pipeline layers leave out {sorted(missing)[:5]}"
        self.names = {s: {local: orig for local, _, _, orig in slots[s]} for s in self.local}

        holders: dict[int, list[tuple[int, str, nn.Module, str, str]]] = defaultdict(list)
        for s, stage_slots in enumerate(slots):
            for local, module, attr, orig in stage_slots:
                value = module._parameters.get(attr)
                if value is not None:
                    holders[id(value)].append((s, local, module, attr, orig))
        self.ties: list[Tie] = []
        for found in sorted(holders.values(), key=lambda h: h[0][4]):
            stages_with = sorted({s for s, *_ in found})
            if len(stages_with) < 2:
                continue
            tie = Tie(found[0][4], sorted({self.owner[s] for s in stages_with}))
            copies: dict[int, nn.Parameter] = {}
            for s, local, module, attr, _ in found:
                if s not in self.local:
                    continue
                if s != stages_with[0]:  # untie: a copy of its own on every later stage
                    if s not in copies:
                        p = module._parameters[attr]
                        copies[s] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                        tie.copies.append((s, local))
                    setattr(module, attr, copies[s])
                elif tie.counted is None:
                    tie.counted = (s, local)
            self.ties.append(tie)
        # this rank's stages only given storage, for a model built on the meta device
        self.modules: dict[int, nn.Module] = {s: materialise(every[s], self.device) for s in self.local}
        del every, layers, slots, holders

        # The ranks holding a tie's copies in each pipeline (one group per data-parallel and tensor rank).
        self.tie_groups = [placement.group_along("pp", tie.owners, tag=f"tie {tie.name}") if len(tie.owners) > 1
                           else None for tie in self.ties]
        self.sharded = False

    def shard(self) -> None:
        """FSDP2 over each stage's replicas (`data_parallel_sharding: fsdp`): each layer a unit, then the
        stage. torch's pipeline stages drive FSDP themselves: gradients are reduce-scattered (averaged)
        after a step's last backward pass."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.placement.mesh_of("dp")
        for module in self.modules.values():
            for layer in module:
                fully_shard(layer, mesh=mesh)
            fully_shard(module, mesh=mesh)
        self.sharded = True

    def tied(self, tie: "Tie") -> list[nn.Parameter]:
        """This rank's copies of a tied parameter (looked up by name: engines may replace parameters)."""
        return [self.modules[s].get_parameter(name) for s, name in tie.slots]

    # -- where things are -----------------------------------------------------------------------
    @property
    def first_owner(self) -> int:
        return self.owner[0]

    @property
    def last_owner(self) -> int:
        return self.owner[self.S - 1]

    @property
    def has_first(self) -> bool:
        return 0 in self.local

    @property
    def has_last(self) -> bool:
        return self.S - 1 in self.local

    def layers_of(self, pp_rank: int) -> list[int]:
        """Indices of the layers pipeline rank `pp_rank` holds."""
        return [i for s, p in self.owner.items() if p == pp_rank for i in range(*self.layer_ranges[s])]

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for module in self.modules.values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    # -- gradients ------------------------------------------------------------------------------
    def reduce_grads(self, params: list[nn.Parameter] | None = None,
                     local: Callable[[], None] | None = None) -> None:
        """Sum the gradients of tied copies (within the pipeline), then average over the stage's replicas;
        `local`, if given, is called in between, while each gradient is this replica's own."""
        self.sum_tied_grads()
        if local is not None:
            local()
        if self.D > 1 and not self.sharded:  # FSDP has averaged them
            grads = [p.grad for p in (params or self.parameters()) if p.grad is not None]
            works = [dist.all_reduce(g, group=self.dp_group, async_op=True) for g in grads]
            for w in works:
                w.wait()
            for g in grads:
                g.div_(self.D)

    def sum_tied_grads(self) -> None:
        for tie, group in zip(self.ties, self.tie_groups):
            params = self.tied(tie)
            if not params:  # no copy on this rank
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [local_tensor(p.grad) for p in params]  # the replicas' slices of a sharded one line up
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                if g is not total:
                    g.copy_(total)

    def counted(self, params: list[nn.Parameter] | None = None) -> list[nn.Parameter]:
        """`params` (default: this rank's) without the untied copies of tied parameters: each parameter
        of the model once over the pipeline."""
        copies = {id(self.modules[s].get_parameter(name)) for tie in self.ties for s, name in tie.copies}
        return [p for p in (params or self.parameters()) if id(p) not in copies]

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' state under the plain model's names."""
        out = {}
        for s, module in self.modules.items():
            for local, value in module.state_dict().items():
                out[self.names[s][local]] = whole_tensor(value)  # sharded: gathered over the replicas
        return out

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's stages' tensors by the plain model's names (an untied copy by its own: `copy_names`)."""
        for s, module in self.modules.items():
            for local, t in module.state_dict(keep_vars=True).items():
                yield self.names[s][local], t

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's stages' parameters by the plain model's names (an untied copy by its own)."""
        for s, module in self.modules.items():
            for local, p in module.named_parameters():
                yield self.names[s][local], p

    def copy_names(self) -> dict[str, str]:
        """The plain model's name of each untied copy of a tied parameter on this rank -> its original's (the
        name the plain model holds the tensor under)."""
        return {self.names[s][local]: name for (s, local), name in self._copies.items()}

    @property
    def _copies(self) -> dict[tuple[int, str], str]:
        """(stage, local name) of each untied copy of a tied parameter on this rank -> its original's name."""
        return {(s, local): tie.name for tie in self.ties for s, local in tie.copies}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict, gathered from the stages of this rank's pipeline (every rank)."""
        mine = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        out: dict[str, torch.Tensor] = {}
        for part in self.gather(mine):
            out.update(part)
        return out

    def gather(self, obj) -> list:
        """`obj` of every rank of this pipeline, in pipeline-rank order."""
        out = [None] * self.P
        dist.all_gather_object(out, obj, group=self.pp_group)
        return out

    def from_last(self, t: torch.Tensor, group=None) -> torch.Tensor:
        """The last stage's `t` on every rank of the pipeline."""
        t = t.to(self.device)
        dist.broadcast(t, group_src=self.last_owner, group=group or self.pp_group)
        return t

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def eval_sums(self, batches: Iterable[dict[str, torch.Tensor]], task, group=None, passes: int | None = None
                  ) -> torch.Tensor:
        """[loss sum, predictions, correct] over `batches`, run forward through the stages; the last
        stage's sums on every rank of the pipeline. Written by hand rather than with a torch schedule:
        validation batches vary in size, and torch's schedules fix microbatch shapes at their first step.
        `passes`: as many forward passes as the replica with the most batches makes (sharded stages,
        see base.padded)."""
        group, batches = group or self.pp_group, list(batches)
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        for module in self.modules.values():
            module.eval()
        for batch, counted in padded(batches, len(batches) if passes is None else passes):
            prepared = task.prepare(batch, self.device)
            rows = task.samples_of(batch)
            x = None
            for s in self.local:
                if s == 0:
                    x = prepared[task.input_key]
                elif self.owner[s - 1] != self.pp_rank:
                    x = self.buffer(s - 1, rows)
                    dist.recv(x, group_src=self.owner[s - 1], group=group)
                x = self.modules[s](x)
                if s == self.S - 1:
                    if counted:
                        sums += task.sums_from(x, prepared[task.label_key]).double()
                elif self.owner[s + 1] != self.pp_rank:
                    dist.send(x.contiguous(), group_dst=self.owner[s + 1], group=group)
        for module in self.modules.values():
            module.train()
        return self.from_last(sums, group)

    def buffer(self, stage: int, rows: int) -> torch.Tensor:
        """An empty tensor for `rows` rows of what `stage` sends on."""
        shape, dtype = self.outputs[stage]
        return torch.empty(rows, *shape, dtype=dtype, device=self.device)


class Stage(nn.Sequential):
    """A stage's layers in a row. Under mixed precision its forward runs under autocast over the fp32
    parameters, and its output leaves in the dtype the layers produce in fp32 (measured on meta copies,
    see `measure_layers`): what every receiving buffer, and torch's shape inference (on meta tensors,
    which autocast leaves alone), expect, whichever ops autocast lowered on this device."""

    def __init__(self, *layers: nn.Module, out_dtype: torch.dtype, device_type: str, precision: str = "fp32"):
        super().__init__(*layers)
        self.out_dtype, self.device_type = out_dtype, device_type
        self.compute_dtype = None if precision == "fp32" else DTYPES[precision]

    def forward(self, x):
        if self.compute_dtype is None:
            return super().forward(x)
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            y = super().forward(x)
        return y.to(self.out_dtype) if y.is_floating_point() else y


@dataclass
class Tie:
    """A parameter used on several stages: `counted` is this rank's original (stage, name), if here,
    `copies` the untied copies here; `owners` the pipeline ranks holding any."""

    name: str
    owners: list[int]
    counted: tuple[int, str] | None = None
    copies: list[tuple[int, str]] = field(default_factory=list)

    @property
    def slots(self) -> list[tuple[int, str]]:
        """(stage, name) of every holder on this rank, the original first."""
        return ([self.counted] if self.counted else []) + self.copies


def _slots(stage: nn.Module, paths: dict[int, str]) -> list[tuple[str, nn.Module, str, str]]:
    """(name in the stage's state dict, owning module, attribute, name in the plain model's state dict)."""
    out = []
    for mpath, module in stage.named_modules(remove_duplicate=False):
        if id(module) not in paths:
            continue
        held = [(n, v) for n, v in module._parameters.items() if v is not None]
        held += [(n, v) for n, v in module._buffers.items()
                 if v is not None and n not in module._non_persistent_buffers_set]
        for attr, _ in held:
            local = f"{mpath}.{attr}" if mpath else attr
            base = paths[id(module)]
            out.append((local, module, attr, f"{base}.{attr}" if base else attr))
    return out


# -- timing -----------------------------------------------------------------------------------------


class Busy:
    """Time a rank spends computing (forward and backward passes), summed over `with busy():` blocks;
    CUDA events on GPUs (kernels run asynchronously), the wall clock on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.total = 0.0
        self._events: list = []

    @contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.total += time.perf_counter() - t

    def take(self) -> float:
        """Seconds since the last take (waits for the device)."""
        if self._events:
            torch.cuda.synchronize()
            self.total += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events.clear()
        out, self.total = self.total, 0.0
        return out


class Interval:
    """Mean of a per-step figure since the previous record."""

    def __init__(self):
        self.values: list[float] = []

    def add(self, v: float) -> None:
        self.values.append(v)

    def take(self) -> float | None:
        out = sum(self.values) / len(self.values) if self.values else None
        self.values = []
        return out
