"""Scoring networks: each maps a batch of inputs to (B, T) logits; the score is their sigmoid.

No weights are ever downloaded: torchvision models are built with ``weights=None``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model '{name}' needs image inputs (channels, height, width), the dataset gives {input_shape}; "
            "use model=linear or model=mlp"
        )
    return input_shape  # type: ignore[return-value]


def linear(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_tasks))


def mlp(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_tasks),
    )


def cnn(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """Three conv-BN-ReLU blocks (the last two with stride 2), global average pooling, linear head."""
    channels = _image_shape("cnn", input_shape)[0]

    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(channels, width, 1),
        *block(width, 2 * width, 2),
        *block(2 * width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_tasks),
    )


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks (16, 32, 64 channels), about 0.27M weights."""

    def __init__(self, channels: int, num_tasks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(64, num_tasks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet20(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return ResNet20(_image_shape("resnet20", input_shape)[0], num_tasks)


def _densenet(name: str, input_shape: tuple[int, ...], num_tasks: int) -> nn.Module:
    """A torchvision DenseNet (random init, T outputs), first convolution adapted to the input channels."""
    import torchvision.models

    channels, height, width_px = _image_shape(name, input_shape)
    if min(height, width_px) < 32:
        raise ValueError(f"model '{name}' needs images of at least 32x32, the dataset gives {height}x{width_px}")
    model = getattr(torchvision.models, name)(weights=None, num_classes=num_tasks)
    if channels != 3:
        conv0 = model.features.conv0
        model.features.conv0 = nn.Conv2d(channels, conv0.out_channels, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def densenet121(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """torchvision's DenseNet-121 (random init), first convolution adapted to the input channels."""
    return _densenet("densenet121", input_shape, num_tasks)


def densenet161(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """torchvision's DenseNet-161 (random init, about 26.5M weights), first convolution adapted likewise."""
    return _densenet("densenet161", input_shape, num_tasks)


BUILDERS = {"linear": linear, "mlp": mlp, "cnn": cnn, "resnet20": resnet20, "densenet121": densenet121,
            "densenet161": densenet161}


def build_model(
    name: str, input_shape: tuple[int, ...], num_tasks: int, *, width: int = 32, seed: int = 0
) -> nn.Module:
    """Build a network with weights initialised from ``seed`` (the same on every client and the driver)."""
    if name not in BUILDERS:
        raise ValueError(f"model {name!r} is not one of {', '.join(BUILDERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[name](tuple(input_shape), num_tasks, width)
