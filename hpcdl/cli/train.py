"""``hpcdl train``, ``hpcdl presets`` and ``hpcdl timeline``: runs, their configs and their traces."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import inspect
from dataclasses import dataclass, field

from hpcdl.cli.common import command, exit_code
from hpcdl.config import describe, dump_yaml
from hpcdl.deferred import deferred
from hpcdl.errors import HpcdlError
from hpcdl.flags import add_flags, config_from_args, meta
from hpcdl.model_facts import model_facts
from hpcdl.names import MODELS
from hpcdl.presets import PRESETS, resolve
from hpcdl.runs.preflight import preflight
from hpcdl.runs.timeline import merge as merged
from hpcdl.runs.timeline import render as rendered

_SET = "override a field, e.g. --set data.train=$SCRATCH/imagenet1k/train --set optimizer.momentum=0.95 (repeatable)"


@dataclass(kw_only=True, slots=True)
class TrainCommand:
    # a preset name (hpcdl presets) or a YAML file (a run folder's config.yaml, or 'preset: NAME' plus the keys to change)
    config: str = field(metadata=meta(positional=True))
    set: tuple[str, ...] = field(default=(), metadata=meta(repeat=True, metavar="KEY=VALUE"))  # override a field (repeatable)
    print_config: bool = False  # print the resolved config as YAML and exit


@dataclass(kw_only=True, slots=True)
class PresetsCommand:
    action: str = field(default="list", metadata=meta(positional=True, choices=("list", "show")))
    name: str | None = field(default=None, metadata=meta(positional=True))  # the preset to show
    set: tuple[str, ...] = field(default=(), metadata=meta(repeat=True, metavar="KEY=VALUE"))  # override a field (repeatable)


@dataclass(kw_only=True, slots=True)
class TimelineMerge:
    run_dir: str = field(metadata=meta(positional=True))  # the run folder (its timeline/ holds every rank's spans)


@dataclass(kw_only=True, slots=True)
class TimelineRender:
    trace: str = field(metadata=meta(positional=True))  # a merged trace (RUN_DIR/timeline.json)
    out: str  # the PNG to write
    steps: int = 1  # training steps to show
    skip: int = 2  # steps to skip first (start-up)


def add_commands(sub) -> None:
    command(sub, "train", train, TrainCommand, help="train a preset or a YAML config on this job's ranks",
            description="Runs the same under srun, mpiexec, torchrun, submitit and as one process; resumes from the "
                        "newest checkpoint in the run folder. --set: " + _SET)
    command(sub, "presets", presets, PresetsCommand, help="list the presets of published runs, or show one resolved")
    timeline = sub.add_parser("timeline", help="per-rank trace timelines").add_subparsers(dest="action", required=True)
    command(timeline, "merge", merge, TimelineMerge,
            help="all ranks' spans as RUN_DIR/timeline.json (chrome://tracing, Perfetto)")
    command(timeline, "render", render, TimelineRender,
            help="a PNG of a merged trace's steps (needs matplotlib: hpcdl[plot])")


def train(cmd: TrainCommand) -> int:
    cfg = resolve(cmd.config, cmd.set)
    if cmd.print_config:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    return exit_code(deferred("hpcdl.train.trainer:train")(cfg)["outcome"])


def parse_train(argv: list[str]) -> TrainCommand:
    """``train CONFIG --set ...`` (``argv[0]`` is ``train``) as ``hpcdl train`` reads it: what ``hpcdl sbatch`` and
    ``submit`` check before anything is submitted."""
    parser = argparse.ArgumentParser(prog="hpcdl train")
    add_flags(parser, TrainCommand)
    return config_from_args(TrainCommand, parser.parse_args(argv[1:]))


def checked_config(cmd: TrainCommand, ranks: int):
    """The train command's config as it will run on ``ranks`` ranks: errors before anything is submitted. A
    model from torchvision, timm or a module of one's own is resolved (and its facts counted for the planner)
    in a subprocess, which imports torch where this process does not."""
    cfg = resolve(cmd.config, cmd.set)
    if cfg.model.name not in MODELS:
        facts = model_facts(cfg.model.name)
        cfg = dataclasses.replace(cfg, crop=cfg.crop or facts.crop)  # crop: 0, the model's (as the trainer does)
    return preflight(cfg, ranks)


def presets(cmd: PresetsCommand) -> int:
    if cmd.action == "show":
        if not cmd.name:
            raise HpcdlError("hpcdl presets show NAME: name a preset (hpcdl presets lists them)")
        sys.stdout.write(describe(resolve(cmd.name, cmd.set)))
        if cmd.name in PRESETS:  # where each number comes from
            sys.stdout.write("\n" + inspect.cleandoc(PRESETS[cmd.name].__doc__ or "") + "\n")
        return 0
    for name, fn in PRESETS.items():
        cfg = fn()
        first = (fn.__doc__ or describe(cfg).splitlines()[0]).strip().splitlines()[0]
        print(f"{name:28s} {cfg.model.name:10s} batch {cfg.global_batch:>6,} x {cfg.ranks:>4} ranks  {first}")
    return 0


def merge(cmd: TimelineMerge) -> int:
    print(merged(cmd.run_dir))
    return 0


def render(cmd: TimelineRender) -> int:
    print(rendered(cmd.trace, cmd.out, steps=cmd.steps, skip=cmd.skip))
    return 0
