"""A model with no parameter storage, and its initial weights drawn by name, one tensor at a time.

A worker never builds the whole model: `parameters_on_meta` builds it with every parameter on torch's
meta device (shapes, no storage), and each engine materialises only what its rank holds, filling it from
`draw` (through `strategies.initial`). So that the values do not depend on the layout (every parity test
to one process holds bit for bit whatever the split), each tensor is drawn alone: whole, from the default
generator seeded by the run's seed and the tensor's name, by the model's own initialisation (transformers'
`_init_weights`, VGG's), and the rank keeps its part of it. The largest tensor a rank ever holds whole is
one parameter (the token embedding), for as long as it copies its part.

Buffers are built as they are (the rotary embeddings' frequencies: small, computed, not drawn), so the
model's forward needs nothing else. torch's `torch.device("meta")` would put them on the meta device too,
with nothing to compute them again from; accelerate's `init_empty_weights(include_buffers=False)` does
what `parameters_on_meta` does, but accelerate is not a dependency of this project and transformers 5
keeps no copy of it.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers while inside is moved to the meta device as it is registered (its
    module's own initialisation then runs on the meta tensor: nothing is drawn); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def seed_of(seed: int, name: str) -> int:
    """The generator's seed for tensor `name` of a run seeded with `seed`."""
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """The initialisation transformers gives `module` of `model`: the `_init_weights` of the nearest model
    at or above it (a composite model's parts initialise by their own, as transformers' `smart_apply`)."""
    from transformers import PreTrainedModel

    owners: dict[int, PreTrainedModel] = {}

    def visit(module: nn.Module, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, model)

    def init(module: nn.Module) -> None:
        owners[id(module)]._init_weights(module)

    return init


def draw(model: nn.Module, name: str, seed: int, init: Callable[[nn.Module], None]) -> torch.Tensor:
    """Parameter `name` of `model` (built by `parameters_on_meta`) as the model initialises it, drawn alone:
    a real tensor in its place, the initialisation of its module and of each module above it run in the
    order the whole model's would (children first), on a generator seeded by `seed_of(seed, name)`.
    Other parameters stay on the meta device, where initialising them draws nothing. A buffer is returned
    as built. The default generator's state is left as it was."""
    path, _, key = name.rpartition(".")
    owner = model.get_submodule(path)
    if key in owner._buffers:
        return owner._buffers[key].detach().clone()
    held = owner._parameters[key]
    assert held.device.type == "meta", f"{name}: drawn on a model whose parameters have storage"
    chain = [owner]
    while path:
        path = path.rpartition(".")[0]
        chain.append(model.get_submodule(path))
    fresh = nn.Parameter(torch.empty(held.shape, dtype=held.dtype), requires_grad=held.requires_grad)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _hf_guard():
        torch.manual_seed(seed_of(seed, name))
        setattr(owner, key, fresh)
        try:
            for module in chain:
                init(module)
        finally:
            setattr(owner, key, held)
    return fresh.data


def _hf_guard():
    """transformers' guard on torch's init functions, as its own initialisation runs them (they leave a
    tensor marked as loaded alone)."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # not a transformers model's concern
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def tensor_names(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state-dict tensors by name, a tied tensor once, and the tied names -> the name kept."""
    first: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t
    return tensors, aliases


def materialise(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Storage on `device` for every parameter of `module` still on the meta device (its values undefined:
    fill them), the rest moved there; buffers kept as they are, a tied parameter still one parameter
    (`Module.to_empty` would make each module's reference a parameter of its own, and empty the buffers).
    A DTensor's storage is its shard's (FSDP2 keeps the parameter object it registered: `to_empty` swaps it
    in place)."""
    from torch.distributed.tensor import DTensor

    made: dict[int, nn.Parameter] = {}
    sharded = False
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if isinstance(p, DTensor):
                sharded = True
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            setattr(m, key, made[id(p)])
    if sharded:
        buffers = [(m, key, b) for m in module.modules() for key, b in m._buffers.items() if b is not None]
        with _swapping():
            module.to_empty(device=device)
        for m, key, b in buffers:
            setattr(m, key, b)
    return module.to(device)


def given_storage(module: nn.Module, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> Iterator[nn.Parameter]:
    """Each distinct parameter of `module` still on the meta device, given storage on `device` (values
    undefined; floating-point ones in `dtype` where given) just before it is yielded, the same parameter
    object (a tied one stays one): for a caller that shards each one as it comes, so that a rank never
    holds more than one whole tensor beside its shards. Buffers are moved to `device` first."""
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = b.to(device)
    seen: set[int] = set()
    for p in module.parameters():
        if p.device.type != "meta" or id(p) in seen:
            continue
        seen.add(id(p))
        kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device, dtype=kind),
                                                 requires_grad=p.requires_grad))
        yield p


@contextlib.contextmanager
def _swapping():
    """Module conversions swap each parameter's contents in place (torch.utils.swap_tensors), so that a
    parameter shared by two modules stays one."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
