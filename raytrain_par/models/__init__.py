"""Models by name, randomly initialised from configs (nothing is downloaded), one module per family.

| family    | names                              | data  | options                                      |
|-----------|------------------------------------|-------|----------------------------------------------|
| gpt2      | gpt2-tiny, -mini, -small, -medium, -large | text | dropout, n_layer, n_embd, n_head         |
| causal-lm | causal-lm                          | text  | config (a transformers config.json), dropout |
| vgg       | vgg11, vgg16                       | image | dropout, width, image_size                   |

A family is a module with:
- `NAMES` (the `model.name`s it builds), `KIND` ('text' or 'image') and `LAYERS` (what its pipeline
  layers are, for messages);
- `Options`, the dataclass of its other `model:` keys, with `validate(spec, error)`;
- `build(name, options, info) -> (model, task)`: the model in fp32 (its weights as its own initialisation
  draws them; models.build draws them again by name, models/initial.py), with `family` (its key
  in FAMILIES), `input_shape` and `input_dtype` (one sample of its input) set, and its task;
- `pipeline_layers(model)` and `pipeline_layer_count(name, options)`: what pipelines split it
  between (each layer maps one tensor to one tensor and holds the model's own modules);
- `tensor_parallel_plan(name, options)` and `plan_of(model)`: a `TensorParallelPlan`
  (models/plans.py), or None when the family has none;
- `CHECKPOINTING` (the `train.activation_checkpointing` modes it has besides none) and
  `checkpoint_units(model, mode)`: the modules that mode recomputes in backward (models/checkpointing.py);
- `initialiser(model)`: its initialisation of one module (`init(module)`, run on each module above a
  parameter too: what models/initial.py draws each tensor by);
- optionally `pretrained_tensors(options, model)`: (file, key) of each tensor of pretrained weights;
- `export(model, out, spec, info, write_weights)`: the format its users load (the model on the meta
  device; `write_weights()` streams the weights into Hugging Face's safetensors files).

Adding a family: write its module and add one line to `FAMILIES` (docs/architecture.md shows one).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from . import causal_lm, checkpointing, gpt2, initial, vgg
from .task import ImageClassification, LanguageModelling, Task

FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "causal-lm": causal_lm, "vgg": vgg}

NAMES: tuple[str, ...] = tuple(name for family in FAMILIES.values() for name in family.NAMES)
GPT2_NAMES = gpt2.NAMES


def family_of(name: str) -> ModuleType:
    """The family module that builds model `name` (config.validate has checked that one does)."""
    for family in FAMILIES.values():
        if name in family.NAMES:
            return family
    raise KeyError(f"no model family builds {name!r}; models: {', '.join(NAMES)}")


def data_kind(name: str) -> str:
    """The kind of data a model trains on: 'text' or 'image'."""
    return family_of(name).KIND


def task_metrics(name: str) -> tuple[str, ...]:
    return LanguageModelling.metrics if data_kind(name) == "text" else ImageClassification.metrics


def build(spec, info, seed: int, on_meta: bool = False) -> tuple[nn.Module, Task]:
    """The model in fp32 and its task, with the default generator seeded with `seed` (dropout's stream, the
    same on every rank). Its weights are the same whichever process builds it: a pretrained model's from its
    files, a random one's drawn by name (models/initial.py). With `on_meta`, parameters on the meta device
    (buffers real) for an engine to materialise only its own part (strategies/initial.py fills it)."""
    torch.manual_seed(seed)
    probe = torch.empty(0)
    if probe.device.type == "meta" or type(probe).__name__ == "FakeTensor":
        # shapes only (estimate, parameter counts): nothing is drawn or read
        return family_of(spec.name).build(spec.name, spec.options, info)
    with initial.parameters_on_meta():
        model, task = family_of(spec.name).build(spec.name, spec.options, info)
    if not on_meta:
        # drawn on a model of its own, whose other parameters have no storage to draw into (initial.draw)
        template = build(spec, info, seed, on_meta=True)[0]
        fill(initial.materialise(model, "cpu"), template, spec, seed)
    return model, task


def build_on_meta(spec, info) -> tuple[nn.Module, Task]:
    """The model with shapes but no storage (torch's meta device): counts parameters and sizes
    activations before anything runs, for any model size, in milliseconds."""
    with torch.device("meta"):
        return build(spec, info, seed=0)


def initialiser(model: nn.Module):
    """The model's own initialisation of one module (what `initial.draw` runs)."""
    return FAMILIES[model.family].initialiser(model)


def pretrained_tensors(spec, model: nn.Module) -> dict[str, tuple[Path, str]] | None:
    """Where each of the model's tensors is stored, (file, key), for a model of pretrained weights; None
    for random ones (drawn by name)."""
    found = getattr(family_of(spec.name), "pretrained_tensors", None)
    return found(spec.options, model) if found is not None else None


def fill(model: nn.Module, template: nn.Module, spec, seed: int) -> nn.Module:
    """Every tensor of a whole model (materialised) at its start, a tied tensor once: read from a pretrained
    model's files, or drawn by name on `template` (the same model, built on the meta device)."""
    from safetensors import safe_open

    stored = pretrained_tensors(spec, template)
    tensors, _ = initial.tensor_names(model)
    init = None if stored is not None else initialiser(template)
    files = {}  # each file opened once
    with torch.no_grad():
        for name, t in tensors.items():
            if stored is None:
                t.copy_(initial.draw(template, name, seed, init))
            else:
                file, key = stored[name]
                if file not in files:
                    files[file] = safe_open(str(file), "pt")
                t.copy_(files[file].get_tensor(key))
    return model


def parameter_count(model: nn.Module) -> int:
    """Parameters of a model, a tied weight once."""
    return parameter_count_of(model.parameters())


def parameter_count_of(params) -> int:
    """Elements of distinct parameters (a tied weight once)."""
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def pipeline_layer_count(spec) -> int:
    """How many layers a pipeline can split the model between (see `pipeline_layers`)."""
    return family_of(spec.name).pipeline_layer_count(spec.name, spec.options)


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of layers, each one tensor -> one tensor, that pipeline stages split
    between; the layers hold the model's own modules."""
    return FAMILIES[model.family].pipeline_layers(model)


def tensor_parallel_plan(spec):
    """How the model's layers split for tensor parallel, or None if its family has no plan."""
    return family_of(spec.name).tensor_parallel_plan(spec.name, spec.options)


def tensor_parallel_plan_of(model: nn.Module):
    """The plan of a built model (what the megatron engine splits it by)."""
    return FAMILIES[model.family].plan_of(model)


def example_input(model: nn.Module, device: torch.device | str = "cpu") -> torch.Tensor:
    """One sample of the model's input (zeros): what shapes and costs of the pipeline layers are measured on."""
    return torch.zeros(1, *model.input_shape, dtype=model.input_dtype, device=device)


def checkpoint_activations(model: nn.Module, mode: str) -> nn.Module:
    """Make the modules `mode` names (train.activation_checkpointing) recompute their forward pass in
    backward; `none` leaves the model as it is. Before any strategy wraps, shards or splits the model."""
    if mode != "none":
        checkpointing.apply(FAMILIES[model.family].checkpoint_units(model, mode))
    return model


def export(model: nn.Module, out, spec, info, write_weights) -> None:
    """`model` (on the meta device: its config, names and shapes) in the format its family's users load;
    `write_weights()` writes its weights into `out` (export.write_weights)."""
    family_of(spec.model.name).export(model, out, spec, info, write_weights)
