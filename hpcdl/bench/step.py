"""``hpcdl bench step``: what a training step costs through hpcdl, and what hpcdl's CPU tuning is worth.

Three comparisons, each measured side by side in alternating rounds (the figure is the median):

1. **Precision.** A bare step of the model in fp32 and in bf16 autocast (channels_last both), and
   ``torch.compile`` of the precision ``loop.precision=auto`` picks, with each precision's GEMM rate
   measured in the same run and each step's achieved FLOP rate as a fraction of it
   (:mod:`hpcdl.bench.flops`). Where bf16 is emulated (no avx512_bf16 or AMX) its step is timed once.
2. **Overhead.** In this process, on one rank: hpcdl's step (:class:`hpcdl.train.step.Stepper`, with
   its phase timing, control exchange and lr schedule) against a bare hand-written loop
   (``zero_grad, forward, loss, backward, step``), on the same model, batch, optimizer and threads.
3. **Tuning.** ResNet-50 training throughput of one node running ``ranks_per_node`` ranks (2 by default:
   one per socket, the layout the cluster profiles recommend), each a fresh process computing its own
   steps (no gradient exchange: this isolates the CPU side). Tuned: the allocator ``hpcdl tune --exports``
   selects, and each rank on its own slice of the cores with one thread per core (hpcdl's CPU plan).
   Untuned: PyTorch as it starts, glibc malloc and torch's default threads, every rank on every core.
   The allocator acts only from process start, hence the child processes.

With ``curve_batches``, also the tuned node's images/s at each of those per-rank batches: the
throughput-vs-batch curve that ``hpcdl plan --step-json`` reads as the node's compute.

With ``profile`` (``--profile``), instead: where a bare step of the model goes in fp32 and in bf16, class by
class of work (:mod:`hpcdl.bench.breakdown`), against each precision's GEMM rate.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import NoReturn

import torch

from hpcdl.bench.breakdown import breakdown, format_breakdown
from hpcdl.bench.configs import StepBench as Config
from hpcdl.bench.flops import gemm_gflops, training_flops
from hpcdl.bench.reports import (Breakdown, Compiled, NodeRound, NotCompiled, PrecisionCase, RankSetup, StepCurve,
                                 StepOverhead, StepPrecision, StepReport, StepTuning)
from hpcdl.bench.rounds import alternate, medians, timed_ms
from hpcdl.bench.runner import machine_line
from hpcdl.distributed.affinity import allocator_env, allocator_in_use, plan_cpus
from hpcdl.distributed.group.lifecycle import apply_cpu_plan
from hpcdl.models import build_model, model_info
from hpcdl.optim.factory import OptimConfig, build_optimizer
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig
from hpcdl.train.precision import NATIVE_BF16, choose_memory_format, choose_precision
from hpcdl.train.step import Stepper
from hpcdl.utils import cpu_flags

TUNING_VARS = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def synthetic_training(model_name: str, batch: int, crop: int, seed: int = 0, channels_last: bool = True):
    """(model, LARS, loss, images, labels): one random batch in memory, the same on every call with ``seed``."""

    torch.manual_seed(seed)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(model_name, num_classes=1000).to(memory_format=layout)
    optimizer = build_optimizer(model, OptimConfig(name="lars", lr=1.0, weight_decay=1e-4))
    x = torch.randn(batch, 3, crop, crop).to(memory_format=layout)
    y = torch.randint(0, 1000, (batch,))
    return model, optimizer, torch.nn.CrossEntropyLoss(), x, y


def bare_loop(model_name: str, batch: int, crop: int, precision: str = "fp32", compiled: bool = False,
              channels_last: bool = True):

    model, optimizer, criterion, x, y = synthetic_training(model_name, batch, crop, channels_last=channels_last)
    net = torch.compile(model) if compiled else model
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def step():  # zero_grad last, as hpcdl's step does: both hold the same memory between steps
        with autocast():
            loss = criterion(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hpcdl_loop(model_name: str, batch: int, crop: int):
    model, optimizer, criterion, x, y = synthetic_training(model_name, batch, crop)
    schedule = LRSchedule(optimizer, ScheduleConfig(base_lr=1.0, steps_per_epoch=1000, epochs=10, warmup_epochs=1))
    stepper = Stepper(model, criterion, optimizer, schedule, distributed=False)

    def step():
        stepper.step(iter(((x, y),)), 1)

    return step


def precision(cfg: Config) -> StepPrecision:
    """fp32 against bf16 autocast (and torch.compile of auto's pick), each against its GEMM rate."""

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    auto, why = choose_precision("auto")
    emulated = not set(NATIVE_BF16) & cpu_flags()
    model, _, criterion, x, y = synthetic_training(cfg.model, cfg.batch, cfg.crop)
    flops = training_flops(model, x, y, criterion)
    picks, picks_why = choose_memory_format("auto", model)
    gemm = {p: gemm_gflops(p) for p in ("fp32", "bf16")}
    cases = {p: bare_loop(cfg.model, cfg.batch, cfg.crop, p) for p in ("fp32", "bf16")}
    cases[f"{auto} contiguous"] = bare_loop(cfg.model, cfg.batch, cfg.crop, auto, channels_last=False)
    compiled, step = _compiled_case(cfg, auto) if cfg.compile else (None, None)
    if step is not None:
        cases[f"{auto}+compile"] = step
    rounds, steps = (1, 1) if emulated else (cfg.precision_rounds, cfg.steps)
    times = medians(alternate({name: timed_ms(step, steps) for name, step in cases.items()}, rounds))
    kind = {name: name.split("+")[0].split()[0] for name in times}  # its precision
    rows = {name: PrecisionCase(ms_per_step=ms, images_per_s=cfg.batch / ms * 1e3, gflops=flops / ms / 1e6,
                                gemm_gflops=gemm[kind[name]], of_gemm=flops / ms / 1e6 / gemm[kind[name]])
            for name, ms in times.items()}
    fastest = min(times, key=times.get)
    return StepPrecision(threads=torch.get_num_threads(), memory_format="channels_last", flops_per_step=flops,
                         cases=rows, bf16_emulated=emulated, rounds=rounds, steps=steps, auto=auto, auto_why=why,
                         fastest=fastest, auto_is_fastest=kind[fastest] == auto, compile=compiled,
                         bf16_over_fp32=times["fp32"] / times["bf16"],
                         channels_last_over_contiguous=times[f"{auto} contiguous"] / times[auto],
                         memory_auto=f"{'channels_last' if picks else 'contiguous'} ({picks_why})")


def _compiled_case(cfg: Config, precision: str):
    """torch.compile's step of ``precision`` and its first (compiling) step's time; where it cannot compile
    here, the reason and no step."""
    step = bare_loop(cfg.model, cfg.batch, cfg.crop, precision, compiled=True)
    t0 = time.perf_counter()
    try:
        step()
    except Exception as exc:  # no C++ compiler, an unsupported op: the comparison goes on without it
        return NotCompiled(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"), None
    return Compiled(first_step_s=time.perf_counter() - t0), step


def overhead(cfg: Config) -> StepOverhead:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cases = {"bare loop": bare_loop(cfg.model, cfg.batch, cfg.crop), "hpcdl": hpcdl_loop(cfg.model, cfg.batch, cfg.crop)}
    # the warm-up step puts optimizer state and first-touch allocations outside the timing
    times = alternate({name: timed_ms(step, cfg.steps) for name, step in cases.items()}, cfg.rounds)
    median = medians(times)
    return StepOverhead(threads=torch.get_num_threads(), ms_per_step=median,
                        rounds_ms={k: tuple(v) for k, v in times.items()}, ratio=median["hpcdl"] / median["bare loop"])


def _child_env(tuned: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TUNING_VARS}
    if tuned:
        env.update(allocator_env("auto")[1])
    return env


def _node_round(cfg: Config, tuned: bool) -> NodeRound:
    """``ranks_per_node`` children at once; the node's throughput is the sum of theirs."""
    spec = {"tuned": tuned, "model": cfg.tuning_model, "batch": cfg.tuning_batch, "crop": cfg.tuning_crop,
            "steps": cfg.tuning_steps}
    return node_round(spec, cfg.ranks_per_node, _child_env(tuned))


def node_round(spec: dict, ranks: int, env: dict[str, str]) -> NodeRound:
    """``ranks`` children of :func:`child` at once, each a local rank of ``spec`` started with ``env``; the node's
    images/s is the sum of theirs, its memory the sum of their peak resident sets.

    The children time the same stretch: each, after its untimed first step, waits until all are ready, and one
    that finishes first goes on stepping, untimed, until the last has finished. Timed as they came, a child
    whose import ran long could time its steps on a quieter node, and the sum read what the ranks do not give
    together. ``together`` says how much of the timed stretch all of them were in."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(ranks)]
        procs = [stack.enter_context(subprocess.Popen(
            [sys.executable, "-m", "hpcdl.bench.step", json.dumps({**spec, "local_rank": r, "local_size": ranks})],
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env))
            for r, log in enumerate(logs)]
        try:
            for p, log in zip(procs, logs):
                _child_says(p, log, spec)
            for p, log in zip(procs, logs):
                try:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                except OSError:  # it ended after its first step
                    _child_failed(p, log, spec)
            results = [json.loads(_child_says(p, log, spec)) for p, log in zip(procs, logs)]
        finally:
            for p in procs:  # the last result read: the untimed steps end here
                p.kill()
                p.wait()
    began, ended = min(r["timed"][0] for r in results), max(r["timed"][1] for r in results)
    latest = max(r["timed"][0] for r in results)
    return NodeRound(images_per_s=sum(r["images_per_s"] for r in results), threads=results[0]["threads"],
                     allocator=results[0]["allocator"], peak_rss_mb=sum(r["peak_rss_mb"] for r in results),
                     together=(ended - latest) / (ended - began) if ended > began else 1.0)


_SAYS = "@hpcdl-bench-step "  # the children's lines to node_round, each on a line of its own


def _child_says(p: subprocess.Popen, log, spec: dict) -> str:
    """What the child says next (its stdout's next line that starts with _SAYS); its stderr when it ends first."""
    for line in p.stdout:
        if line.startswith(_SAYS):
            return line[len(_SAYS):]
    _child_failed(p, log, spec)


def _child_failed(p: subprocess.Popen, log, spec: dict) -> NoReturn:
    p.wait()
    log.seek(0)
    raise RuntimeError(f"bench step child ({json.dumps(spec)}) failed (exit {p.returncode}):\n{log.read()[-3000:]}")


def child(spec: dict) -> None:
    """One rank's throughput; tuned: hpcdl's CPU plan for this local rank (its cores, one thread each). Its
    lines to :func:`node_round`: "ready" after the first step; on "go", the timed steps, then the result as JSON,
    then untimed steps until node_round ends it."""
    if spec["tuned"]:
        apply_cpu_plan(plan_cpus(local_rank=spec["local_rank"], local_size=spec["local_size"]))
    step = bare_loop(spec["model"], spec["batch"], spec["crop"], spec.get("precision", "fp32"),
                     channels_last=spec.get("channels_last", True))
    step()
    print(f"\n{_SAYS}ready", flush=True)  # a newline first: a library's unended line stays on its own
    if not sys.stdin.readline():
        return  # node_round has gone
    t0 = time.monotonic()  # CLOCK_MONOTONIC, the same in every process of this node
    for _ in range(spec["steps"]):
        step()
    t1 = time.monotonic()
    print(f"\n{_SAYS}" + json.dumps({"images_per_s": spec["batch"] * spec["steps"] / (t1 - t0), "timed": [t0, t1],
                                      "threads": torch.get_num_threads(), "allocator": allocator_in_use(),
                                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}),
          flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # readable once node_round has gone
        step()


def tuning(cfg: Config) -> StepTuning:
    runs = alternate({name: (lambda tuned=name == "tuned": _node_round(cfg, tuned)) for name in ("untuned", "tuned")},
                     cfg.tuning_rounds, warmup=0)
    median = medians(runs, key=lambda r: r.images_per_s)
    return StepTuning(images_per_s=median, runs={k: tuple(v) for k, v in runs.items()},
                      ratio=median["tuned"] / median["untuned"],
                      setup={k: RankSetup(v[0].threads, v[0].allocator) for k, v in runs.items()})


def curve(cfg: Config) -> StepCurve:
    """The tuned node's images/s at each per-rank batch of ``curve_batches``, alternating rounds, medians:
    the throughput-vs-batch curve ``hpcdl plan --step-json`` reads."""
    runs = alternate({b: (lambda b=b: _node_round(replace(cfg, tuning_batch=b), True).images_per_s)
                      for b in cfg.curve_batches}, cfg.tuning_rounds, warmup=0)
    return StepCurve(points=tuple((b * cfg.ranks_per_node, v) for b, v in medians(runs).items()),
                     runs={str(b): tuple(v) for b, v in runs.items()})


def profile(cfg: Config) -> tuple[Breakdown, ...]:
    """The breakdown of a bare step of ``cfg.model`` in fp32 and bf16 (one profiled step where bf16 is emulated)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    emulated = not set(NATIVE_BF16) & cpu_flags()
    model, _, criterion, x, y = synthetic_training(cfg.model, cfg.batch, cfg.crop)
    flops = training_flops(model, x, y, criterion)
    del model
    return tuple(breakdown(cfg.model, p, cfg.batch, cfg.crop, 1 if emulated and p == "bf16" else cfg.steps,
                           gemm_gflops(p), flops, lambda p=p: bare_loop(cfg.model, cfg.batch, cfg.crop, p))
                 for p in ("fp32", "bf16"))


def run(cfg: Config, job=None) -> StepReport:
    cfg = replace(cfg, crop=cfg.crop or model_info(cfg.model).crop)  # 0: a named model's stated size
    if cfg.profile:
        return StepReport(config=cfg, profile=profile(cfg))
    return StepReport(config=cfg, precision=precision(cfg) if "precision" in cfg.only else None,
                      overhead=overhead(cfg) if "overhead" in cfg.only else None,
                      tuning=tuning(cfg) if "tuning" in cfg.only else None,
                      curve=curve(cfg) if cfg.curve_batches else None)


def format_report(r: StepReport) -> str:
    c = r.config
    lines = [machine_line(r)]
    for b in r.profile:
        lines += format_breakdown(b)
    if r.precision:
        lines += _precision_lines(r.precision, c)
    if r.overhead:
        o = r.overhead
        lines += [f"training step, {c.model} batch {c.batch} at {c.crop} px, LARS, {o.threads} threads, "
                  f"median of {c.rounds} alternating rounds of {c.steps} steps:",
                  *(f"  {name:10s} {ms:9.1f} ms/step" for name, ms in o.ms_per_step.items()),
                  f"  hpcdl / bare loop: {o.ratio:.3f}x"]
    if r.tuning:
        t = r.tuning
        lines += [f"{c.tuning_model} training, batch {c.tuning_batch} per rank at {c.tuning_crop} px, "
                  f"{c.ranks_per_node} ranks on this node, median of {c.tuning_rounds} alternating rounds of "
                  f"{c.tuning_steps} steps:"]
        for name in ("untuned", "tuned"):
            s = t.setup[name]
            lines.append(f"  {name:8s} {t.images_per_s[name]:7.2f} images/s per node  ({s.threads} threads per "
                         f"rank, {s.allocator.split(':')[0]})")
        lines.append(f"  tuned / untuned: {t.ratio:.2f}x")
    if r.curve:
        lines.append(f"tuned node, {c.tuning_model} at {c.tuning_crop} px, images/s against the node's batch "
                     f"({c.ranks_per_node} ranks), median of {c.tuning_rounds} alternating rounds:")
        lines += [f"  batch {b:5g}  {v:8.2f} images/s" for b, v in r.curve.points]
    return "\n".join(lines) + "\n"


def _precision_lines(p: StepPrecision, c: Config) -> list[str]:
    lines = [f"precision, {c.model} batch {c.batch} at {c.crop} px, {p.memory_format}, LARS, {p.threads} "
             f"threads, {p.flops_per_step / 1e9:.1f} GFLOP a step, median of {p.rounds} alternating rounds of "
             f"{p.steps} steps" + (" (bf16 is emulated here: one step each)" if p.bf16_emulated else "") + ":",
             f"  {'case':16s} {'ms/step':>9s} {'images/s':>9s} {'GFLOP/s':>8s} {'GEMM GFLOP/s':>13s} {'of GEMM':>8s}"]
    for name, row in p.cases.items():
        lines.append(f"  {name:16s} {row.ms_per_step:9.1f} {row.images_per_s:9.2f} {row.gflops:8.1f} "
                     f"{row.gemm_gflops:13.1f} {row.of_gemm:8.0%}")
    lines.append(f"  bf16 / fp32: {p.bf16_over_fp32:.2f}x the speed")
    if p.channels_last_over_contiguous is not None:
        lines.append(f"  channels_last / contiguous ({p.auto}): {p.channels_last_over_contiguous:.2f}x the speed "
                     f"(loop.channels_last=auto takes {p.memory_auto or 'channels_last'} for this model)")
    comp = p.compile
    if isinstance(comp, NotCompiled):
        lines.append(f"  torch.compile did not run here: {comp.error}")
    elif comp:
        plain, compiled = p.cases[p.auto].ms_per_step, p.cases[f"{p.auto}+compile"].ms_per_step
        saved = plain - compiled
        pays = (f"pays for its first step after {comp.first_step_s * 1e3 / saved:.0f} steps" if saved > 0
                else "does not pay: it is no faster")
        lines.append(f"  torch.compile: {plain / compiled:.2f}x the speed of {p.auto}, first step "
                     f"{comp.first_step_s:.0f} s; {pays}")
    verdict = "the fastest measured" if p.auto_is_fastest else f"NOT the fastest measured ({p.fastest})"
    lines.append(f"  loop.precision=auto chose {p.auto} ({p.auto_why}): {verdict}")
    return lines


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
