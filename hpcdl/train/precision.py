"""Training precision and memory format: ``auto`` picks bf16 only on CPUs with native bf16 arithmetic, and
channels_last only for models whose convolutions run past their stem; each says why.

Without AVX512-BF16 or AMX, bf16 math is emulated: on an AVX2 Zen 3 it runs 13-26x slower than fp32.
"""

from __future__ import annotations

import torch

from hpcdl.errors import ConfigError
from hpcdl.names import MEMORY_FORMATS, PRECISIONS
from hpcdl.utils import NATIVE_BF16, SIMULATED_FLAGS_VAR, cpu_flags, cpu_flags_simulated


def choose_precision(requested: str, flags: set[str] | None = None) -> tuple[str, str]:
    """(``fp32`` or ``bf16``, the reason, for the start-up log)."""
    if requested not in PRECISIONS:
        raise ConfigError(f"precision {requested!r} is unknown; choose one of {', '.join(PRECISIONS)}")
    simulated = flags is None and cpu_flags_simulated()
    flags = cpu_flags() if flags is None else flags
    precision, why = _rule(requested, [f for f in NATIVE_BF16 if f in flags])
    return precision, why + (f" (flags simulated by {SIMULATED_FLAGS_VAR})" if simulated else "")


def _rule(requested: str, native: list[str]) -> tuple[str, str]:
    if requested == "fp32":
        return "fp32", "requested"
    if requested == "bf16":
        return "bf16", "requested" + ("" if native else "; this CPU has no avx512_bf16 or amx_bf16, so bf16 is "
                                                         "emulated and many times slower than fp32")
    if native:
        return "bf16", f"auto: the CPU has {' and '.join(native)}"
    return "fp32", "auto: the CPU has no avx512_bf16 or amx_bf16; emulated bf16 would be slower than fp32"


def choose_memory_format(requested: str, model: torch.nn.Module) -> tuple[bool, str]:
    """(whether the model and its batches go channels_last, the reason, for the start-up log).

    ``auto``: channels_last where the model has more than one 2-D convolution, so that its body works on
    images; contiguous where its one convolution embeds the patches and the rest works on tokens (a ViT).
    Measured in bf16 (``hpcdl bench step --only precision``, channels_last against contiguous): ResNet-50
    1.42x and ConvNeXt-T 1.07x on a Sapphire Rapids Xeon with AMX; ViT-Tiny 0.82x there (the conversion to and
    from NHWC around its patch embedding costs more than the embedding gains), 1.05x on the 2-core EPYC."""
    if requested not in MEMORY_FORMATS:
        raise ConfigError(f"loop.channels_last={requested!r}: choose one of {', '.join(MEMORY_FORMATS)}")
    if requested != "auto":
        return requested == "true", "requested"
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    if convs > 1:
        return True, f"auto: {convs} convolutions"
    return False, f"auto: {'one convolution (a patch embedding)' if convs else 'no convolution'}"
