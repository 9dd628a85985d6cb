import platform

import pytest
import torch
from conftest import SIMULATED_CPUS

from hpcdl.errors import ConfigError
from hpcdl.config import LoopConfig
from hpcdl.models import build_model
from hpcdl.train.precision import choose_memory_format, choose_precision
from hpcdl.utils import cpu_flags, cpu_flags_simulated

AUTO = {"simulated Sapphire Rapids (AMX)": ("bf16", "avx512_bf16 and amx_bf16"),
        "simulated Cooper Lake (AVX-512 bf16, no AMX)": ("bf16", "avx512_bf16"),
        "simulated Skylake/Ice Lake (AVX-512, no bf16)": ("fp32", "no avx512_bf16 or amx_bf16"),
        "simulated EPYC Zen 3 (AVX2 only)": ("fp32", "no avx512_bf16 or amx_bf16")}


def test_auto_follows_the_cpu_flags():
    assert choose_precision("auto", {"avx2", "avx512f", "avx512_bf16"}) == ("bf16", "auto: the CPU has avx512_bf16")
    assert choose_precision("auto", {"avx2", "amx_bf16", "amx_tile"})[0] == "bf16"
    precision, why = choose_precision("auto", {"avx2", "fma"})
    assert precision == "fp32" and "no avx512_bf16 or amx_bf16" in why
    assert "emulated" in choose_precision("bf16", {"avx2"})[1]
    with pytest.raises(ConfigError, match="auto, fp32, bf16"):
        choose_precision("fp16")


def test_this_machine_reads_its_flags():
    flags = cpu_flags()
    if platform.machine() == "x86_64":
        assert {"sse2", "avx2"} <= flags, flags  # every x86-64 CPU hpcdl targets has them
    expected = "bf16" if {"avx512_bf16", "amx_bf16"} & flags else "fp32"
    assert choose_precision("auto")[0] == expected


@pytest.mark.parametrize("cpu", sorted(SIMULATED_CPUS))
def test_detection_reports_the_simulated_flags_and_auto_follows_them(cpu, monkeypatch):
    monkeypatch.setenv("HPCDL_SIMULATE_CPU_FLAGS", SIMULATED_CPUS[cpu].replace(" ", ",", 1))
    assert cpu_flags() == set(SIMULATED_CPUS[cpu].split()) and cpu_flags_simulated()
    precision, why = choose_precision("auto")
    assert (precision, AUTO[cpu][1] in why) == (AUTO[cpu][0], True), why
    assert why.endswith("(flags simulated by HPCDL_SIMULATE_CPU_FLAGS)")
    monkeypatch.delenv("HPCDL_SIMULATE_CPU_FLAGS")
    assert not cpu_flags_simulated() and "simulated" not in choose_precision("auto")[1]


def test_auto_memory_format_is_channels_last_for_convolutional_bodies_and_contiguous_for_a_vit():
    """A ViT's one convolution embeds its patches: channels_last made its bf16 step 0.82x on a Sapphire Rapids
    Xeon, where ResNet-50's and ConvNeXt-T's went 1.42x and 1.07x (docs/performance.md)."""
    with torch.device("meta"):
        models = {name: build_model(name, 10) for name in ("resnet18", "timm:vit_tiny_patch16_224",
                                                             "torchvision:convnext_tiny")}
    assert choose_memory_format("auto", models["resnet18"]) == (True, "auto: 20 convolutions")
    assert choose_memory_format("auto", models["torchvision:convnext_tiny"])[0] is True
    assert choose_memory_format("auto", models["timm:vit_tiny_patch16_224"]) == \
        (False, "auto: one convolution (a patch embedding)")
    assert choose_memory_format("auto", torch.nn.Linear(4, 2)) == (False, "auto: no convolution")
    assert choose_memory_format("true", models["timm:vit_tiny_patch16_224"]) == (True, "requested")
    assert choose_memory_format("false", models["resnet18"]) == (False, "requested")


def test_channels_last_takes_a_yaml_bool_and_refuses_other_words():
    assert LoopConfig(channels_last=True).channels_last == "true" and LoopConfig().channels_last == "auto"
    with pytest.raises(ConfigError, match="loop.channels_last"):
        LoopConfig(channels_last="nhwc")
