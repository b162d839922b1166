"""Run a function on N local processes joined in one torch.distributed process group, and collect
what each rank returns: how the strategies' math is tested in seconds, and how the benchmarks
measure strategies in plain process groups, without Ray.

Written here because torch.multiprocessing.spawn neither returns the ranks' results nor reports
every failing rank's traceback; real runs get their process groups from Ray Train.

Ranks start from a fork server that has imported torch, transformers' GPT-2, DeepSpeed and this
package once (multiprocessing's "forkserver" start method with preloaded modules): a process
started the plain way pays seconds of imports each time, which made the start-up most of a short
test's time. The fork server is a fresh interpreter, not a fork of the caller, so threads or
connections the caller holds (a Ray driver's, say) are not copied into the ranks.
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the fork server imports once, so that its ranks start with them imported (one that fails to
#: import, DeepSpeed where it is not installed say, is skipped by multiprocessing)
PRELOAD = ["torch", "torch.distributed", "transformers.models.gpt2.modeling_gpt2", "deepspeed",
           "raytrain_par.worker", "raytrain_par.strategies"]


def _context(backend: str, fresh: bool):
    """The fork server's context for CPU groups where the platform has one (Linux, macOS), else plain
    spawning. Not for GPU groups: DeepSpeed's import asks CUDA for its devices, and a process forked
    after that cannot use CUDA."""
    import multiprocessing

    if fresh or backend != "gloo" or "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first rank started
    return ctx


def _entry(rank, world, port, backend, threads, group_of_one, fn, args, queue, environ):
    # The fork server's environment is the caller's when the server started: take the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if world > 1 or group_of_one:
            dist.init_process_group(backend, rank=rank, world_size=world)
        buf = io.BytesIO()  # tensors travel as bytes: a queue would share them through the child's memory
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, backend: str = "gloo", threads: int = 1, group_of_one: bool = False,
              timeout: float = 300.0, fresh: bool = False) -> list:
    """fn(rank, world, *args) on `world` new processes (`fn` must be importable, i.e. defined at
    module level); returns the results ordered by rank, or raises with every failing rank's
    traceback. A group is initialised when world > 1, or always with `group_of_one`. `fresh`: new
    interpreters that import everything themselves (not from the fork server), for measuring a
    process as a real worker starts it: its peak memory, or what its first use of something costs."""
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the fork server imports DeepSpeed
    ctx = _context(backend, fresh)
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, threads, group_of_one, fn, args, queue,
                                              environ))
             for r in range(world)]
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
