"""One training step's time predicted for a layout on a device (devices.py) that need not be here: its
computation, the communication no computation hides, and the pipeline's bubble.

- Compute: the step's model FLOPs (metrics/flops.py, counted on the meta device; with activation
  checkpointing the checkpointed modules' forward pass again, counted the same way) split evenly over
  the workers, at the device's peak for the run's precision times its achievable fraction.
  Beside them, the device's per-step overhead (Device.step_overhead_s: the optimizer's update and each
  operator's dispatch, whatever the batch), which hides no communication.
- Communication: the step's collectives as comm.py predicts them for the layout (the bytes our
  engines send, checked against counts on gloo), each costed on the link its group crosses: inside a
  node where all its ranks share one (`gpus_per_node` consecutive ranks a node), else across nodes.
  Ring algorithms with an alpha-beta cost (Thakur et al. 2005; NCCL's rings): an all-reduce moves
  2 (n - 1) / n of its buffer through each rank in 2 (n - 1) steps, an all-gather or reduce-scatter
  (n - 1) / n in n - 1 steps, a send its buffer in one.
  On a device whose collectives do not all reach the all-reduce's bandwidth (gloo's all-gather and
  reduce-scatter), each op's time is that times the device's measured factor for the op.
- What hides it: gradients reduced by bucket during the backward pass (DDP, FSDP, ZeRO with
  overlap_comm: every layout without pipeline stages) hide behind the backward pass (two thirds of
  the computation); FSDP's and ZeRO-3's parameter gathers, prefetched, behind the rest of the
  computation. Tensor-parallel all-reduces sit in the critical path, so do the pipeline's reductions
  after its flush, updates gathered after the optimizer step and scalars. A pipeline's messages
  overlap the other microbatches' computation but for the fill and the drain: 2 (P - 1) messages.
  PipeDream sums its tied embedding's gradient by a send and a receive per step, exposed.
- Bubble: (P - 1) / (V M) of the computation for P stages of V virtual stages each and M
  microbatches (GPipe, 1F1B, interleaved 1F1B: Narayanan et al. 2021); the zero-bubble schedules
  are taken at none, which is what they approach. PipeDream's schedules never flush, but our engine
  ends each step on the last stage's loss (strategies/pipedream.py), so the next step's first
  microbatch refills the stages' forward passes: (P - 1) microbatches' forward passes, (P - 1) / (3 M)
  of the computation (a forward pass is a third of a microbatch's), and P - 1 of its messages exposed.
  Where workers share cores (a CPU with more ranks than cores: Device.cores_share s < 1), the ranks
  waiting in the fill and drain leave their cores to those computing, on average half of them (k of
  P stages at the fill's k-th slot): the bubble's computation runs at min(1, 2 s) of a core, not s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .comm import Collective, Step, each_pipeline_rank

#: of forward + backward: the backward pass (two matmuls per forward one), and a recomputed forward
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per direction
    latency_s: float  # per step of a ring
    factors: dict = field(default_factory=dict)  # an op's time over the ring model's (Device.collective_factors)


def collective_seconds(c: Collective, link: Link) -> float:
    """Ring alpha-beta time of one collective over `link` (`c.bytes`: its whole buffer), times the link's
    factor for the op where it has one."""
    return _ring_seconds(c, link) * link.factors.get(c.op, 1.0)


def _ring_seconds(c: Collective, link: Link) -> float:
    n = c.group_size
    if n <= 1 and c.op not in ("send", "recv"):
        return 0.0
    if c.op == "all_reduce":
        return 2 * (n - 1) / n * c.bytes / link.bandwidth + 2 * (n - 1) * link.latency_s
    if c.op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * c.bytes / link.bandwidth + (n - 1) * link.latency_s
    if c.op == "broadcast":  # pipelined along the ring
        return c.bytes / link.bandwidth + (n - 1) * link.latency_s
    if c.op == "send":
        return c.bytes / link.bandwidth + link.latency_s
    if c.op == "recv":  # the other end of a neighbour's send, at the same time
        return 0.0
    raise ValueError(f"no cost model for {c.op}")


def group_crosses_nodes(layout, dim: str, gpus_per_node: int) -> bool:
    """Whether the group along `dim` of rank 0 (every group of a dimension alike: ranks are placed
    uniformly, layout.py) spans more than one node of `gpus_per_node` consecutive ranks."""
    P, D, T = layout.pipeline, layout.data, layout.tensor
    if dim == "tp":
        members = [layout.rank_of(0, 0, t) for t in range(T)]
    elif dim == "dp":
        members = [layout.rank_of(0, d, 0) for d in range(D)]
    elif dim == "pp":
        members = [layout.rank_of(p, 0, 0) for p in range(P)]
    else:
        members = range(layout.world)
    return len({r // gpus_per_node for r in members}) > 1


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # this worker's share of the step's FLOPs at the achievable rate, and the per-step overhead
    comm_s: float  # every collective's time, hidden or not
    exposed_comm_s: float  # what no computation hides
    bubble_s: float
    flops_per_step: float  # model FLOPs of the step, all workers (without recomputation)
    bytes_per_step: float  # of the slowest rank's collectives

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s


def step_time(layout, model, step: Step, flops_per_step: float, device, precision: str,
              recomputed_flops: float = 0.0, zero: dict | None = None, split_points=None, balance: str = "flops"
              ) -> StepTime:
    """The predicted step of `layout` (see the module docstring): the slowest pipeline rank's, each
    pipeline rank (its first data-parallel and tensor rank) predicted apart."""
    return timed(layout, rank_collectives(layout, model, step, zero, split_points, balance), flops_per_step, device,
                 precision, recomputed_flops)


def rank_collectives(layout, model, step: Step, zero: dict | None = None, split_points=None, balance: str = "flops"
                     ) -> list[list[Collective]]:
    """Each pipeline rank's collectives of one step (its first data-parallel and tensor rank): what
    `timed` costs on a device. The device does not change them; a model of many ranks takes seconds."""
    return each_pipeline_rank(layout, model, step, split_points, balance, zero=zero)


def timed(layout, by_rank: list[list[Collective]], flops_per_step: float, device, precision: str,
          recomputed_flops: float = 0.0) -> StepTime:
    """`rank_collectives`' collectives and the step's FLOPs on `device` (with `recomputed_flops`, what
    activation checkpointing runs again: metrics/flops.py counts it): the slowest pipeline rank's step."""
    rate = device.peak(precision) * device.achievable
    work = flops_per_step + recomputed_flops
    compute = work / layout.world / rate
    P = layout.pipeline
    bubble = 0.0
    if P > 1 and layout.schedule not in ("zero-bubble", "zbv"):
        bubble = compute * (P - 1) / (layout.virtual_stages * layout.microbatches)
        if layout.asynchronous:  # the forward passes' refill after each step's loss (the module docstring)
            bubble *= 1 - BACKWARD_SHARE
        if device.cores_share < 1:  # the waiting half's cores go to the computing half (the module docstring)
            bubble *= device.cores_share / min(1.0, 2 * device.cores_share)
    fills = (P - 1) * (1 if layout.asynchronous else 2)
    factors = device.collective_factors
    links = {dim: (Link(device.inter_node_bw, device.inter_node_latency_s, factors)
                   if group_crosses_nodes(layout, dim, device.gpus_per_node)
                   else Link(device.intra_node_bw, device.intra_node_latency_s, factors))
             for dim in ("dp", "tp", "pp", "world")}
    worst = None
    for collectives in by_rank:
        total, exposed, size = _costed(collectives, links, compute, P, device.overlaps_communication, fills)
        if worst is None or exposed > worst[1]:
            worst = (total, exposed, size)
    total, exposed, size = worst
    return StepTime(compute + device.step_overhead_s, total, exposed, bubble, flops_per_step, size)


def _costed(collectives: list[Collective], links: dict[str, Link], compute: float, P: int, overlaps: bool = True,
            fills: int = 0) -> tuple[float, float, float]:
    """(all communication, the part no computation hides, bytes) of one rank's collectives (`fills`: the
    pipeline's messages no other microbatch's computation hides); on a device that does not overlap
    communication with computation, all of it."""
    gradients = gathers = exposed = 0.0
    sends = []
    for c in collectives:
        t = collective_seconds(c, links[c.dim or "world"])
        if c.role == "gradients" and P == 1:
            gradients += t
        elif c.role == "parameters" and P == 1:
            gathers += t
        elif c.role == "p2p":
            sends.append(t)
        else:
            exposed += t
    # Gradients hide behind the backward pass, gathers behind any computation: beyond either, exposed.
    hidden_beyond = max(0.0, gradients - compute * BACKWARD_SHARE, gradients + gathers - compute)
    # A pipeline's messages cross while other microbatches compute, but for the fill and the drain.
    pipeline = fills * max(sends, default=0.0)
    if not overlaps:
        hidden_beyond, pipeline = gradients + gathers, sum(sends)
    return gradients + gathers + exposed + sum(sends), exposed + hidden_beyond + pipeline, \
        float(sum(c.bytes for c in collectives))


def tokens_per_second(rows: int, tokens_per_row: int, t: StepTime) -> float:
    return rows * tokens_per_row / t.step_s


def tflops_per_gpu(t: StepTime, workers: int) -> float:
    """Model TFLOP/s each worker achieves (recomputation not counted, as MFU does not)."""
    return t.flops_per_step / workers / t.step_s / 1e12


def mfu(t: StepTime, workers: int, peak_flops: float) -> float:
    return t.flops_per_step / workers / t.step_s / peak_flops
