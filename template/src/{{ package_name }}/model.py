"""The model. This file is yours: change the architecture freely.

`build_model` is what the training script, the benchmarks and the tests call (through
`build_model_for`, which fills its arguments from the config and the dataset), so keep its
signature, and pass a new keyword argument through `build_model_for`.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Config
from .data import DataInfo


class ConvNet(nn.Module):
    """A small CNN: three conv blocks, global average pooling, a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.1):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                # ceil_mode: a 1x1 map stays 1x1, so images as small as 1 pixel still work.
                nn.MaxPool2d(2, ceil_mode=True),
            )

        self.features = nn.Sequential(
            block(in_channels, width), block(width, 2 * width), block(2 * width, 4 * width)
        )
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Global average pooling as a mean: AdaptiveAvgPool2d(1) computes the same, but its CUDA
        # backward has no deterministic kernel and would make --deterministic raise on GPUs.
        x = self.features(x).mean(dim=(2, 3))
        return self.classifier(self.dropout(x))


class MLP(nn.Module):
    """A two-hidden-layer perceptron over flattened inputs."""

    def __init__(self, in_features: int, num_classes: int, width: int = 256, dropout: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(
    name: str, *, in_channels: int, image_size: int, num_classes: int, width: int, dropout: float
) -> nn.Module:
    """Build the model named by `--model` for inputs of shape (in_channels, size, size)."""
    if name == "cnn":
        return ConvNet(in_channels, num_classes, width=width, dropout=dropout)
    if name == "mlp":
        return MLP(
            in_channels * image_size * image_size, num_classes, width=8 * width, dropout=dropout
        )
    raise ValueError(f"unknown model {name!r}; choose cnn or mlp")


def build_model_for(config: Config, info: DataInfo) -> nn.Module:
    """`build_model` with the architecture from `config` and the shapes from the dataset.

    Training, the benchmarks and the tests all build their model here, so a new argument to
    `build_model` is wired in once.
    """
    return build_model(
        config.model.model,
        in_channels=info.in_channels,
        image_size=info.image_size,
        num_classes=info.num_classes,
        width=config.model.width,
        dropout=config.model.dropout,
    )
