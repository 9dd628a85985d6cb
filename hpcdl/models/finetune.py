"""Fine-tuning: starting weights (``model.weights=PATH``) and the learning rate per parameter.

:func:`read_weights` reads a torch state dict (``.pt``/``.pth``/``.bin``, with ``weights_only``), a
safetensors file, or an hpcdl checkpoint (its ``model`` part); a run folder means its newest checkpoint.
:func:`load_weights` puts them in a model: the classifier head (:func:`head_names`) keeps its initialization
when its shape differs (another ``num_classes``); a first convolution of 3 channels given to a model of 1
(gray images) is summed over them, as timm's ``adapt_input_conv`` does; every other difference is an error
that lists the keys. Nothing is downloaded: the nodes of a cluster have no network.

:func:`lr_scales` gives each parameter its factor of the schedule's lr: ``model.body_lr_scale`` for all
but the head, times timm's layer decay (``model.layer_decay``: block i of n gets decay ** (n - i), from the
model's ``group_matcher``, as timm's ``param_groups_layer_decay``).
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.nn as nn

from hpcdl.errors import ConfigError
from hpcdl.runs.folder import RunFolder, checkpoints_in

__all__ = ["fetch_hint", "head_names", "load_weights", "lr_scales", "read_weights"]

_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers, in files saved from them
# where trainers keep the model's part; eval_model first: a Schedule-Free run's averaged weights (hpcdl.optim.modes)
_NESTED = ("eval_model", "model", "state_dict", "model_state_dict", "module")


def fetch_hint(model: str) -> str:
    """How to fetch ``model``'s published weights on a login node (which has the network the nodes lack)."""
    source, _, name = model.partition(":")
    if source == "timm":
        return (f"on a login node: hf download timm/{name} model.safetensors --local-dir weights/{name} (or in Python: "
                f"timm.create_model('{name}', pretrained=True) and find model.safetensors under "
                "~/.cache/huggingface/hub); then model.weights=weights/{name}/model.safetensors")
    if source == "torchvision":
        return (f"on a login node: python -c \"import torchvision; torchvision.models.get_model_weights('{name}')"
                ".DEFAULT.get_state_dict(progress=True)\" writes it under ~/.cache/torch/hub/checkpoints; copy it "
                "to the shared filesystem and give that path")
    return "copy the file to a filesystem the nodes mount (a login node can download; the nodes cannot)"


def read_weights(path: str, model: str = "") -> dict[str, torch.Tensor]:
    """The tensors of the weights file (or run folder) at ``path``, keyed by parameter name."""
    path = os.path.expanduser(os.path.expandvars(path))
    if os.path.isdir(path):
        path = _newest_checkpoint(path)
    if not os.path.isfile(path):
        raise ConfigError(f"model.weights={path}: no such file. No download is attempted; {fetch_hint(model)}")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(f"model.weights={path}: reading safetensors needs the safetensors package: "
                              "pip install safetensors (it comes with 'hpcdl[timm]')") from None
        return _unwrapped(load_file(path, device="cpu"), path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.weights={path}: not a state dict torch.load reads with weights_only=True ({why}); "
                          "save it with torch.save(model.state_dict(), PATH), or give a .safetensors file") from None
    return _unwrapped(data, path)


def _newest_checkpoint(folder: str) -> str:
    """The newest whole checkpoint of a run folder, not a chunk_sparse run's per-rank file beside it."""
    found = RunFolder(folder).checkpoint_list() or checkpoints_in(folder)  # a run folder, or its checkpoints/
    if not found:
        raise ConfigError(f"model.weights={folder}: a folder without checkpoints (ckpt-*.pt, or checkpoints/ckpt-*.pt);"
                          " give a weights file or an hpcdl run folder")
    return found[0]


def _unwrapped(data, path: str) -> dict[str, torch.Tensor]:
    """The model's tensors out of what a trainer saved: the mapping itself, or its model part."""
    for _ in range(2):
        if isinstance(data, dict) and not _all_tensors(data):
            data = next((data[k] for k in _NESTED if isinstance(data.get(k), dict)), data)
    if not isinstance(data, dict) or not data or not _all_tensors(data):
        keys = list(data)[:8] if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"model.weights={path}: not a state dict (parameter name -> tensor); found {keys}. Give "
                          "the file of model.state_dict(), a safetensors file or an hpcdl checkpoint")
    out = {}
    for key, value in data.items():
        for prefix in _PREFIXES:
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def _all_tensors(data: dict) -> bool:
    return all(isinstance(v, torch.Tensor) for v in data.values())


def head_names(model: nn.Module, num_classes: int) -> set[str]:
    """The state-dict keys of the classifier head: timm's ``get_classifier()``, else the last linear (or 1x1
    convolution) layer with ``num_classes`` outputs."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, nn.Module) or not any(True for _ in head.parameters()):
        head = None
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.out_features == num_classes or \
                    isinstance(module, nn.Conv2d) and module.out_channels == num_classes:
                head = module
    if head is None:
        return set()
    return {f"{prefix}.{k}" for prefix, m in model.named_modules() if m is head for k in m.state_dict()}


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], num_classes: int, path: str) -> list[str]:
    """Load ``weights`` into ``model``; what was replaced or adapted, a line each. A ConfigError lists the keys
    of every other difference."""
    own = model.state_dict()
    head = head_names(model, num_classes)
    notes, load = [], {}
    missing = [k for k in own if k not in weights and k not in head and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in weights if k not in own]
    wrong = []
    for key, value in weights.items():
        if key not in own:
            continue
        want = own[key].shape
        if value.shape == want:
            load[key] = value
        elif key in head:
            notes.append(f"{key} {list(value.shape)} -> {list(want)}")
        elif value.dim() == 4 and value.shape[1] == 3 and want[1] == 1 and value.shape[0] == want[0] \
                and value.shape[2:] == want[2:]:
            load[key] = value.sum(dim=1, keepdim=True)  # RGB filters on a gray image: the sum of the three
            notes.append(f"{key}: 3 input channels summed into the 1 of data.channels=1")
        else:
            wrong.append(f"{key} {list(value.shape)} (the model's {list(want)})")
    absent = sorted(k for k in head if k not in weights)
    kept = sorted(k for k in head if k in load)
    if kept:  # the file's classifier of the same shape: the same classes, or others in the same number
        notes.append(f"{', '.join(kept)}: the file's head, of this model's shape ({num_classes} classes), loaded as it "
                     "is; if the file's classes are not data.train's, its head only starts the training")
    if absent:
        notes.append(f"{', '.join(absent)}: not in the file, kept at their initialization")
    problems = [f"{what}: {', '.join(keys[:12])}{' ...' if len(keys) > 12 else ''}"
                for what, keys in (("wrong shape", wrong), ("missing from the file", missing),
                                   ("not in the model", unexpected)) if keys]
    if problems:
        raise ConfigError(f"model.weights={path} does not fit this model ({len(wrong)} of wrong shape, {len(missing)} "
                          f"missing, {len(unexpected)} unknown): " + "; ".join(problems) +
                          ". Give weights of the same architecture (model=, data.channels as they were trained)")
    model.load_state_dict(load, strict=False)
    return notes


def lr_scales(model: nn.Module, num_classes: int, body_lr_scale: float = 1.0, layer_decay: float = 1.0,
              needed: bool = True) -> tuple[dict[str, float], set[str]]:
    """Each parameter's factor of the lr (only those not 1), and the names of the body's parameters (all but
    the head's: ``model.freeze_body_epochs`` sets their lr to 0). ``needed``: whether an option asked for the
    head (a scale, a freeze); without, a model with no detectable head gets every parameter at the lr."""
    head = head_names(model, num_classes)
    if not head and not needed:
        return {}, set()
    if not head:
        raise ConfigError(f"model: no classifier head found (no linear layer with num_classes={num_classes} "
                          "outputs, no timm get_classifier()): body_lr_scale, freeze_body_epochs and the head's "
                          "replacement need one")
    names = [n for n, _ in model.named_parameters()]
    layer = _layer_scales(model, names, layer_decay) if layer_decay != 1.0 else {}
    scales = {}
    for name in names:
        scale = 1.0 if name in head else body_lr_scale * layer.get(name, 1.0)
        if scale != 1.0:
            scales[name] = scale
    return scales, {n for n in names if n not in head}


def _layer_scales(model: nn.Module, names: list[str], decay: float) -> dict[str, float]:
    if not hasattr(model, "group_matcher"):
        raise ConfigError(f"model.layer_decay={decay}: needs a model that names its blocks (timm's group_matcher: "
                          "timm:NAME models); set model.layer_decay=1 for this one")
    from timm.models import group_parameters

    layers = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    top = max(layers.values())
    return {n: decay ** (top - layers.get(n, top)) for n in names}
