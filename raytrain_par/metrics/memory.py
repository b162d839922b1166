"""Per-worker memory: model states actually held, peak process (or device) memory, and theory.

Two counts of model states, for two questions:

- *Held* (`mem_model_state_bytes`): what the allocator has handed out and not taken back, at the
  moment model states peak (after the optimizer step, before gradients are freed), minus what was
  in use before the engine existed. On GPUs that is `torch.cuda.memory_allocated`; on CPU it is
  glibc's `mallinfo2` (bytes in use in the heap plus mmapped blocks). It counts what no Python
  object points at: DDP's gradient buckets, DeepSpeed's flat buffers and partitions, FSDP's
  unsharded copies. The count is of bytes in use, not of memory glibc keeps cached after a free,
  so it needs no allocator setting. Only the peak resident memory (`mem_peak_bytes`) is blurred by
  that cache; `return_freed_memory()` sends every later block of 64 KiB or more to an mmap of its
  own that goes back to the system when freed. It is not on by default: an mmap per tensor costs
  page faults on every step (+18% step time measured on a 2-core CPU), so only the memory
  benchmark switches it on. Training workers go the other way by default (CACHING_ALLOCATOR_ENV).
- *Census* (`mem_param_bytes`, `mem_grad_bytes`, `mem_optim_bytes`): the storages behind live
  tensors that an engine can name (parameters, gradients, optimizer state), each storage once
  however many views point into it, so a gradient that is a view into DDP's bucket counts the
  bucket, and a tied weight counts once. It tells where the bytes are; the held count tells how many.

`model_state_theory` gives the textbook bytes per parameter (Rajbhandari et al., ZeRO, 2020).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
from dataclasses import dataclass
from typing import Iterable

import torch



def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (skipping those already in `seen`)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def model_state_census(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None,
                       extra_grads: Iterable[torch.Tensor] = (), extra_params: Iterable[torch.Tensor] = (),
                       extra_optim: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """{mem_param_bytes, mem_grad_bytes, mem_optim_bytes} from live tensors. `extra_*`: tensors an
    engine keeps outside the parameters' `.grad` and the optimizer's state (flat buffers, master
    copies, partitions)."""
    params = list(params)
    seen: set[int] = set()
    p = storage_bytes(params + list(extra_params), seen)
    g = storage_bytes([q.grad for q in params] + list(extra_grads), seen)
    o = storage_bytes(list(optimizer_tensors(optimizer)) if optimizer is not None else [], seen)
    o += storage_bytes(extra_optim, seen)
    return {"mem_param_bytes": p, "mem_grad_bytes": g, "mem_optim_bytes": o}


# -- what the allocator holds ------------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc (macOS, musl) or glibc < 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2() if sys.platform.startswith("linux") else None


def heap_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (all arenas + mmapped blocks); None off glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX, _DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024

# A caching host allocator for CPU workers, in the environment a worker process starts with (glibc
# reads MALLOC_* once, at start). With glibc's defaults a block of 32 MiB or more (a GPT-2's logits
# and their gradient: batch x tokens x vocabulary floats) is an mmap of its own, unmapped when freed,
# and every step faults its pages in again, zeroed: 70,000 page faults a step on the quickstart's
# model, a quarter to a third of its step time on a 2-core CPU. torch keeps no cache of host memory the way its
# CUDA allocator does, so the C heap keeps it instead: no mmaps (MMAP_MAX 0), never trimmed (TRIM
# huge), and one arena (ARENA_MAX 1), because Ray Train runs the training function in a thread of
# its own and glibc gives such a thread a secondary arena, whose heaps (64 MiB at most) it shrinks
# on its own. Measured in benchmarks/overhead.py. The cost is peak resident memory: the heap keeps
# freed blocks between live ones, which mappings would have returned (more for pipelines, whose
# micro-batches free tensors of many sizes in between). `scaling.host_allocator: system` leaves
# glibc's defaults; the memory experiments set it.
CACHING_ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**62)}

# The other way: every block of 64 KiB or more an mmap of its own, unmapped when freed (a fixed
# threshold, which also stops glibc raising it by itself after the first large free, as it does by
# default up to 32 MiB). Under glibc's defaults a sharded engine's steps leave the heap fragmented: FSDP
# all-gathers each unit, makes its whole gradients and frees them between the long-lived shards of
# the gradient, and the heap keeps the holes -- on 4 ranks of a 316M-parameter GPT-2, 2.3 GB resident
# for 1.0 GB in use (benchmarks/host_memory.py). The cost is page faults on every step (+18% step time
# for DDP on a 2-core CPU). `scaling.host_allocator: returning`; the environment form of
# `return_freed_memory`.
RETURNING_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _mallopt(*settings: tuple[int, int]) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return all([libc.mallopt(param, value) for param, value in settings])  # each one, even after a refusal
    except (OSError, AttributeError):
        return False


def return_freed_memory(threshold: int = 65536) -> bool:
    """From now on, allocations of `threshold` bytes or more get an mmap of their own, returned to
    the system when freed, so that peak resident memory follows what is in use (glibc's run-time
    form of MALLOC_MMAP_THRESHOLD_; it also stops glibc raising the threshold by itself, and undoes
    CACHING_ALLOCATOR_ENV's no-mmap and no-trim settings). False where the C library has no mallopt
    (not glibc)."""
    return _mallopt((_M_MMAP_MAX, _DEFAULT_MMAP_MAX), (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD),
                    (_M_MMAP_THRESHOLD, threshold))


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes allocated on `device` right now: CUDA's allocator on GPUs, the C heap on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return heap_in_use_bytes()


def held_bytes(device: torch.device) -> int | None:
    """`allocated_bytes` once Python's cycle collector has run. Tensors that only reference cycles still
    point at (an autograd graph, an engine's internal objects) are garbage, not model state, and when
    the collector frees them depends on the process's whole allocation history: the same ZeRO-2 step
    counted 125 MB in a process of its own and 159 MB among other tests (and 137 MB with the collector
    off). Collected first, the count is what live objects hold. The collection is cheap once
    `settle_collector` has run: it scans only the objects made since."""
    gc.collect()
    return allocated_bytes(device)


def settle_collector() -> None:
    """A full collection, then every object alive moved to the collector's permanent generation
    (gc.freeze): the modules imported so far and the objects they made, half a million with torch,
    DeepSpeed and transformers, are not scanned again, and each later full collection (`held_bytes`)
    takes under a millisecond instead of a quarter of a second. Frozen objects are still freed when
    nothing refers to them; only a reference cycle among them that later becomes garbage is kept.
    Run where an engine is built, before it notes what the allocator holds."""
    gc.collect()
    gc.freeze()


def available_host_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or its total where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this worker: allocated device memory on GPUs, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class SavedActivations:
    """Activation memory as autograd holds it: the bytes of tensors saved for backward that are alive
    now, and the most a step added to what was alive when it began (`step()` starts a step).
    Parameters saved for backward (a weight kept for a matmul's gradient, also as FSDP gathers it) are
    not activations and are left out. Use `with tracker.track(parameters):` around the forward passes;
    each storage counts once however many saved tensors view it, and leaves the count when the last of
    them is released (after its backward, or when the graph is dropped)."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.base = 0
        self.max_step = 0  # largest peak - base of the steps since `take`
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references]
        self._exclude: set[int] = set()

    def step(self) -> None:
        """A step begins: measure from what is alive now."""
        self.max_step = max(self.max_step, self.peak - self.base)
        self.base = self.peak = self.now

    def take(self) -> int:
        """The most any step since the previous take added (including the one running)."""
        out = max(self.max_step, self.peak - self.base)
        self.max_step = 0
        self.base = self.peak = self.now
        return out

    def take_peak(self) -> int:
        """The most alive at once since the previous take (for pipelines that keep microbatches in
        flight from one step to the next)."""
        out, self.peak = self.peak, self.now
        return out

    def track(self, parameters: Iterable[torch.Tensor]):
        self._exclude = {p.untyped_storage().data_ptr() for p in parameters}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._exclude or nbytes == 0 or t.device.type == "meta" or _is_parameter(t):
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        else:
            entry[1] += 1
        # detached: a tensor an operation saves of its own output (softmax's, for one) refers back to that
        # operation's node, and the node to what this hook returns; autograd breaks that cycle for the
        # tensors it keeps itself, not for ours. Through a backward that keeps the graph (a split backward's
        # input half) the node would never be freed, nor what it saved, step after step.
        return _Saved(t.detach(), key, self)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.now -= entry[0]


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a transposed weight), that `track` was not given: FSDP's
    unsharded parameters, gathered for the forward pass into storage of their own."""
    return isinstance(t._base if t._base is not None else t, torch.nn.Parameter)


class _Saved:
    """A saved tensor as autograd stores it while tracked: dropping it releases its count."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


def size_text(n: float) -> str:
    """Bytes for people: 512.0 MiB, 3.2 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- theory --------------------------------------------------------------------------------------

def optimizer_state_bytes(train) -> int:
    """fp32 bytes of optimizer state per parameter: AdamW's two moments, SGD's momentum buffer."""
    if train.optimizer == "adamw":
        return 8
    return 4 if train.momentum else 0


@dataclass(frozen=True)
class Sharding:
    """Which model states a strategy divides among its data-parallel ranks."""

    params: bool = False
    grads: bool = False
    optim: bool = False
    # Parameters and gradients in 16 bits with an fp32 master copy in the optimizer (mixed-precision
    # ZeRO); False where 16-bit is only used for compute (autocast, FSDP's MixedPrecisionPolicy).
    low_precision_states: bool = False


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one worker, predicted."""

    theory: float  # the textbook figure for the strategy's sharding
    expected: float  # what the implementation holds: the theory plus its own buffers and copies
    offloaded: float = 0.0  # the part of `expected` kept in host memory instead of the device


def model_state_theory(sharding: Sharding, dp: int, precision: str, optim_bytes: int,
                       master_copy_in_fp32: bool = False) -> float:
    """Theoretical model-state bytes per parameter on one of `dp` data-parallel ranks.

    fp32: parameters 4 + gradients 4 + optimizer state K; with 16-bit states: 2 + 2 + (4 + K), the
    4 being the fp32 master weights. `master_copy_in_fp32`: an implementation that keeps a separate
    fp32 master copy even when the model itself is fp32 (DeepSpeed) -- not in the textbook figure."""
    low = sharding.low_precision_states and precision != "fp32"
    p = g = 2 if low else 4
    o = optim_bytes + (4 if low or master_copy_in_fp32 else 0)
    return (p / dp if sharding.params else p) + (g / dp if sharding.grads else g) + (o / dp if sharding.optim else o)
