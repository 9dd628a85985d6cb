"""Augmentation recipes as config: parsed, checked and expanded without torch, on the login node.

``data.augment`` is a list of steps, each ``name`` or ``name(key=value, ...)``, or the name of a recipe
that stands for a list of steps:

- ``imagenet``: ``resized_crop(min_scale=0.08)``, ``hflip(p=0.5)``: RandomResizedCrop and a flip, the
  ImageNet presets' recipe;
- ``light``: ``pad_crop(pad=0.125)``: CIFAR's pad-and-crop, no flip;
- ``none``: ``center_crop``: resize the short side to the crop, center crop.

The first step sizes the image to the run's crop (``resized_crop``, ``pad_crop`` or ``center_crop``;
``center_crop`` is put first when no step does); it is chosen before decoding, so that JPEG's draft
mode decodes no more pixels than the crop needs. The pixel steps follow in the order given. ``mixup``
and ``cutmix`` act on the batch: the trainer mixes each training batch and its labels (with both, each
batch takes one of them at random). A config holds the expanded list, so ``--print-config`` shows every
parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpcdl.errors import ConfigError

# step -> (kind, {parameter: (default, low, high)}); a whole-number parameter has int bounds
STEPS: dict[str, tuple[str, dict[str, tuple]]] = {
    "resized_crop": ("size", {"min_scale": (0.08, 0.0, 1.0), "max_scale": (1.0, 0.0, 1.0),
                              "min_ratio": (3 / 4, 0.1, 10.0), "max_ratio": (4 / 3, 0.1, 10.0)}),
    "pad_crop": ("size", {"pad": (0.125, 0.0, 0.5)}),  # zero padding on each side, as a fraction of the crop
    "center_crop": ("size", {}),
    "hflip": ("pixel", {"p": (0.5, 0.0, 1.0)}),
    "vflip": ("pixel", {"p": (0.5, 0.0, 1.0)}),
    # with probability p, a turn of 90, 180 or 270 degrees: 0.75 makes the four orientations equally likely
    "rot90": ("pixel", {"p": (0.75, 0.0, 1.0)}),
    "color_jitter": ("pixel", {"brightness": (0.4, 0.0, 1.0), "contrast": (0.4, 0.0, 1.0),
                               "saturation": (0.4, 0.0, 1.0), "hue": (0.0, 0.0, 0.5)}),
    "grayscale": ("pixel", {"p": (0.1, 0.0, 1.0)}),
    "randaugment": ("pixel", {"num_ops": (2, 1, 10), "magnitude": (9, 0, 30)}),
    "trivialaugment": ("pixel", {}),
    "erasing": ("pixel", {"p": (0.25, 0.0, 1.0), "min_area": (0.02, 0.0, 1.0), "max_area": (0.33, 0.0, 1.0)}),
    "mixup": ("batch", {"alpha": (0.2, 0.0, 10.0)}),
    "cutmix": ("batch", {"alpha": (1.0, 0.0, 10.0)}),
}
RECIPES: dict[str, tuple[str, ...]] = {
    "imagenet": ("resized_crop(min_scale=0.08)", "hflip(p=0.5)"),
    "light": ("pad_crop(pad=0.125)",),
    "none": ("center_crop",),
}
_STEP = re.compile(r"^\s*([a-z0-9_]+)\s*(?:\((.*)\))?\s*$", re.S)


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    params: dict

    @property
    def kind(self) -> str:
        return STEPS[self.name][0]

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}({', '.join(f'{k}={_number(v)}' for k, v in self.params.items())})"


def _number(v) -> str:
    """Short, and exact when read back (4/3 stays 4/3: the crops drawn depend on it)."""
    return f"{v:g}" if float(f"{v:g}") == v else repr(v)


def split_steps(text: str) -> list[str]:
    """``"resized_crop(min_scale=0.5, max_scale=1), hflip"`` -> the two steps: commas inside parentheses
    stay with their step (``--set data.augment=...`` gives one string)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def parse(spec, where: str = "data.augment") -> list[Step]:
    """The steps of ``spec`` (a string or a list of strings), recipes expanded, each checked; raises a
    ConfigError naming the item, the step or parameter, and what is valid."""
    items = split_steps(spec) if isinstance(spec, str) else [s for item in spec for s in split_steps(str(item))]
    steps: list[Step] = []
    for i, item in enumerate(items):
        if item in RECIPES:
            steps += [_step(s, f"{where}[{i}] ({item})") for s in RECIPES[item]]
        else:
            steps.append(_step(item, f"{where}[{i}]"))
    if not steps or steps[0].kind != "size":
        steps.insert(0, Step("center_crop", {}))
    sizing = [s.name for s in steps if s.kind == "size"]
    if len(sizing) > 1:
        raise ConfigError(f"{where}: {', '.join(sizing)} all size the image; keep one of them (the first step)")
    for name in ("mixup", "cutmix"):
        if sum(s.name == name for s in steps) > 1:
            raise ConfigError(f"{where}: {name} appears twice; keep one")
    return steps


def _step(text: str, where: str) -> Step:
    m = _STEP.match(text)
    if not m or m.group(1) not in STEPS:
        name = m.group(1) if m else text
        raise ConfigError(f"{where}: {name!r} is not an augmentation step or recipe; choose a recipe "
                          f"({', '.join(RECIPES)}) or steps from {', '.join(STEPS)}, e.g. "
                          f"[resized_crop(min_scale=0.5), rot90]")
    name, body = m.group(1), m.group(2)
    table = STEPS[name][1]
    params = {k: d for k, (d, _, _) in table.items()}
    for pair in split_steps(body or ""):
        key, sep, raw = (s.strip() for s in pair.partition("="))
        if not sep or key not in table:
            valid = ", ".join(f"{k}={d:g}" for k, (d, _, _) in table.items()) or "none"
            raise ConfigError(f"{where}: {name} has no parameter {key!r}; its parameters: {valid}")
        default, low, high = table[key]
        try:
            value = int(raw) if isinstance(default, int) else float(raw)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise ConfigError(f"{where}: {name}({key}={raw}) must be a {'whole ' if isinstance(default, int) else ''}"
                              f"number in [{low:g}, {high:g}] (default {default:g})")
        params[key] = value
    if name == "resized_crop" and not (params["min_scale"] <= params["max_scale"] and params["min_scale"] > 0
                                       and params["min_ratio"] <= params["max_ratio"]):
        raise ConfigError(f"{where}: resized_crop needs 0 < min_scale <= max_scale and min_ratio <= max_ratio")
    if name == "erasing" and not params["min_area"] <= params["max_area"]:
        raise ConfigError(f"{where}: erasing needs min_area <= max_area")
    return Step(name, params)


def expand(spec) -> tuple[str, ...]:
    """The canonical form a config holds: every step spelt out with all its parameters."""
    return tuple(str(s) for s in parse(spec))


def check_stats(field: str, values: tuple, channels: int = 3, positive: bool = False) -> None:
    """``data.mean`` / ``data.std``: one value per channel, in 0..1 units (ImageNet's mean is 0.485, ...)."""
    if not values:
        return
    if len(values) != channels:
        raise ConfigError(f"{field}={list(values)} has {len(values)} values; give one per channel ({channels}), "
                          f"in 0..1 units, e.g. {[0.485, 0.456, 0.406][:channels]}, or leave it empty for the "
                          "dataset's own (hpcdl pack measures them)")
    if any(not 0 <= v <= 1 for v in values) or (positive and any(v <= 0 for v in values)):
        raise ConfigError(f"{field}={list(values)}: values are in 0..1 units (pixel / 255)"
                          + (" and above 0" if positive else "") + ", e.g. 0.229")


IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet's channel mean and std, 0..1 units


def _gray(mean, std, why: str) -> tuple[tuple, tuple, str]:
    """Statistics of three channels for gray images: their averages."""
    return (sum(mean) / len(mean),), (sum(std) / len(std),), f"{why}, averaged over the channels"


def channel_stats(data, stats: dict, root: str, stated: tuple = (None, None, ""),
                  finetuning: bool = False) -> tuple[tuple, tuple, str]:
    """(mean, std, where they come from) for a run's ``data`` config and its training set's manifest stats.
    ``stated``: the model's (mean, std, description) as its library states them (None where it does not);
    ``data.normalize=auto`` takes them when ``finetuning`` (the weights were trained on inputs so scaled)."""
    gray = data.channels == 1
    mean, std, model = stated
    if data.mean:
        return tuple(data.mean), tuple(data.std), "data.mean and data.std"
    if data.normalize == "model" and mean is None:
        raise ConfigError(f"data.normalize=model: {model or 'the model'} states no input statistics; set "
                          "data.normalize=dataset or imagenet, or data.mean and data.std")
    if data.normalize == "model" or data.normalize == "auto" and finetuning and mean is not None:
        why = f"those {model} states (data.normalize={data.normalize}" + \
            (", fine-tuning from model.weights; data.normalize=dataset for the dataset's)" if data.normalize == "auto" else ")")
        return _gray(mean, std, why) if gray else (tuple(mean), tuple(std), why)
    if data.normalize == "imagenet":
        return _gray(*IMAGENET_STATS, "data.normalize=imagenet") if gray else (*IMAGENET_STATS, "data.normalize=imagenet")
    if not stats.get("mean"):
        raise ConfigError(f"{root}: its manifest has no channel statistics (packed before hpcdl measured them) "
                          f"and data.normalize={data.normalize} asks for them; run 'hpcdl pack --stats {root}', or set "
                          "data.normalize=imagenet, or data.mean and data.std")
    why = f"measured by hpcdl pack on {stats['sampled']} images"
    if data.normalize == "auto":
        why += " (data.normalize=auto, training from scratch)" if not finetuning else \
            f" (data.normalize=auto; {model or 'the model'} states none)"
    if gray:
        return (stats["mean_gray"],), (stats["std_gray"],), why + " (gray)"
    return tuple(stats["mean"]), tuple(stats["std"]), why
