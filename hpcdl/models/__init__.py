"""Models as a registry, and any classifier by name. Models know nothing of ranks, devices or data:
``build_model(name, num_classes, in_channels)``.

``name`` is one of hpcdl's (:data:`MODELS`), ``torchvision:NAME`` (any of torchvision's classification
models), ``timm:NAME`` (any of timm's, ``pip install 'hpcdl[timm]'``) or ``package.module:callable`` (a builder
of one's own, called with ``num_classes`` and, where it takes one, ``in_channels`` or ``in_chans``).
:func:`model_info` resolves it: the builder, the crop the model is defined for, and the input statistics
its library states (timm's pretrained config, torchvision's weights' transforms).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch.nn as nn

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.models.alexnet_bn import AlexNetBN
from hpcdl.models.tiny import TinyCNN
from hpcdl.names import MODEL_TABLE, registry

__all__ = ["MODELS", "ModelInfo", "build_model", "model_info", "with_model_defaults"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    build: Callable[[int], nn.Module]  # num_classes -> model
    crop: int  # the training crop it is defined for
    description: str
    # (num_classes, in_channels) -> model, for builders that take the channels themselves; the others get
    # their first convolution replaced (build_model)
    build_channels: Callable[[int, int], nn.Module] | None = None
    mean: tuple[float, ...] | None = None  # the input statistics its library states, where it states them
    std: tuple[float, ...] | None = None
    interpolation: str | None = None


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import torchvision.models

        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)

    return build


_BUILDERS = {"alexnet_bn": AlexNetBN, "resnet18": _torchvision("resnet18"), "resnet50": _torchvision("resnet50"),
             "resnet101": _torchvision("resnet101"), "tiny_cnn": TinyCNN, "tiny_cnn_fc": partial(TinyCNN, hidden=4096)}
MODELS: dict[str, ModelInfo] = registry("models", {
    name: ModelInfo(name, build, MODEL_TABLE[name].crop, MODEL_TABLE[name].description)
    for name, build in _BUILDERS.items()}, names.MODELS)


def _unknown(name: str, library: str, known) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return ConfigError(f"model={library}:{name}: {library} has no model {name!r}"
                       + (f"; did you mean {' or '.join(f'{library}:{c}' for c in close)}?" if close else ""))


def _from_torchvision(name: str) -> ModelInfo:
    import torchvision.models as tvm

    known = tvm.list_models(module=tvm)  # the classification models (not detection, segmentation, video)
    if name not in known:
        raise _unknown(name, "torchvision", known)
    transforms = tvm.get_model_weights(name).DEFAULT.transforms()  # the recipe's statistics; nothing downloaded
    return ModelInfo(f"torchvision:{name}", lambda n: tvm.get_model(name, weights=None, num_classes=n),
                     transforms.crop_size[0], f"torchvision's {name}", mean=tuple(transforms.mean),
                     std=tuple(transforms.std), interpolation=transforms.interpolation.value)


def _from_timm(name: str) -> ModelInfo:
    try:
        import timm
    except ImportError as exc:
        raise ConfigError(f"model=timm:{name} needs timm ({exc}): pip install 'hpcdl[timm]'") from None
    if not timm.is_model(name):
        raise _unknown(name, "timm", timm.list_models())
    cfg = timm.get_pretrained_cfg(name)
    cfg = cfg.to_dict() if cfg is not None else {}

    def build(num_classes: int, in_channels: int = 3) -> nn.Module:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels)

    return ModelInfo(f"timm:{name}", build, int(cfg.get("input_size", (3, 224, 224))[-1]), f"timm's {name}",
                     build_channels=build, mean=tuple(cfg["mean"]) if "mean" in cfg else None,
                     std=tuple(cfg["std"]) if "std" in cfg else None, interpolation=cfg.get("interpolation"))


def _from_module(name: str) -> ModelInfo:
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ConfigError(f"model={name}: cannot import {module} ({exc}); put its folder on PYTHONPATH, or "
                          "pip install its package, where the ranks run") from None
    except AttributeError:
        raise ConfigError(f"model={name}: {module} has no {attr!r}") from None
    if not callable(fn) or isinstance(fn, type) and not issubclass(fn, nn.Module):
        raise ConfigError(f"model={name}: {attr} is not a model builder (a {type(fn).__name__}); give a function or "
                          "nn.Module class that takes num_classes and returns the model")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ConfigError(f"model={name}: {attr} is a builtin without a signature, not a model builder; give a "
                          "function or nn.Module class that takes num_classes and returns the model") from None
    keywords = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if "num_classes" not in params and not keywords:
        shown = inspect.signature(fn).replace(return_annotation=inspect.Signature.empty)
        raise ConfigError(f"model={name}: {attr}{shown} takes no num_classes; hpcdl calls the "
                          "builder with num_classes=N (and in_channels=C where it takes it)")
    channels = next((k for k in ("in_channels", "in_chans") if k in params), None)
    build_channels = (lambda n, c: _built(name, fn, num_classes=n, **{channels: c})) if channels else None
    return ModelInfo(name, lambda n: _built(name, fn, num_classes=n), int(getattr(fn, "crop", 224)),
                     f"{attr} from {module}", build_channels=build_channels)


def _built(name: str, fn: Callable, **kwargs) -> nn.Module:
    """``fn(**kwargs)``, which must be an ``nn.Module``: a ConfigError naming ``model=name`` when the call does
    not take the arguments or returns something else."""
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    try:
        model = fn(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"model={name}: calling it with {shown} failed ({exc}); hpcdl calls the builder with "
                          "num_classes=N (and in_channels=C where it takes it)") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={name}: called with {shown} it returned a {type(model).__name__}, not a "
                          "torch.nn.Module; give the function that builds the model")
    return model


@functools.cache
def model_info(name: str) -> ModelInfo:
    """What ``model=name`` names (see the module's doc); a ConfigError naming it, with the closest names, when
    it names nothing."""
    names.check_model(name)
    if name in MODELS:
        return MODELS[name]
    source, _, rest = name.partition(":")
    if source == "torchvision":
        return _from_torchvision(rest)
    if source == "timm":
        return _from_timm(rest)
    return _from_module(name)


def build_model(name: str, num_classes: int = 1000, in_channels: int = 3) -> nn.Module:
    """``name`` with ``num_classes`` outputs; with ``in_channels`` other than 3 (gray images: 1), its first
    convolution takes that many channels, initialized as the model initializes it."""
    info = model_info(name)
    if info.build_channels is not None:
        return info.build_channels(num_classes, in_channels)
    model = info.build(num_classes)
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


def with_model_defaults(cfg):
    """``cfg`` (a RunConfig) with ``crop: 0`` resolved to the model's stated input size, and a line saying so
    (empty when nothing was filled in). Resolved where torch is (the trainer, ``hpcdl sbatch``'s check)."""
    if cfg.crop:
        return cfg, ""
    info = model_info(cfg.model.name)
    return dataclasses.replace(cfg, crop=info.crop), f"crop {info.crop}: the input size {info.description} states"
