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

Predicted: `predicted_step` gives the same list from the layout, the model's parameters and how the
engine groups them, for the layouts written so far (data parallel without sharding, and FSDP's).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

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


def padded_elements(params: list[nn.Parameter], group: int) -> int:
    """Elements of parameters sharded over `group` ranks along their first dimension, each padded to a
    multiple of it (FSDP2's rule)."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        total += math.ceil(rows / group) * group * (p.numel() // max(rows, 1))
    return total


def predicted_step(layout, model: nn.Module, units: list[nn.Module] | None, dtype_bytes: int, world: int,
                   measures_noise: bool, reshard_after_forward: bool = True) -> list[Collective]:
    """The collectives of one training step (after the first, whose DDP bucket order is rebuilt) of a
    data-parallel layout over `layout.data` replicas:

    - sharding none (DDP): the gradients all-reduced once, every parameter once (buckets are a cut of
      them, not a copy);
    - sharding fsdp (FSDP2, `units` the modules sharded apart, the rest the root's): each unit's
      parameters, padded, all-gathered for the forward pass and, where the unit reshards after it
      (every unit but the root), again for the backward pass; its gradients reduce-scattered once;

    and, where the engine measures the noise scale, one all-reduce of its four scalars over every rank."""
    dp = layout.data
    params = list(dict.fromkeys(model.parameters()))
    out: list[Collective] = []
    if layout.sharding == "none" and layout.tensor == layout.pipeline == 1:
        if dp > 1:
            out.append(Collective("all_reduce", sum(p.numel() for p in params) * dtype_bytes, dp))
    elif layout.sharding == "fsdp" and layout.tensor == layout.pipeline == 1:
        owned = {p for u in units for p in u.parameters()}
        groups = [list(u.parameters()) for u in units] + [[p for p in params if p not in owned]]
        for i, group in enumerate(groups):
            size = padded_elements(group, dp) * dtype_bytes
            root = i == len(groups) - 1
            gathers = 1 if root or not reshard_after_forward else 2
            out += [Collective("all_gather", size, dp)] * gathers + [Collective("reduce_scatter", size, dp)]
    else:
        raise NotImplementedError(f"no prediction yet for the layout {layout.describe()}")
    if measures_noise:
        out.append(Collective("all_reduce", NOISE_BYTES, world))
    return out
