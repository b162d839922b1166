"""VGG-11 / VGG-16 (Simonyan & Zisserman), for small images and ImageNet-size inputs.

Written here rather than taken from torchvision: torchvision's wheels are built against one exact
torch release and fail to import beside others (the CPU torch this project installs among them),
and VGG is forty lines. Layer names follow torchvision (features.N, classifier.N) so that state
dicts read the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .task import ImageClassification

# Channel plans; "M" is a 2x2 max-pool. "A" is VGG-11, "D" is VGG-16.
PLANS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
NAMES = tuple(PLANS)
KIND = "image"
LAYERS = "convolutions, classifier layers"
CHECKPOINTING = ("full",)  # convolution stages; no attention for `selective` to recompute alone


@dataclass
class Options:
    """`model:` keys of VGG."""

    dropout: float = 0.0
    width: float = 1.0  # channel multiplier of every layer (0.25: a CPU-sized VGG)
    image_size: Optional[int] = None  # the size images are resized to (default: the data's)

    def validate(self, spec, error) -> None:
        if not 0.0 <= self.dropout < 1.0:
            error("model.dropout", self.dropout, "must be in [0, 1)", "use e.g. 0.5 (the paper's), or 0 for none")
        if self.width <= 0:
            error("model.width", self.width, "must be > 0", "use 1.0 for the paper's VGG, 0.25 for a CPU-sized one")
        if self.image_size is not None and self.image_size < 4:
            error("model.image_size", self.image_size, "must be >= 4", "use e.g. 32 or 224")

    def vocab_size(self) -> None:
        return None


def build(name: str, options: Options, info) -> tuple[nn.Module, ImageClassification]:
    size = options.image_size or info.image_shape[-1]
    model = VGG(name, info.image_shape[0], info.num_classes, size, options.width, options.dropout)
    model.family, model.input_dtype = "vgg", torch.float32
    return model, ImageClassification(size, info.mean, info.std)


def tensor_parallel_plan(name: str, options: Options) -> None:
    return None  # convolutions have no heads or vocabulary to split


def plan_of(model: nn.Module) -> None:
    return None


def export(model: nn.Module, out, spec, info, write_weights) -> None:
    """The weights (`write_weights()`: model.safetensors) and config.json describing how to rebuild the model."""
    write_weights()
    description = {"model": spec.to_dict()["model"], "image_shape": info.image_shape,
                   "num_classes": info.num_classes, "mean": info.mean, "std": info.std,
                   "build": "raytrain_par.models.vgg.VGG(name, channels, num_classes, image_size, width, dropout)"}
    (out / "config.json").write_text(json.dumps(description, indent=1))


class VGG(nn.Module):
    def __init__(self, plan: str, in_channels: int, num_classes: int, image_size: int, width: float = 1.0,
                 dropout: float = 0.5):
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for item in PLANS[plan]:
            if item == "M":
                # Small inputs (28x28, 8x8) run out of pixels before the fifth pool: stop pooling at 1x1.
                if size >= 2:
                    layers.append(nn.MaxPool2d(2, 2))
                    size //= 2
                continue
            out = max(1, int(round(int(item) * width)))
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True)]
            channels = out
        self.features = nn.Sequential(*layers)
        # Each convolution with its ReLU (and the pooling after it), as one module: what the plain
        # forward runs, what pipelines split between and what activation checkpointing recomputes.
        # A tuple, so not registered: the parameters keep their names (features.N).
        self.stages = tuple(nn.Sequential(*group) for group in _stages(self.features))
        # ImageNet-size inputs keep torchvision's 7x7 head; small inputs pool to 1x1.
        self.pool_size = 7 if image_size >= 112 else 1
        self.avgpool = nn.AdaptiveAvgPool2d(self.pool_size)
        hidden = max(1, int(round(4096 * width)))
        self.classifier = nn.Sequential(
            nn.Linear(channels * self.pool_size**2, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            init_module(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.classifier(torch.flatten(self.avgpool(x), 1))


def init_module(m: nn.Module) -> None:
    """torchvision's initialisation of VGG, one module at a time (what models/initial.py draws by)."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0, 0.01)
        nn.init.zeros_(m.bias)


def initialiser(model: nn.Module):
    return init_module


def _stages(features: nn.Sequential) -> list[list[nn.Module]]:
    groups: list[list[nn.Module]] = []
    for m in features:
        if isinstance(m, nn.Conv2d):
            groups.append([])
        groups[-1].append(m)
    return groups


def pipeline_layers(model: VGG) -> list[nn.Module]:
    """What a pipeline splits VGG between: each convolution stage (a convolution with its ReLU and the
    pooling after it: the model's own `stages`), then the classifier's three linear layers (the first
    with the average pooling and flatten)."""
    c = model.classifier
    head = [[model.avgpool, nn.Flatten(1), c[0], c[1], c[2]], [c[3], c[4], c[5]], [c[6]]]
    return [*model.stages, *(nn.Sequential(*group) for group in head)]


def checkpoint_units(model: VGG, mode: str) -> list[nn.Module]:
    """full: every convolution stage recomputes in backward (its input kept, not the convolution's,
    ReLU's and pooling's)."""
    return list(model.stages)


def pipeline_layer_count(name: str, options: Options) -> int:
    return sum(1 for item in PLANS[name] if item != "M") + 3
