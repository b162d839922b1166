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
import time
import traceback
from queue import Empty

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
    store = None
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if world > 1 or group_of_one:
            store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        buf = io.BytesIO()  # tensors travel as bytes: a queue would share them through the child's memory
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if store is not None:
            _leave(store, rank, world)
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave(store, rank: int, world: int, wait: float = 60.0) -> None:
    """The group's store lives in rank 0's process: rank 0 stays until every rank is through (or
    `wait` seconds), so that a rank still making groups when rank 0 is done does not lose the store.
    gloo's new_group returns at once on the ranks outside the group, so ranks finish at different times."""
    store.add("run_ranks/through", 1)
    deadline = time.monotonic() + wait
    while rank == 0 and store.add("run_ranks/through", 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def run_ranks(world: int, fn, *args, backend: str = "gloo", threads: int = 1, group_of_one: bool = False,
              timeout: float = 1200.0, fresh: bool = False) -> list:
    """fn(rank, world, *args) on `world` new processes (`fn` must be importable, i.e. defined at
    module level); returns the results ordered by rank, or raises with every failing rank's
    traceback. A group is initialised when world > 1, or always with `group_of_one`. `fresh`: new
    interpreters that import everything themselves (not from the fork server), for measuring a
    process as a real worker starts it: its peak memory, or what its first use of something costs."""
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the fork server imports DeepSpeed
    ctx = _context(backend, fresh)
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, threads, group_of_one, fn, args, queue,
                                              environ))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = _collect(queue, procs, timeout)
    except BaseException:  # a failure, or the caller's own time-out: the other ranks would wait for good
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def _collect(queue, procs: list, timeout: float) -> list:
    """Each rank's result from `queue`, in rank order; raises with every failing rank's traceback, or
    naming the ranks that died without a word or gave nothing within `timeout` seconds. Waits a second
    at a time, so that a signal (pytest's time-out) reaches this thread while the ranks run."""
    world = len(procs)
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline, gone = time.monotonic() + timeout, set()
    while len(results) + len(errors) < world:
        try:
            rank, status, value = queue.get(timeout=1.0)
        except Empty:
            waiting = [r for r in range(world) if r not in results and r not in errors]
            dead = [r for r in waiting if procs[r].exitcode is not None and r in gone]
            gone |= {r for r in waiting if procs[r].exitcode is not None}  # its last words may be in flight
            if dead or time.monotonic() > deadline:
                raise AssertionError("\n".join([*(errors[r] for r in sorted(errors)), *(
                    f"rank {r}: exited with code {procs[r].exitcode} and no result" if r in dead else
                    f"rank {r}: no result within {timeout:.0f} s" for r in waiting)]))
            continue
        if status == "error":
            errors[rank] = f"rank {rank}:\n{value}"
        else:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    if errors:
        raise AssertionError("\n".join(errors[r] for r in sorted(errors)))
    return [results[r] for r in range(world)]
