"""Activation checkpointing (`train.activation_checkpointing`): chosen modules keep only their inputs
for the backward pass and run their forward pass again when backward needs what it saved.

- `full`: every transformer block (the model's `_no_split_modules`: GPT-2's GPT2Block, Llama's
  decoder layers) or every convolution stage of VGG. Autograd then holds one input per block
  instead of every intermediate; backward costs about one more forward pass.
- `selective`: the self-attention of each block only (transformer models): the attention's
  intermediates (q, k, v, the attention output) are recomputed, the MLP's are kept.

Each family says which modules (`checkpoint_units(model, mode)`); `apply` makes each of them run
its forward through torch.utils.checkpoint (non-reentrant), once, on the plain model, before any
strategy wraps, shards or splits it. The module's own `forward` is replaced on the instance rather
than the module wrapped (torch's `checkpoint_wrapper`): a wrapper adds `_checkpoint_wrapped_module.`
to every name below it, and tensor-parallel plans, pipeline splitting and checkpoints address
parameters by the plain model's names. The module tree stays as it was, so the hooks strategies
put on modules (DDP, DeepSpeed ZeRO-3, FSDP2) run around the recomputation as around the forward.

The recomputation must see what the forward saw:
- randomness: torch restores the default generator (dropout draws the same masks); streams that
  modules carry (`tp_rng`, the per-rank attention-dropout stream of strategies/megatron.py) are
  rewound to where the forward pass found them;
- weights: PipeDream runs a forward pass with stashed weights (torch.func.functional_call), and
  backward happens after the call has put the module's own back; the recomputation puts back the
  parameters the forward pass used.

torch's non-reentrant checkpoint saves the unit's tensor inputs through autograd's saved-tensor
hooks, so what the memory tracker (metrics/memory.py `SavedActivations`) and `estimate` count is
what is held: the units' inputs instead of their intermediates.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError

RNG_STREAMS = ("tp_rng",)  # module attributes holding a random stream of their own (an object with `state`)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model: the modules of its `_no_split_modules` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def attention_of(block: nn.Module) -> nn.Module:
    """The self-attention module of a transformer block (GPT-2's `attn`, Llama's `self_attn`)."""
    for name in ("self_attn", "attn", "attention", "self_attention"):
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    found = [m for m in block.children() if type(m).__name__.endswith("Attention")]
    if len(found) != 1:
        raise ConfigError("train.activation_checkpointing", "selective", "cannot tell the self-attention of "
                          f"{type(block).__name__} (its parts: {', '.join(n for n, _ in block.named_children())})",
                          "use full (recomputes whole blocks)")
    return found[0]


def transformer_units(model: nn.Module, mode: str) -> list[nn.Module]:
    """What the transformers families checkpoint: whole blocks (full) or their attention (selective)."""
    found = blocks(model)
    if not found:
        raise ConfigError("train.activation_checkpointing", mode, f"{type(model).__name__} declares no "
                          "transformer blocks (_no_split_modules) to recompute", "use none")
    return found if mode == "full" else [attention_of(b) for b in found]


def apply(units: list[nn.Module]) -> None:
    """Make each unit recompute its forward pass in backward (once: applying twice changes nothing)."""
    for unit in units:
        if not is_checkpointed(unit):
            unit.forward = functools.partial(_checkpointed, unit, unit.forward)


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.forward, "func", None) is _checkpointed


def _checkpointed(unit: nn.Module, forward, *args, **kwargs):
    # A partial of the module and its bound forward (not a closure): deep copies of the module
    # (pipeline stages measured on the meta device) then call their own copy.
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_as_in_forward, unit),
                      **kwargs)


def _as_in_forward(unit: nn.Module):
    """torch's `context_fn`, called as the forward pass starts: (context of the forward pass, context of
    the recomputation). The recomputation runs with the parameters and random streams found now."""
    params = [(m._parameters, name, p) for m in unit.modules() for name, p in m._parameters.items()]
    # A stream's state is replaced, never changed in place (ParallelRNG.fork), so keeping the tensor
    # keeps the state. Not a clone: under `estimate`'s FakeTensorMode the state stays a real tensor,
    # which fake mode refuses to copy.
    streams = [(s, s.state) for m in unit.modules() for attr in RNG_STREAMS
               if (s := getattr(m, attr, None)) is not None]
    return contextlib.nullcontext(), _Restored(params, streams)


class _Restored:
    """Puts back the parameters and stream states a forward pass found, for as long as a recomputation
    runs. Re-enterable: a backward split in two (the zero-bubble schedules' input, then weight,
    gradients) recomputes twice."""

    def __init__(self, params, streams):
        self.params, self.streams, self.now = params, streams, []

    def __enter__(self):
        self.now.append(([(holder, name, holder.get(name)) for holder, name, _ in self.params],
                         [(s, s.state) for s, _ in self.streams]))
        for holder, name, p in self.params:
            holder[name] = p
        for s, state in self.streams:
            s.state = state

    def __exit__(self, *exc):
        params_now, streams_now = self.now.pop()
        for holder, name, p in params_now:
            holder[name] = p
        for s, state in streams_now:
            s.state = state
        return False
