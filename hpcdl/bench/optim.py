"""``hpcdl bench optim``: one optimizer step over a model's parameters (ResNet-50 by default), for every
optimizer hpcdl has against torch SGD(foreach=True), side by side: rounds alternate between them and each figure is the
median. Gradients are fixed random tensors, so the step is all that is timed."""

from __future__ import annotations

import torch

from hpcdl import names
from hpcdl.bench.configs import OptimBench as Config
from hpcdl.bench.reports import OptimReport
from hpcdl.bench.rounds import alternate, medians, timed_ms
from hpcdl.models import build_model
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer

def cases() -> dict[str, OptimConfig]:
    """Every optimizer's row in :data:`hpcdl.names.OPTIMIZER_TABLE` at its reference lr (a step's time does not depend
    on the lr), and LARS with Caffe's semantics beside MLPerf's; "sgd" is the baseline of the ratios. Read when the
    benchmark runs: a row added is timed with the others."""
    out = {name: OptimConfig(name=name, lr=row.reference_lr, weight_decay=1e-4)
           for name, row in names.OPTIMIZER_TABLE.items()}
    out["lars (caffe)"] = OptimConfig(name="lars", lr=names.OPTIMIZER_TABLE["lars"].reference_lr, weight_decay=1e-4,
                                      semantics="caffe")
    return out


def run(cfg: Config, job=None) -> OptimReport:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    times = alternate({name: timed_ms(_stepper(cfg.model, oc), cfg.steps) for name, oc in cases().items()}, cfg.rounds)
    median = medians(times)  # the warm-up step created each optimizer's state outside the timing
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return OptimReport(parameters=params, threads=torch.get_num_threads(), ms_per_step=median,
                       ratio_to_sgd={k: v / median["sgd"] for k, v in median.items()},
                       rounds_ms={k: tuple(v) for k, v in times.items()})


def _stepper(model_name: str, oc: OptimConfig):
    torch.manual_seed(0)
    model = build_model(model_name)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    opt = build_optimizer(model, oc)
    return opt.step


def format_report(r: OptimReport) -> str:
    c = r.config
    lines = [f"optimizer step over {c.model} ({r.parameters / 1e6:.1f}M parameters), "
             f"{r.threads} threads, median of {c.rounds} rounds of {c.steps} steps",
             f"{'optimizer':16s} {'ms/step':>9s} {'vs sgd':>8s}"]
    for name, ms in r.ms_per_step.items():
        lines.append(f"{name:16s} {ms:9.1f} {r.ratio_to_sgd[name]:7.2f}x")
    return "\n".join(lines) + "\n"
