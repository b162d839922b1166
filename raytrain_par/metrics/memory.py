"""Per-worker memory: model states actually held, and peak process (or device) memory.

Model-state bytes are counted from live tensors (parameters, gradients, optimizer state), each
storage once however many views point into it, so a gradient that is a view into DDP's bucket
counts the bucket, and a tied weight counts once.
"""

from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (skipping those already in `seen`)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
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


def model_state_census(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
                       extra_grads: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """{mem_param_bytes, mem_grad_bytes, mem_optim_bytes, mem_model_state_bytes} from live tensors."""
    params = list(params)
    seen: set[int] = set()
    p = storage_bytes(params, seen)
    g = storage_bytes([q.grad for q in params] + list(extra_grads), seen)
    o = storage_bytes(optimizer_tensors(optimizer), seen) if optimizer is not None else 0
    return {"mem_param_bytes": p, "mem_grad_bytes": g, "mem_optim_bytes": o, "mem_model_state_bytes": p + g + o}


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this worker: allocated device memory on GPUs, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class SavedActivations:
    """Activation memory as autograd holds it: the bytes of tensors saved for backward that are alive
    now, and the most a step added to what was alive when it began (`step()` starts a step).
    Parameters saved for backward (a weight kept for a matmul's gradient) are not activations and are
    left out. Use `with tracker.track(parameters):` around the forward passes; each storage counts once
    however many saved tensors view it, and leaves the count when the last of them is released (after
    its backward, or when the graph is dropped)."""

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
        if key in self._exclude or nbytes == 0 or t.device.type == "meta":
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        else:
            entry[1] += 1
        return _Saved(t, key, self)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.now -= entry[0]


class _Saved:
    """A saved tensor as autograd stores it while tracked: dropping it releases its count."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved
