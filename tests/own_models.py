"""A module of the tests' own with model builders, as a user's would be: ``model=own_models:small_net``."""

import os

import torch.nn as nn


def small_net(num_classes: int, in_channels: int = 3) -> nn.Module:
    """Conv, BN, pooling and a linear head: any input size."""
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))


small_net.crop = 48  # the training crop it is defined for (hpcdl's default: 224)


def no_classes(width=8) -> nn.Module:
    """A builder hpcdl cannot call: it takes no num_classes."""
    return nn.Linear(width, 2)


def not_a_model(num_classes: int) -> dict:
    """A builder that returns something other than a model."""
    return {"classes": num_classes}


class DropoutNet(nn.Module):
    """small_net with dropout before its head. With HPCDL_TEST_MASKS set, each training forward appends the
    dropout mask it drew (as 0/1 characters) to HPCDL_TEST_MASKS/rankR.txt, R from RANK."""

    def __init__(self, num_classes: int, in_channels: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        h = self.drop(self.body(x) + 1.0)  # + 1: nothing the ReLU zeroed is taken for a dropped unit
        folder = os.environ.get("HPCDL_TEST_MASKS")
        if folder and self.training:
            with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
                f.write("".join("1" if v else "0" for v in (h != 0).view(-1).tolist()) + "\n")
        return self.head(h)


def tiny_swin(num_classes: int, in_channels: int = 3) -> nn.Module:
    """timm's Swin at 32 pixels, 20k parameters: its relative_position_index buffers are registered with
    persistent=False (in named_buffers(), in no state dict), as in timm's LeViT, BEiT, EVA and TinyViT."""
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=num_classes,
                             in_chans=in_channels, img_size=32, window_size=4, embed_dim=16, depths=(1, 1),
                             num_heads=(1, 2))


tiny_swin.crop = 32
