"""Run a function on N ranks of a local gloo process group (torch.multiprocessing): how strategy
math is tested in seconds, without Ray."""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_par.metrics.memory import MALLOC_ENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        buf = io.BytesIO()  # tensors travel as bytes: a queue would share them through the child's memory
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 300.0) -> list:
    """fn(rank, world, *args) on `world` processes; returns the results ordered by rank.
    `fn` must be importable (defined at module level)."""
    ctx = mp.get_context("spawn")
    os.environ.update(MALLOC_ENV)  # read by each child's C library at start-up (memory accounting)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in range(world):
        rank, status, value = queue.get()
        if status == "error":
            errors.append(f"rank {rank}:\n{value}")
        else:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    for p in procs:
        p.join(timeout)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
