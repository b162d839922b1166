"""Where a step's time goes: the share of it spent waiting for communication that nothing hid.

Communication that runs while the step computes (DDP's all-reduce of one bucket during the backward
pass of the next, FSDP's prefetched all-gathers) costs nothing; what shows in the step time is the
*exposed* part: time during which collectives are in flight and no computation is. It is measured
on a sampled step with torch's profiler, from the intervals it records:

- communication: the collectives as they execute -- gloo's `gloo:<op>` spans on its worker threads
  (CPU), NCCL kernels on the device (GPU);
- computation: operator spans (`aten::*`) on the threads that train -- every thread that runs no
  collective -- on CPU; every other device kernel on GPU.

Exposed communication is the time covered by the first and not by the second. On CPU the training
thread leaves short gaps between operators (Python between two calls, tens of microseconds); gaps
shorter than `GAP_S` count as computation, so that only real waits count as exposed. Any strategy,
any collective library torch profiles; a strategy is not asked what it communicates.
"""

from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager
from typing import Iterable

import torch

GAP_S = 200e-6  # CPU: gaps between one thread's operators shorter than this are the thread's own glue
_COMM = re.compile(r"^(gloo|nccl|mpi|ucc):|nccl.*kernel|ncclDevKernel", re.IGNORECASE)

Interval = tuple[float, float]


def union(intervals: Iterable[Interval], gap: float = 0.0) -> list[Interval]:
    """Sorted, merged intervals; intervals less than `gap` apart are merged too."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def uncovered(of: list[Interval], by: list[Interval]) -> float:
    """Total length of the merged intervals `of` not covered by the merged intervals `by`."""
    total, j = 0.0, 0
    for a, b in of:
        cursor = a
        while j < len(by) and by[j][1] <= cursor:
            j += 1
        k = j
        while k < len(by) and by[k][0] < b:
            if by[k][0] > cursor:
                total += by[k][0] - cursor
            cursor = max(cursor, by[k][1])
            k += 1
        total += max(0.0, b - cursor)
    return total


def is_communication(name: str) -> bool:
    return bool(_COMM.search(name))


def exposed_communication(events, device_type: str) -> dict[str, float]:
    """{comm_s: time with collectives in flight, exposed_comm_s: of it, time with no computation}
    from a profiler's events (`prof.events()`), in seconds."""
    comm, compute = [], []
    on_device = device_type == "cuda"
    comm_threads = set()
    spans = []
    for e in events:
        r = e.time_range
        span = (r.start * 1e-6, r.end * 1e-6)
        device_event = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_device != device_event:
            continue
        if is_communication(e.name):
            comm.append(span)
            comm_threads.add(e.thread)
        else:
            spans.append((e, span))
    for e, span in spans:
        if on_device or (e.thread not in comm_threads and e.name.startswith("aten::")):
            compute.append(span)
    comm_u = union(comm)
    compute_u = union(compute, gap=0.0 if on_device else GAP_S)
    return {"comm_s": length(comm_u), "exposed_comm_s": uncovered(comm_u, compute_u)}


@contextmanager
def profiled_step(device: torch.device):
    """Profile what runs inside; yields a dict that holds, afterwards, step_s, comm_s, exposed_comm_s
    and comm_fraction (exposed / step)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out: dict[str, float] = {}
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        yield out
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
    out.update(exposed_communication(prof.events(), device.type), step_s=step_s)
    out["comm_fraction"] = min(1.0, out["exposed_comm_s"] / step_s) if step_s > 0 else None


def warm_up_profiler(device: torch.device) -> None:
    """Start and stop the profiler once over nothing: its first use allocates what it keeps for the
    rest of the process (about 22 MB of host memory on CPU), which should happen at start-up, not in
    the middle of training where memory accounting would count it.

    Kineto's first start in a thread other than the one that imported torch (Ray Train runs the
    training function in a thread of its own) writes "ERROR: External init callback must run in same
    thread as registerClient" straight to the process's stderr, harmlessly: the profile is complete.
    The warm-up is that first start, so its stderr goes to /dev/null for those milliseconds."""
    with _stderr_to_devnull(), profiled_step(device):
        pass


@contextmanager
def _stderr_to_devnull():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
