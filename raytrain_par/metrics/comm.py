"""The collectives of one training step: counted as the process groups run them, and predicted from the
layout.

Counted: `CountCollectives` is a torch dispatch mode. Every collective and point-to-point operation of
torch.distributed reaches the dispatcher as a c10d op (`c10d.allreduce_`, `c10d._allgather_base_`,
`c10d._reduce_scatter_base_`, `c10d.send`, ...) whoever calls it: DDP's reducer from C++, FSDP2,
DeepSpeed, torch's pipelining schedules, our own engines. The mode records each one with the bytes of
its whole buffer and the size of its process group (`ProcessGroup.unbox`), whatever the backend.
(torch's profiler names the ops too, but on gloo it records no sizes of groups.)

Bytes of an op are those of the whole buffer it works on: the tensor all-reduced or broadcast, the
gathered output of an all-gather, the input of a reduce-scatter, the tensor sent or received. What
that costs on a link (a ring moves 2 (n - 1) / n of an all-reduce's bytes per rank) is for whoever
prices it.

Predicted: `predicted_step` gives one rank's list from the layout, the plain model and the step's rows,
dimension by dimension: the pipeline's point-to-point messages (from the stages' split and the
schedule's microbatches), the tensor-parallel all-reduces of activations (from the family's plan),
then the data-parallel reduction of the gradients this rank holds, and the scalars of the noise scale
and of clipping's norm. tests/test_comm_counted.py checks predicted = counted for every layout at 2 and
4 gloo ranks, in fp32 and in bf16 (where row-parallel layers' outputs, FSDP's gathered parameters and
DeepSpeed's states travel in 16 bits: `Step`'s widths).
"""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: c10d ops by the collective they run, and which of their tensor arguments is the whole buffer
OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
    "alltoall_base_": ("all_to_all", 1), "reduce_": ("reduce", 0), "gather_": ("gather", 0),
    "scatter_": ("scatter", 1), "barrier": ("barrier", None),
}


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv, ...
    bytes: int  # of the whole buffer (see the module docstring)
    group_size: int
    # predicted ones only: the layout's dimension whose group runs it (dp, tp, pp, world) and what it
    # moves (ROLES), which decide the link it crosses and what computation can hide it (metrics/steptime.py)
    dim: str = field(default="", compare=False)
    role: str = field(default="", compare=False)


#: what a predicted collective moves
ROLES = {
    "gradients": "gradients reduced over the replicas (overlaps the backward pass where the engine buckets them)",
    "parameters": "sharded parameters gathered for a pass (prefetched under the previous unit's computation)",
    "update": "updated parameter partitions gathered after the optimizer step",
    "activations": "activations or their gradients summed over the tensor-parallel group, in the critical path",
    "p2p": "a pipeline stage's activations or gradients sent to its neighbour",
    "tie": "a tied parameter's gradient summed over the pipeline ranks holding it",
    "scalar": "a few numbers: a loss, a norm, the noise scale's sums",
}


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


class CountCollectives(TorchDispatchMode):
    """`with CountCollectives() as c: engine.train_step(batch)`; then `c.collectives`."""

    def __init__(self):
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, rest = str(func).partition(".")
        name = rest.split(".")[0]
        if namespace == "c10d" and name in OPS:
            op, which = OPS[name]
            buffers = [a for a in args if _tensors(a)]
            size = sum(t.numel() * t.element_size() for t in _tensors(buffers[which])) if which is not None else 0
            self.collectives.append(Collective(op, size, _group_size(args)))
        return func(*args, **(kwargs or {}))


def _group_size(args) -> int:
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # another kind of script object (a ReduceOp)
                continue
    raise ValueError("a c10d op without a process group")


def totals(collectives: list[Collective]) -> dict[tuple[str, int], int]:
    """Bytes by (op, group size): what a step moves, whatever the buckets it was cut into."""
    out: Counter = Counter()
    for c in collectives:
        out[(c.op, c.group_size)] += c.bytes
    return dict(out)


# -- predicted ---------------------------------------------------------------------------------------

#: the noise scale's one all-reduce of four fp32 scalars over every rank (strategies/base.py note_noise)
NOISE_BYTES = 4 * 4
#: one fp32 scalar: the step's loss broadcast from a pipeline's last stage, a squared norm summed over a group
SCALAR_BYTES = 4


@dataclass(frozen=True)
class Step:
    """What one optimizer step trains, as far as its collectives depend on it."""

    rows: int  # the global batch
    accumulation: int = 1  # gradient-accumulation steps
    dtype_bytes: int = 4  # of a gradient reduced (and a parameter gathered): 2 for DeepSpeed's 16-bit states
    compute_bytes: int = 4  # of what a matmul outputs: 2 under bf16 / fp16 autocast
    gather_bytes: int | None = None  # of a parameter FSDP gathers, where it differs (a mixed-precision policy)
    measures_noise: bool = False  # the engine measures the gradient noise scale (Engine.measures_noise)
    grad_clip: bool = False  # train.grad_clip > 0: the norm of the whole gradient is summed over groups


def padded_elements(params: list[nn.Parameter], group: int) -> int:
    """Elements of parameters sharded over `group` ranks along their first dimension, each padded to a
    multiple of it (FSDP2's rule)."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        total += math.ceil(rows / group) * group * (p.numel() // max(rows, 1))
    return total


def _elements(params) -> int:
    return sum(p.numel() for p in params)


def _unique(params) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def fsdp_collectives(units: list[list[nn.Parameter]], dp: int, dtype_bytes: int,
                     reshard_after_forward: bool = True, gather_bytes: int | None = None) -> list[Collective]:
    """FSDP2 over `dp` replicas, `units` the parameters of each module sharded apart, the root's last: each
    unit's parameters, padded, all-gathered (at `gather_bytes` an element) for the forward pass and, where
    the unit reshards after it (every unit but the root), again for the backward pass; its gradients
    reduce-scattered once."""
    out = []
    for i, group in enumerate(units):
        elements = padded_elements(group, dp)
        gathers = 1 if i == len(units) - 1 or not reshard_after_forward else 2
        out += ([Collective("all_gather", elements * (gather_bytes or dtype_bytes), dp, "dp", "parameters")] * gathers
                + [Collective("reduce_scatter", elements * dtype_bytes, dp, "dp", "gradients")])
    return out


def tensor_parallel_collectives(layers: list[nn.Module], names: dict[int, str], plan, tokens: int, tp: int,
                                compute_bytes: int, head: bool) -> list[Collective]:
    """Megatron's all-reduces of activations over the `tp` ranks of a tensor-parallel group, for one pass
    of `tokens` tokens through `layers` (plain modules, named by `names`) split by the family's `plan`
    (strategies/tensor_parallel.py): a column-parallel layer's input summed in backward (f), a row-parallel
    layer's output and the vocabulary-parallel embedding's lookup summed in forward (g); with `head`, the
    LM head's input summed in backward and the cross-entropy's three numbers per token (max, target logit,
    sum of exponentials) in forward. A row-parallel layer sums its matmul's output, `compute_bytes` an
    element (16-bit under autocast); the rest is fp32 (the residual stream, the gradients autocast casts
    back to it, the embedding's lookup, the cross-entropy's sums)."""
    out = []
    for layer in layers:
        for module in layer.modules():
            style = next((s for pattern, s in plan.layers.items() if re.fullmatch(pattern, names.get(id(module), ""))),
                         None)
            if style is None:
                continue
            w = module.weight
            conv = type(module).__name__ == "Conv1D"  # transformers' Conv1D keeps its weight [in, out]
            if style in ("colwise", "colwise_qkv"):
                width, size = (w.shape[0] if conv else w.shape[1]), 4
            elif style == "rowwise":
                width, size = (w.shape[1] if conv else w.shape[0]), compute_bytes
            elif style == "vocab" and isinstance(module, nn.Embedding):
                width, size = w.shape[1], 4
            else:  # an untied LM head: below
                continue
            out.append(Collective("all_reduce", tokens * width * size, tp, "tp", "activations"))
    if head:
        hidden = next(m for m in layers[-1].modules() if isinstance(m, nn.Linear)).in_features  # the LM head's
        out.append(Collective("all_reduce", tokens * hidden * 4, tp, "tp", "activations"))
        out += [Collective("all_reduce", tokens * 4, tp, "tp", "activations")] * 3  # fp32, whatever the precision
    return out


def zero_collectives(stage: int, model: nn.Module, dp: int, dtype_bytes: int, zero: dict, accumulation: int = 1
                     ) -> list[Collective]:
    """DeepSpeed's ZeRO over `dp` ranks (`zero`: the zero_optimization section it runs with, zero.py).

    Stages 1 and 2: every gradient all-reduced (stage 1 once a step, stage 2 in each micro-batch's
    backward pass, into the partitions; its buckets are cuts of them: a bucket spanning
    several ranks' partitions is all-reduced, DeepSpeed's `use_multi_rank_bucket_allreduce`); two fp32
    scalars of its step (the overflow check and the gradient norm: two fp32 numbers, or under 16-bit
    states a byte and an fp64 number); after the step, each parameter
    group's updated partitions all-gathered, the group's flat buffer padded to a multiple of 2 x dp
    elements (its `nccl_start_alignment_factor`).

    Stage 3: parameters of fewer elements than `stage3_param_persistence_threshold` stay whole on every
    rank and are all-gathered one by one after the step; the others, each padded to a multiple of dp,
    all-gathered for each micro-batch's forward pass and, where DeepSpeed releases them before the
    backward pass (their total beyond `stage3_max_reuse_distance`), again for it; every gradient,
    padded, reduce-scattered in each micro-batch's backward pass; two 8-byte scalars of its step.
    (Counted on gpt2-tiny, whose parameters all stay gathered between the passes; the released case
    follows DeepSpeed's rule, not a count.)"""
    from ..strategies.optim import parameter_groups

    params = _unique(model.parameters())
    if stage < 3:
        out = ([Collective("all_reduce", _elements(params) * dtype_bytes, dp, "dp", "gradients")]
               * (accumulation if stage == 2 else 1))
        out += [Collective("all_reduce", n, dp, "dp", "scalar") for n in ((4, 4) if dtype_bytes == 4 else (1, 8))]
        align = 2 * dp
        for group in parameter_groups(model, 1.0):
            if group["params"]:
                out.append(Collective("all_gather", math.ceil(_elements(group["params"]) / align) * align
                                      * dtype_bytes, dp, "dp", "update"))
        return out
    threshold = zero.get("stage3_param_persistence_threshold", 100_000)
    padded = [math.ceil(p.numel() / dp) * dp for p in params]
    gathered = sum(n for p, n in zip(params, padded) if p.numel() >= threshold)
    gathers = 1 if gathered <= zero.get("stage3_max_reuse_distance", 1e9) else 2
    out = ([Collective("all_gather", gathered * dtype_bytes, dp, "dp", "parameters")] * gathers
           + [Collective("reduce_scatter", sum(padded) * dtype_bytes, dp, "dp", "gradients")]) * accumulation
    out += [Collective("all_reduce", 8, dp, "dp", "scalar")] * 2
    out += [Collective("all_gather", n * dtype_bytes, dp, "dp", "update") for p, n in zip(params, padded)
            if p.numel() < threshold]
    return out


def predicted_step(layout, model: nn.Module, step: Step, rank: int = 0, split_points: list[int] | None = None,
                   balance: str = "flops", reshard_after_forward: bool = True, zero: dict | None = None,
                   split: tuple | None = None, shard: tuple | None = None) -> list[Collective]:
    """The collectives rank `rank` runs in one training step (after the first two, whose DDP bucket order
    is rebuilt) of `model` (the plain model; on the meta device is enough) under `layout`:

    - pipeline (P > 1; stages.Pipeline's split, by `split_points` or balanced by `balance`): per
      microbatch of each accumulation step, every stage boundary's activation sent forward and its
      gradient sent back, over the pipeline group; the tied embedding's gradient summed over the ranks
      holding a copy (PipeDream's asynchronous schedules: sent to the first stage, the sum sent back);
      the step's loss broadcast from the last stage;
    - tensor parallel (T > 1): the activation all-reduces of this rank's layers, per accumulation step
      (and microbatch), `tensor_parallel_collectives`;
    - data parallel over the D replicas of this rank's parameters (those of its stages, of its tensor
      parallel shard): sharding none, every gradient all-reduced once (DDP's buckets and the pipeline's
      all-reduce per tensor are cuts of it); fsdp, `fsdp_collectives` over the modules FSDP shards apart
      (fsdp.shard_units, then the root) or, with stages, over each layer of a stage, then the stage;
      zero-1/2/3, `zero_collectives` (`zero`: DeepSpeed's zero_optimization section);
    - the noise scale's four scalars over every rank where it is measured; and where gradients are
      clipped and no rank holds the whole gradient, its squared norm summed over each group that splits it.

    `split` (`stages.split_model`'s answer) and `shard` (`_tensor_parallel_shard`'s): where the caller has them
    already, as `each_pipeline_rank` has (each costs a pass over the whole model).
    """
    from ..models import pipeline_layers, tensor_parallel_plan_of
    from ..strategies.fsdp import shard_units
    from ..strategies.stages import split_model

    P, T, D = layout.pipeline, layout.tensor, layout.data
    if layout.sharding.startswith("zero"):
        out = zero_collectives(int(layout.sharding[-1]), model, D, step.dtype_bytes, zero or {},
                               step.accumulation) if D > 1 else []
        return out + ([Collective("all_reduce", NOISE_BYTES, layout.world, "world", "scalar")]
                      if step.measures_noise else [])
    coords, b = layout.coordinates(rank), step.dtype_bytes
    names = {id(m): n for n, m in model.named_modules()}
    plan = tensor_parallel_plan_of(model) if T > 1 else None
    tokens_per_row = math.prod(model.input_shape)
    rows = step.rows // D // step.accumulation  # of one accumulation step of one replica
    plain_layers = pipeline_layers(model)
    whole, layers = shard or _tensor_parallel_shard(model, T)  # what this rank holds (the plain model where T = 1)
    out: list[Collective] = []
    if P > 1:
        stages = P * layout.virtual_stages
        owner = {s: p for p in range(P) for s in layout.stages_of(p)}
        _, ranges, outputs = split or split_model(model, stages, split_points, balance)
        local = layout.stages_of(coords.pipeline)
        micro, passes = rows // layout.microbatches, layout.microbatches * step.accumulation
        for s in local:
            for neighbour, sent in ((s - 1, outputs[s - 1] if s else None), (s + 1, outputs[s])):
                if 0 <= neighbour < stages and owner[neighbour] != coords.pipeline:
                    size = micro * math.prod(sent[0]) * sent[1].itemsize
                    out += [Collective("send", size, P, "pp", "p2p"), Collective("recv", size, P, "pp", "p2p")] * passes
            if T > 1:
                out += tensor_parallel_collectives(plain_layers[slice(*ranges[s])], names, plan,
                                                   micro * tokens_per_row, T, step.compute_bytes,
                                                   s == stages - 1) * passes
        held = [_unique(p for layer in layers[slice(*ranges[s])] for p in layer.parameters()) for s in range(stages)]
        holders: dict[int, set[int]] = {}
        for s, stage in enumerate(held):
            for p in stage:
                holders.setdefault(id(p), set()).add(owner[s])
        for p in _unique(p for s in local for p in held[s]):
            if len(holders[id(p)]) > 1:  # tied across pipeline ranks: one copy's gradient per rank, summed
                elements = padded_elements([p], D) // D if layout.sharding == "fsdp" else p.numel()  # (its slice)
                # PipeDream: the last stage sends its half, the first sends the sum back
                ops = ("send", "recv") if layout.asynchronous else ("all_reduce",)
                out += [Collective(op, elements * b, len(holders[id(p)]), "pp", "tie") for op in ops]
        params = [p for s in local for p in held[s]]  # a tied parameter's copy on each stage
        # FSDP's units under a pipeline: each layer of a stage, then the stage (which owns none of its own)
        units = [list(layer.parameters()) for s in local for layer in layers[slice(*ranges[s])]]
    else:
        if T > 1:
            out += tensor_parallel_collectives(plain_layers, names, plan, rows * tokens_per_row, T,
                                               step.compute_bytes, True) * step.accumulation
        params = _unique(whole.parameters())
        unit_modules = shard_units(whole) if layout.sharding == "fsdp" else []
        owned = {id(p) for u in unit_modules for p in u.parameters()}
        units = [list(u.parameters()) for u in unit_modules] + [[p for p in params if id(p) not in owned]]

    if D > 1 and layout.sharding == "none":
        out.append(Collective("all_reduce", _elements(params) * b, D, "dp", "gradients"))
    elif D > 1 and layout.sharding == "fsdp" and P > 1:
        # torch's schedules drive FSDP themselves: a unit is gathered for each microbatch's forward pass
        # (and resharded after it), once for the backward passes, kept until the last of them; the
        # gradients reduce-scattered once per run of the schedule
        for group in units:
            if group:
                elements = padded_elements(group, D)
                out += ([Collective("all_gather", elements * (step.gather_bytes or b), D, "dp", "parameters")]
                        * (layout.microbatches + 1)
                        + [Collective("reduce_scatter", elements * b, D, "dp", "gradients")]) * step.accumulation
    elif D > 1 and layout.sharding == "fsdp":
        out += fsdp_collectives(units, D, b, reshard_after_forward, step.gather_bytes)
    if P > 1:
        out.append(Collective("broadcast", SCALAR_BYTES, P, "pp", "scalar"))
    if step.measures_noise:
        out.append(Collective("all_reduce", NOISE_BYTES, layout.world, "world", "scalar"))
    if step.grad_clip:
        out += [Collective("all_reduce", SCALAR_BYTES, n, dim, "scalar") for n, dim, split in
                ((T, "tp", T > 1), (D, "dp", layout.sharding == "fsdp" and D > 1), (P, "pp", P > 1)) if split]
    return out


def each_pipeline_rank(layout, model: nn.Module, step: Step, split_points: list[int] | None = None,
                       balance: str = "flops", zero: dict | None = None) -> list[list[Collective]]:
    """`predicted_step` of each pipeline rank (its first data-parallel and tensor rank), the stage split and the
    tensor-parallel shard worked out once for all of them: each is a pass over the whole model."""
    from ..strategies.stages import split_model

    split = shard = None
    if layout.pipeline > 1:
        split = split_model(model, layout.pipeline * layout.virtual_stages, split_points, balance)
        shard = _tensor_parallel_shard(model, layout.tensor)
    return [predicted_step(layout, model, step, layout.rank_of(p, 0, 0), split_points, balance, zero=zero,
                           split=split, shard=shard) for p in range(layout.pipeline)]


def _tensor_parallel_shard(model: nn.Module, tp: int) -> tuple[nn.Module, list[nn.Module]]:
    """One tensor-parallel rank's model and pipeline layers: for `tp` > 1 a copy split as megatron's
    stages split it (megatron_pipeline.split_shapes); the model itself where tp = 1."""
    from .. import models

    if tp == 1:
        return model, models.pipeline_layers(model)
    from ..strategies.megatron_pipeline import split_shapes

    copied = copy.deepcopy(model)
    split_shapes(copied, tp)
    return copied, models.pipeline_layers(copied)
