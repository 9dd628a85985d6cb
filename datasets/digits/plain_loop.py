"""The reference for docs/data.md's digits table: a plain PyTorch loop, one process, no hpcdl in the loop.

    python datasets/digits/plain_loop.py build/digits --augment none|flip|light [--epochs 20] [--seed 0]

The same model (hpcdl's TinyCNN, built by name so the two runs start from the same architecture), SGD
(lr 0.05, momentum 0.9, weight decay 5e-4 on every tensor), batch 32, and the channel statistics of the
training images, on the JPEG tree that datasets/digits/write.py wrote. Prints the final top-1.
"""

import argparse
import os

import torch
import torchvision.transforms as T
from torchvision.datasets import ImageFolder

from hpcdl.models import build_model

RECIPES = {"none": [], "flip": [T.RandomHorizontalFlip()], "light": [T.RandomCrop(32, padding=4)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root")
    p.add_argument("--augment", default="none", choices=RECIPES)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny_cnn_fc")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    pixels = torch.stack([T.functional.pil_to_tensor(im.convert("RGB")).float() / 255
                          for im, _ in ImageFolder(os.path.join(a.root, "train"))])
    mean, std = pixels.mean((0, 2, 3)).tolist(), pixels.std((0, 2, 3)).tolist()
    tail = [T.ToTensor(), T.Normalize(mean, std)]
    train = ImageFolder(os.path.join(a.root, "train"), T.Compose(RECIPES[a.augment] + tail))
    val = ImageFolder(os.path.join(a.root, "val"), T.Compose(tail))
    loader = torch.utils.data.DataLoader(train, batch_size=a.batch, shuffle=True)
    model = build_model(a.model, 10).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(a.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        hits = sum((model(x).argmax(1) == y).sum().item() for x, y in torch.utils.data.DataLoader(val, batch_size=256))
    print(f"plain loop, augment {a.augment}, seed {a.seed}: top-1 {100 * hits / len(val):.2f}% of {len(val)}")


if __name__ == "__main__":
    main()
