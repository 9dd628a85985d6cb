"""``hpcdl plan``: the performance model's step time, time to train and efficiency at each node count."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from hpcdl.bench.runner import Job, Output
from hpcdl.cli.common import command
from hpcdl.distributed.ranks.env import discover
from hpcdl.launch.profiles import get_profile
from hpcdl.plan.data_path import DataPathInputs, format_data_path, published_runs
from hpcdl.model_facts import model_facts
from hpcdl.plan.failures import FailureModel, format_failures
from hpcdl.plan.optimizer_terms import OptimizerModel, format_optimizer
from hpcdl.plan.planner import PlanInputs, PlanQuestion, format_plan, plot
from hpcdl.plan.planner import plan as planned
from hpcdl.plan.validate import format_validation, validate
from hpcdl.presets import get_preset
from hpcdl.utils import atomic_write_text


@dataclass(kw_only=True, slots=True)
class PlanCommand:
    validate: bool = False  # check the model against the published runs instead (the other flags are ignored)


def add_commands(sub) -> None:
    command(sub, "plan", plan, PlanCommand, PlanQuestion, PlanInputs, FailureModel, DataPathInputs, Output,
            help="predict step time, time to train and efficiency at each node count",
            description="A performance model (docs/scaling.md): per-node compute, the all-reduce's alpha-beta cost, "
                        "its overlap with backward, data loading. --validate checks it against published Stampede2 "
                        "runs. After the plan: start-up, failures and the data path (direct reads, staging, the cache).",
            defer=(PlanQuestion,))


def plan(cmd: PlanCommand, question, inputs: PlanInputs, failures: FailureModel, data: DataPathInputs,
         output: Output) -> int:
    job = Job(env=discover())  # %j in --json and --plot, as the benchmarks expand it
    json_path, plot_path = (job.expand(p) if p else None for p in (output.json_path, output.plot_path))
    if cmd.validate:
        return _validate(json_path)

    question, workers = question(), None  # built here: --validate needs no --nodes or --batch
    if question.preset:
        cfg = get_preset(question.preset)
        inputs = dataclasses.replace(inputs, model=cfg.model.name, classes=cfg.num_classes, optimizer=cfg.optimizer.name)
        workers = cfg.data.workers
    model, notes = inputs.build()
    optimizer = OptimizerModel.of(inputs.optimizer, model_facts(inputs.model, inputs.classes), model.network,
                                  model.ranks_per_node, inputs.optim_json, inputs.hook,
                                  inputs.backend)  # a bad --optim-json before any table
    startup, startup_notes = inputs.startup(model)
    notes += startup_notes
    rows = planned(model, list(question.nodes), question.batch, question.epochs, question.train_images, startup)
    title = (f"{question.preset + ': ' if question.preset else ''}{inputs.model}, global batch {question.batch}, {question.epochs:g} epochs of "
             f"{question.train_images:,} images")
    write_s = startup.checkpoint_bytes / startup.fs_read_bytes_s  # one rank writes it, at one writer's bandwidth
    for row in rows:
        row["failures_model"] = failures.terms(row["nodes"], row["time_to_train_s"], row["step_s"], write_s,
                                               row["restart_s"])
    print(format_plan(rows, "\n".join(f"# {line}" for line in [title, *notes])))
    print(format_failures(rows, failures))
    for row in rows:
        row["optimizer"] = optimizer.terms(row["nodes"])
    print(format_optimizer(optimizer, [row["optimizer"] for row in rows]))
    path, why_not = data.model(get_profile(inputs.profile), inputs.fs_gb_s, inputs.fs_opens_per_s,
                               model.network.bandwidth_bytes_s, question.train_images, workers)
    published = published_runs(path) if path else []
    for row in rows if path else ():
        row["data_path"] = path.terms(row["nodes"], row["ranks"], row["images_s"], row["epoch_s"], row["time_to_train_s"])
    print(format_data_path(path, [r["data_path"] for r in rows], published) if path else why_not)
    if json_path:
        _write(json_path, {"inputs": dataclasses.asdict(inputs), "failures": dataclasses.asdict(failures),
                           "data_path": dataclasses.asdict(data), "notes": notes, "rows": rows,
                           "data_path_published": published})
    if plot_path:
        plot(rows, title, plot_path)
    return 0


def _validate(json_path: str | None) -> int:
    rows = validate()
    print(format_validation(rows))
    if json_path:
        _write(json_path, rows)
    return 0


def _write(path: str, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
