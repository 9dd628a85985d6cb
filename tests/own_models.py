"""A module of the tests' own with model builders, as a user's would be: ``model=own_models:small_net``."""

import torch.nn as nn


def small_net(num_classes: int, in_channels: int = 3) -> nn.Module:
    """Conv, BN, pooling and a linear head: any input size."""
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


small_net.crop = 48  # the training crop it is defined for (hpcdl's default: 224)


def no_classes(width=8) -> nn.Module:
    """A builder hpcdl cannot call: it takes no num_classes."""
    return nn.Linear(width, 2)
