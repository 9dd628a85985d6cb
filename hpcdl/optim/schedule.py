"""Learning-rate schedules, per iteration, as pure functions of the step: resuming needs only the step.

    peak     = base_lr * global_batch / base_batch          (the linear scaling rule; base_batch None: base_lr)
    W        = round(warmup_epochs * steps_per_epoch),  T = epochs * steps_per_epoch
    warmup   : lr(s) = warmup_start_lr + (peak - warmup_start_lr) * s / W                    for s < W
    poly     : lr(s) = end_lr + (peak - end_lr) * (1 - (s - W) / (T - W)) ** power            (MLPerf: after warmup)
    poly_caffe: lr(s) = peak * (1 - s / T) ** power                                          (Caffe: from step 0)
    cosine   : lr(s) = end_lr + (peak - end_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2
    multistep: lr(s) = peak * gamma ** (number of milestones m with s >= round(m * steps_per_epoch))
    constant : lr(s) = peak

After T the lr stays at its value at T. ``steps_per_epoch`` is ceil(images / global_batch): hpcdl's
loader pads the last batch of an epoch rather than dropping it, so 1,281,167 images at 32,768 make 40.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hpcdl.errors import ConfigError
from hpcdl.names import DECAYS, check


def steps_per_epoch(images: int, global_batch: int) -> int:
    return math.ceil(images / global_batch)


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    base_lr: float
    base_batch: int | None = None  # None: base_lr is the peak lr at this run's batch
    global_batch: int = 256
    steps_per_epoch: int = 1
    epochs: float = 90
    warmup_epochs: float = 0.0
    warmup_start_lr: float = 0.0
    decay: str = "poly"
    power: float = 2.0
    end_lr: float = 0.0
    milestones: tuple[float, ...] = (30, 60, 80)  # epochs, for multistep
    gamma: float = 0.1

    def __post_init__(self):
        check("schedule.decay", self.decay, DECAYS)
        if self.steps_per_epoch < 1 or self.epochs <= 0:
            raise ConfigError(f"schedule needs steps_per_epoch >= 1 and epochs > 0 (got {self.steps_per_epoch}, "
                              f"{self.epochs})")
        if self.warmup_steps >= self.total_steps:
            raise ConfigError(f"warmup_epochs {self.warmup_epochs} covers the whole run of {self.epochs} epochs")

    @property
    def peak_lr(self) -> float:
        return self.base_lr * (self.global_batch / self.base_batch if self.base_batch else 1.0)

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_epochs * self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return round(self.epochs * self.steps_per_epoch)

    def lr(self, step: int) -> float:
        s, w, t, peak = min(step, self.total_steps), self.warmup_steps, self.total_steps, self.peak_lr
        if s < w:
            return self.warmup_start_lr + (peak - self.warmup_start_lr) * s / w
        frac = (s - w) / (t - w)
        if self.decay == "poly":
            return self.end_lr + (peak - self.end_lr) * (1 - frac) ** self.power
        if self.decay == "poly_caffe":
            return peak * (1 - s / t) ** self.power
        if self.decay == "cosine":
            return self.end_lr + (peak - self.end_lr) * (1 + math.cos(math.pi * frac)) / 2
        if self.decay == "multistep":
            passed = sum(s >= round(m * self.steps_per_epoch) for m in self.milestones)
            return peak * self.gamma ** passed
        return peak


class LRSchedule:
    """Sets each optimizer group's lr from a :class:`ScheduleConfig`, one call of :meth:`step` per iteration.

    ``state_dict`` holds the step and the config, so a resumed run continues at the same lr and a run
    resumed with a different schedule is refused.
    """

    def __init__(self, optimizer, cfg: ScheduleConfig, freeze_steps: int = 0):
        self.optimizer, self.cfg, self.step_count, self.freeze_steps = optimizer, cfg, 0, freeze_steps
        self._apply()

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def current_lr(self) -> float:
        return self.cfg.lr(self.step_count)

    def _apply(self) -> None:
        """Each group's lr: the schedule's, times the group's ``lr_scale`` (fine-tuning's body and layer decay),
        and 0 for the body's groups in the first ``freeze_steps`` steps."""
        lr, frozen = self.current_lr(), self.step_count < self.freeze_steps
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0 if frozen and group.get("body") else lr * group.get("lr_scale", 1.0)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()}
        if saved != asdict(self.cfg):
            changed = sorted(k for k in saved if saved[k] != asdict(self.cfg).get(k))
            raise ConfigError(f"the checkpoint's schedule differs in {changed}; resume with the original settings")
        self.step_count = int(state["step"])
        self._apply()
