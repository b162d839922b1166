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


class SavedTensorCensus:
    """Activation bytes: the distinct storages autograd saves for backward while this context is active
    (through torch's saved-tensors hooks), leaving out `exclude` (the parameters, which matmuls save
    too). Entered around one forward pass, it counts what that pass keeps alive until its backward."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.seen = {t.untyped_storage().data_ptr() for t in exclude}
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += storage_bytes([t], self.seen)
        return t

    def __enter__(self) -> "SavedTensorCensus":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
