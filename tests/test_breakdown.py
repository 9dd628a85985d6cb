"""hpcdl bench step --profile: a step's operators sorted into classes of work, and the shares they add to."""

from __future__ import annotations

import dataclasses

import pytest

from hpcdl.bench.breakdown import CLASSES, classify, summarize


@dataclasses.dataclass
class StandInEvent:
    """What the breakdown reads of torch's FunctionEvent (made here: a profile's exact events vary by torch
    build and CPU)."""

    name: str
    self_cpu_time_total: float  # us
    cpu_parent: StandInEvent | None = None


@pytest.mark.parametrize("name, ancestors, kind", [
    ("aten::mkldnn_convolution", ["aten::convolution", "aten::conv2d"], "matrix"),
    ("aten::convolution_backward", ["autograd::engine::evaluate_function: ConvolutionBackward0"], "matrix"),
    ("aten::addmm", ["aten::linear"], "matrix"),
    ("aten::t", ["aten::linear"], "matrix"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", ["aten::scaled_dot_product_attention"], "matrix"),
    ("aten::copy_", ["aten::_to_copy", "aten::to", "aten::conv2d"], "casts"),
    ("aten::_to_copy", ["aten::to", "aten::linear"], "casts"),
    ("aten::native_batch_norm", ["aten::_batch_norm_impl_index", "aten::batch_norm"], "normalization"),
    ("aten::native_layer_norm_backward", ["autograd::engine::evaluate_function: NativeLayerNormBackward0"],
     "normalization"),
    ("aten::relu_", [], "element-wise"),
    ("aten::add_", ["autograd::engine::evaluate_function: AddBackward0"], "element-wise"),
    ("aten::mul_", ["Optimizer.step#LARS.step"], "optimizer"),
    ("aten::zero_", ["aten::fill_", "Optimizer.zero_grad#LARS.zero_grad"], "optimizer"),
    ("autograd::engine::evaluate_function: ReluBackward0", [], "framework"),
])
def test_each_operator_has_its_class(name, ancestors, kind):
    assert classify(name, ancestors) == kind


def test_the_classes_add_up_to_the_wall_time_and_python_is_framework():
    conv = StandInEvent("aten::conv2d", 10.0)
    events = [conv, StandInEvent("aten::mkldnn_convolution", 6000.0, conv),
              StandInEvent("aten::relu_", 1000.0), StandInEvent("Optimizer.step#LARS.step", 100.0)]
    events.append(StandInEvent("aten::mul_", 900.0, events[-1]))
    classes, top = summarize(events, wall_s=0.02, steps=2)  # 20 ms over 2 steps: 10 ms a step
    assert list(classes) == list(CLASSES)
    assert classes["matrix"].ms == pytest.approx(3.005) and classes["matrix"].calls == 1
    assert classes["element-wise"].ms == pytest.approx(0.5)
    assert classes["optimizer"].ms == pytest.approx(0.5)  # the scope's own time and the operators under it
    assert classes["framework"].ms == pytest.approx(10 - 3.005 - 0.5 - 0.5)  # outside any operator
    assert sum(c.share for c in classes.values()) == pytest.approx(1.0)
    assert top[0] == ("aten::mkldnn_convolution", "matrix", pytest.approx(3.0))
