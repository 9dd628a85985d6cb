"""Models as a registry. Models know nothing of ranks, devices or data: ``build_model(name, num_classes)``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch.nn as nn

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.models.alexnet_bn import AlexNetBN
from hpcdl.models.tiny import TinyCNN
from hpcdl.names import registry


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    build: Callable[[int], nn.Module]  # num_classes -> model
    crop: int  # the training crop it is defined for
    description: str


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import torchvision.models

        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)

    return build


MODELS: dict[str, ModelInfo] = registry("models", {m.name: m for m in (
    ModelInfo("alexnet_bn", AlexNetBN, 227, "AlexNet with BN after each pool/conv, as in the Stampede2 LARS runs"),
    ModelInfo("resnet18", _torchvision("resnet18"), 224, "torchvision ResNet-18"),
    ModelInfo("resnet50", _torchvision("resnet50"), 224, "torchvision ResNet-50 (v1.5)"),
    ModelInfo("resnet101", _torchvision("resnet101"), 224, "torchvision ResNet-101 (v1.5)"),
    ModelInfo("tiny_cnn", TinyCNN, 32, "a small CNN for tests and the demo; any input size"),
    ModelInfo("tiny_cnn_fc", partial(TinyCNN, hidden=4096), 32,
              "tiny_cnn with a 4,096-unit fully-connected layer: 8.4M parameters, 99.9% in the head (comm hooks)"),
)}, names.MODELS)


def build_model(name: str, num_classes: int = 1000, in_channels: int = 3) -> nn.Module:
    """``name`` with ``num_classes`` outputs; with ``in_channels`` other than 3 (gray images: 1), its first
    convolution takes that many channels, initialized as the model initializes it."""
    if name not in MODELS:
        raise ConfigError(f"model {name!r} is unknown; choose one of {', '.join(MODELS)}")
    model = MODELS[name].build(num_classes)
    if in_channels != 3:
        parent, attr, conv = next((p, a, m) for p in model.modules() for a, m in p.named_children()
                                  if isinstance(m, nn.Conv2d))
        first = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                          conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode)
        if isinstance(parent, nn.Sequential) and attr.isdigit():
            parent[int(attr)] = first
        else:
            setattr(parent, attr, first)
    return model
