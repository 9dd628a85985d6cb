"""Optional CPU accelerators around the model: IPEX's ``ipex.optimize`` and ``torch.compile``.

IPEX is archived; each release matches one torch minor version (its last, 2.8, needs torch 2.8.*).
It is used when it imports and matches the running torch; otherwise the log says why not, and
training runs on native PyTorch.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def ipex_module(mode: str):
    """(the imported ``intel_extension_for_pytorch`` or None, why) for ``loop.ipex`` auto | off."""
    if mode == "off":
        return None, "off (loop.ipex=off)"
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError as exc:
        return None, f"not installed ({exc.msg}); pip install 'hpcdl[ipex]' in a torch 2.8 environment to use it"
    except Exception as exc:  # a mismatched IPEX raises at import time, not ImportError
        return None, f"unusable here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    want, have = ".".join(ipex.__version__.split(".")[:2]), ".".join(torch.__version__.split(".")[:2])
    if want != have:
        return None, f"IPEX {ipex.__version__} needs torch {want}.*, this is torch {torch.__version__}"
    return ipex, f"IPEX {ipex.__version__} on torch {torch.__version__}"


def apply_ipex(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, precision: str,
               mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, str]:
    """``ipex.optimize`` the model and optimizer when IPEX is usable; returns them and a line for the log."""
    ipex, why = ipex_module(mode)
    if ipex is None:
        return model, optimizer, f"ipex: not used, {why}"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=dtype, inplace=True)
    return model, optimizer, f"ipex: ipex.optimize applied ({why}, {precision})"
