"""Models by name, randomly initialised from configs (nothing is downloaded).

- gpt2-tiny, gpt2-mini, gpt2-small, gpt2-medium, gpt2-large: transformers' GPT2LMHeadModel on text.
- vgg11, vgg16: VGG on images, `model.width` scales every layer, `model.image_size` the input.

Each model also says how a pipeline splits it (`pipeline_layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import gpt2, vgg
from .task import ImageClassification, LanguageModelling, Task

GPT2_NAMES = tuple(gpt2.PRESETS)
VGG_NAMES = tuple(vgg.PLANS)
NAMES = GPT2_NAMES + VGG_NAMES


def data_kind(name: str) -> str:
    """The kind of data a model trains on: 'text' or 'image'."""
    return "text" if name in GPT2_NAMES else "image"


def task_metrics(name: str) -> tuple[str, ...]:
    return LanguageModelling.metrics if data_kind(name) == "text" else ImageClassification.metrics


def gpt2_sizes(spec) -> dict[str, int]:
    sizes = dict(gpt2.PRESETS[spec.name])
    sizes.update({k: getattr(spec, k) for k in ("n_layer", "n_embd", "n_head") if getattr(spec, k, None)})
    return sizes


def build_on_meta(spec, info) -> tuple[nn.Module, Task]:
    """The model with shapes but no storage (torch's meta device): counts parameters and sizes
    activations before anything runs, for any model size, in milliseconds."""
    with torch.device("meta"):
        return build(spec, info, seed=0)


def parameter_count(model: nn.Module) -> int:
    """Parameters of a model, a tied weight once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
def pipeline_layer_count(spec) -> int:
    """How many layers a pipeline can split the model between (see `pipeline_layers`)."""
    if spec.name in GPT2_NAMES:
        return gpt2_sizes(spec)["n_layer"] + 2
    return vgg.pipeline_layer_count(spec.name)


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of layers, each one tensor -> one tensor, that pipeline stages split between:
    GPT-2: embeddings, each block, final norm + LM head; VGG: each convolution (with its ReLU and pooling),
    then the classifier's three linear layers. The layers hold the model's own modules."""
    return vgg.pipeline_layers(model) if isinstance(model, vgg.VGG) else gpt2.pipeline_layers(model)


def example_input(model: nn.Module, device: torch.device | str = "cpu") -> torch.Tensor:
    """One sample of the model's input (zeros): what shapes and costs of the pipeline layers are measured on."""
    if isinstance(model, vgg.VGG):
        return torch.zeros(1, *model.input_shape, device=device)
    return torch.zeros(1, model.config.n_positions, dtype=torch.long, device=device)


def build(spec, info, seed: int) -> tuple[nn.Module, Task]:
    """The model (on CPU, in fp32, identical on every rank for the same seed) and its task."""
    torch.manual_seed(seed)
    if spec.name in GPT2_NAMES:
        config = gpt2.gpt2_config(gpt2_sizes(spec), info.vocab_size, info.seq_len, spec.dropout)
        return gpt2.build_gpt2(config), LanguageModelling()
    size = spec.image_size or info.image_shape[-1]
    model = vgg.VGG(spec.name, info.image_shape[0], info.num_classes, size, spec.width, spec.dropout)
    return model, ImageClassification(size, info.mean, info.std)
