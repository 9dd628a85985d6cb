"""AlexNet-BN: the layout of Intel Caffe's LARS AlexNet runs on Stampede2 (You et al., "ImageNet Training
in Minutes"). BatchNorm replaces LRN, after the pool where a block has one; a 227x227 crop:
    conv1 96 11x11/4  - relu - pool1 3x3/2 - bn1      227 -> 55 -> 27
    conv2 256 5x5 p2  - relu - pool2 3x3/2 - bn2       27 -> 27 -> 13
    conv3 384 3x3 p1  - relu - bn3                     13
    conv4 384 3x3 p1  - relu - bn4                     13
    conv5 256 3x3 p1  - relu - pool5 3x3/2             13 -> 6
    fc6 4096 - relu - dropout, fc7 4096 - relu - dropout, fc8 num_classes

No grouped convolutions. Conv and fc weights are Gaussian with std 0.01, biases 0; BN starts at 1, 0.
"""

from __future__ import annotations

from collections import OrderedDict

import torch.nn as nn


def _layers(num_classes: int, dropout: float) -> list[tuple[str, nn.Module]]:
    relu = lambda: nn.ReLU(inplace=True)  # noqa: E731
    pool = lambda: nn.MaxPool2d(3, 2)  # noqa: E731
    return [
        ("conv1", nn.Conv2d(3, 96, 11, stride=4)), ("relu1", relu()), ("pool1", pool()), ("bn1", nn.BatchNorm2d(96)),
        ("conv2", nn.Conv2d(96, 256, 5, padding=2)), ("relu2", relu()), ("pool2", pool()), ("bn2", nn.BatchNorm2d(256)),
        ("conv3", nn.Conv2d(256, 384, 3, padding=1)), ("relu3", relu()), ("bn3", nn.BatchNorm2d(384)),
        ("conv4", nn.Conv2d(384, 384, 3, padding=1)), ("relu4", relu()), ("bn4", nn.BatchNorm2d(384)),
        ("conv5", nn.Conv2d(384, 256, 3, padding=1)), ("relu5", relu()), ("pool5", pool()),
        ("flatten", nn.Flatten()),
        ("fc6", nn.Linear(256 * 6 * 6, 4096)), ("relu6", relu()), ("drop6", nn.Dropout(dropout)),
        ("fc7", nn.Linear(4096, 4096)), ("relu7", relu()), ("drop7", nn.Dropout(dropout)),
        ("fc8", nn.Linear(4096, num_classes)),
    ]


class AlexNetBN(nn.Sequential):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__(OrderedDict(_layers(num_classes, dropout)))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.zeros_(m.bias)
