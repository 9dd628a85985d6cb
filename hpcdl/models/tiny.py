"""Small CNNs for tests and the demo: conv, BN, biases and a linear head, on any input size.

``TinyCNN(hidden=H)`` pools the features to 8x8 and puts an AlexNet-style hidden layer of ``H`` units
before the classifier (registered as ``tiny_cnn_fc`` with 4,096): almost all of its parameters are in
that layer, so its gradient outweighs its compute, as AlexNet's does. It is the model for showing a comm
hook where the network, not the node, sets the step time.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyCNN(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 16, hidden: int = 0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(8 if hidden else 1))
        if hidden:
            self.fc = nn.Sequential(nn.Linear(2 * width * 64, hidden), nn.ReLU(inplace=True),
                                    nn.Linear(hidden, num_classes))
        else:
            self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))
