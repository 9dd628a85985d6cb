"""Write synthetic ImageNet-like JPEGs (see hpcdl/data/synthetic.py); tests and the demo use them.

    python datasets/synthetic/generate.py OUT [--classes 10] [--per-class 100] [--tree imagenet] [--quirks]
"""

import argparse
import sys

from hpcdl.data.synthetic import TREES, generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=100, help="train images per class")
    p.add_argument("--val-per-class", type=int, default=20, help="val images per class (tree imagenet)")
    p.add_argument("--tree", default="imagenet", choices=TREES)
    # the spelling before --tree, kept for a release as hpcdl pack keeps it
    p.add_argument("--layout", dest="old_layout", choices=TREES, help=argparse.SUPPRESS)
    p.add_argument("--quirks", action="store_true", help="add a PNG named .JPEG, CMYK, grayscale, truncated (in data and header), "
                                                         "corrupt, empty, non-image, unreadable, non-UTF-8 name")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.old_layout:
        print(f"generate.py: --layout is now --tree; --tree {a.old_layout} is used (--layout goes in the next "
              "release)", file=sys.stderr)
        a.tree = a.old_layout
    gen = generate(a.out, classes=a.classes, per_class=a.per_class, tree=a.tree, quirks=a.quirks, seed=a.seed,
                   val_per_class=a.val_per_class)
    print(f"wrote {gen.count} train images in {a.classes} classes to {a.out}"
          + (f", {len(gen.extra['truth'])} val images" if gen.extra else "")
          + (f", {len(gen.quirks)} quirky files" if gen.quirks else ""))


if __name__ == "__main__":
    main()
