"""A model's facts for the planner, counted by torch on the meta device (no memory, no arithmetic): its fp32
gradient bytes, training FLOPs per image at its crop (forward and backward, a multiply-add is 2), its
parameter tensors and the largest one's elements. How DDP buckets the gradients is the planner's to count (:func:`hpcdl.model_facts.ddp_buckets`):
a model knows nothing of ranks.

``python -m hpcdl.models.count NAME`` prints them as JSON (exit 2 and the reason when NAME names no model):
:func:`hpcdl.model_facts.model_facts` runs it for a model without a row of its own, so that torch stays out of
the login node's process.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from hpcdl.errors import HpcdlError
from hpcdl.models import build_model, model_info

__all__ = ["count", "flop_counter_mode"]


def _conv_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: each of the input's and the weight's gradients costs what the forward does,
    whose count the weight's shape (C_out, C_in / groups, kernel) gets right. torch 2.14's own formula equals this
    for ungrouped convolutions but loses the division by the groups for grouped ones (ConvNeXt-T's depthwise 7x7s:
    68.6 GFLOP of backward against 8.9 of forward; pytorch/pytorch#183405)."""
    forward = flop_counter.conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    """The four gradient products, twice the forward's two, as the math path (and the meta device) counts them;
    torch's flash formula adds the kernel's recomputation of the scores."""
    return 2 * flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter_mode() -> FlopCounterMode:
    """torch's FlopCounterMode with grouped convolutions' backward counted right, and attention counted on the
    CPU: torch 2.14 has no formula for its CPU flash-attention kernels, so a ViT's attention counted 0 on real
    tensors (on the meta device the math path's matrix products are counted, as here)."""
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten.convolution_backward: _conv_backward,
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward})


def count(name: str, num_classes: int = 1000) -> dict:
    """``name``'s facts: the fields of :class:`hpcdl.model_facts.ModelFacts` but its name and buckets."""
    with torch.device("meta"):
        net = build_model(name, num_classes)
        crop = model_info(name).crop
        x = torch.empty(2, 3, crop, crop)
    with flop_counter_mode() as counter:
        net(x).sum().backward()
    return {"gradient_bytes": sum(p.numel() for p in net.parameters()) * 4,
            "train_flops": counter.get_total_flops() / 2, "tensors": sum(1 for _ in net.parameters()), "crop": crop,
            "largest": max(p.numel() for p in net.parameters())}


if __name__ == "__main__":
    try:
        print(json.dumps(count(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000)))
    except HpcdlError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
