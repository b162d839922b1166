"""VGG-11 / VGG-16 (Simonyan & Zisserman), for small images and ImageNet-size inputs.

Written here rather than taken from torchvision: torchvision's wheels are built against one exact
torch release and fail to import beside others (the CPU torch this project installs among them),
and VGG is forty lines. Layer names follow torchvision (features.N, classifier.N) so that state
dicts read the same.
"""

from __future__ import annotations

import torch
from torch import nn

# Channel plans; "M" is a 2x2 max-pool. "A" is VGG-11, "D" is VGG-16.
PLANS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


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
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))



def pipeline_layers(model: VGG) -> list[nn.Module]:
    """What a pipeline splits VGG between: each convolution with its ReLU (and the pooling after it),
    then the classifier's three linear layers (the first with the average pooling and flatten)."""
    layers: list[list[nn.Module]] = []
    for m in model.features:
        if isinstance(m, nn.Conv2d):
            layers.append([])
        layers[-1].append(m)
    c = model.classifier
    layers += [[model.avgpool, nn.Flatten(1), c[0], c[1], c[2]], [c[3], c[4], c[5]], [c[6]]]
    return [nn.Sequential(*group) for group in layers]


def pipeline_layer_count(plan: str) -> int:
    return sum(1 for item in PLANS[plan] if item != "M") + 3
