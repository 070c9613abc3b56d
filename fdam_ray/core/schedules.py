"""Stage schedules (docs/algorithms.md s.5): which rounds run, with how many local steps and which lr.

``stagewise`` (the paper's experiments): rounds of I local steps; stage s ends at
the first round end at or after s x T0 iterations, then lr is divided by
``lr_decay``. When T0 is not a multiple of I a switch therefore falls up to
I - 1 iterations late, without the delays adding up over stages (warned once).

``geometric`` (the theory): stage s runs R rounds of I_s = I_0 rho^(s-1) local
steps with lr_s = lr_0 / rho^(s-1), so lr_s I_s stays constant.

Both stop after ``iterations`` local steps; the last round is shortened if
needed. A stage switch is announced with the first round of the new stage
(``starts_stage``), so a run resumed with more iterations than it was started
with picks up a switch its old last round would have made.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator

from fdam_ray.core.state import RoundPlan
from fdam_ray.settings.sections import AT_LEAST_ONE, POSITIVE, ConfigError, Section, setting

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleSection(Section):
    """The config fields a schedule reads (``lr`` is lr_0 and ``local_steps`` I_0 for geometric)."""

    name = "schedule"

    schedule: str = setting("stagewise", "stagewise (decay every T0) or geometric (I_s grows by rho).",
                            choices=("stagewise", "geometric"))
    iterations: int = setting(2000, "t, total local steps per client.", check=AT_LEAST_ONE, resume=True,
                              aliases=("steps", "total_iterations"))
    local_steps: int = setting(10, "I, local steps per communication round (I_0 for the geometric schedule).",
                               check=AT_LEAST_ONE, aliases=("i", "local_iterations"))
    lr: float = setting(0.1, "eta (eta_l for CODASCA), local step size.", check=POSITIVE,
                        aliases=("learning_rate", "eta", "eta_l", "local_lr"))
    stage_length: int = setting(1000, "T0, iterations per stage (stagewise).", check=AT_LEAST_ONE, aliases=("t0",))
    lr_decay: float = setting(3.0, "Divisor of lr at each stage end (stagewise).", check=AT_LEAST_ONE,
                              aliases=("decay",))
    stage_growth: float = setting(2.0, "rho, growth of I_s and shrink of lr per stage (geometric).",
                                  check=AT_LEAST_ONE)
    rounds_per_stage: int = setting(10, "R, rounds per stage (geometric).", check=AT_LEAST_ONE)

    def check(self) -> None:
        """The schedule must not decay lr below :data:`MIN_LR` before the run ends."""
        stage, lr = last_stage(self)
        if lr >= MIN_LR:
            return
        if self.schedule == "stagewise":
            knobs = (f"lr={self.lr:g}, lr_decay={self.lr_decay:g}, stage_length={self.stage_length}, "
                     f"iterations={self.iterations}")
            fix = "raise stage_length, or lower lr_decay or iterations"
        else:
            knobs = (f"lr={self.lr:g}, stage_growth={self.stage_growth:g}, rounds_per_stage="
                     f"{self.rounds_per_stage}, local_steps={self.local_steps}, iterations={self.iterations}")
            fix = "raise rounds_per_stage, or lower stage_growth or iterations"
        raise ConfigError(f"config: the schedule ({knobs}) runs {stage} stages and decays lr to {lr:.1e}, below "
                          f"{MIN_LR:g} where float32 steps no longer move the model; {fix}")


@dataclasses.dataclass
class Position:
    """Where a run is in its schedule, after its last finished round (saved in checkpoints)."""

    done: int = 0  # iterations done
    round: int = 0
    stage: int = 1
    stage_rounds: int = 0  # rounds done in the current stage


# Below this step size a float32 update no longer moves a weight (and once lr
# nears 1e-38, CODASCA's control-variate update, scaled by 1/(I lr), overflows
# float32): a schedule that decays this far is a configuration mistake.
MIN_LR = 1e-15


def last_stage(config: ScheduleSection) -> tuple[int, float]:
    """The highest stage a run with ``config`` can reach and its lr (an upper bound on the stage)."""
    if config.schedule == "stagewise":
        stage = max(1, -(-config.iterations // config.stage_length))
        # in logs: lr_decay ** (stage - 1) overflows a float for a long run of short stages
        return stage, math.exp(math.log(config.lr) - (stage - 1) * math.log(config.lr_decay))
    if config.stage_growth == 1:  # lr constant: the stage count does not matter
        return 1, config.lr
    stage, done = 1, 0
    while True:
        steps, lr = geometric_stage(config.local_steps, config.lr, config.stage_growth, stage)
        done += config.rounds_per_stage * steps
        if done >= config.iterations:
            return stage, lr
        stage += 1


def stagewise_lr(lr: float, lr_decay: float, stage: int) -> float:
    """lr_s of stage s of the stagewise schedule: lr_0 / decay^(s-1) (also :class:`fdam_ray.optim.PrimalDualSGD`'s)."""
    return lr / lr_decay ** (stage - 1)


def geometric_stage(local_steps: int, lr: float, growth: float, stage: int) -> tuple[int, float]:
    """(I_s, lr_s) of stage s of the geometric schedule: I_0 rho^(s-1) local steps, lr_0 / rho^(s-1)."""
    factor = growth ** (stage - 1)
    return max(1, round(local_steps * factor)), lr / factor


class Schedule:
    """Generates the :class:`RoundPlan` of every remaining round from a :class:`Position`."""

    def __init__(self, config: ScheduleSection, position: Position | None = None, *, warn: bool = True) -> None:
        self.kind = config.schedule
        self.iterations = config.iterations
        self.local_steps = config.local_steps
        self.lr = config.lr
        self.stage_length = config.stage_length
        self.lr_decay = config.lr_decay
        self.growth = config.stage_growth
        self.rounds_per_stage = config.rounds_per_stage
        self.position = dataclasses.replace(position) if position is not None else Position()
        if (warn and self.kind == "stagewise" and self.stage_length % self.local_steps
                and self.stage_length < self.iterations):
            log.warning(
                "stage_length=%d is not a multiple of local_steps=%d: stage s switches at the first round end "
                "at or after s x stage_length iterations",
                self.stage_length, self.local_steps,
            )

    def _stage_over(self, p: Position) -> bool:
        if p.stage_rounds == 0:
            return False
        if self.kind == "stagewise":
            return p.done >= p.stage * self.stage_length
        return p.stage_rounds >= self.rounds_per_stage

    def plans(self) -> Iterator[tuple[RoundPlan, bool]]:
        """Yield ``(plan, starts_stage)`` for every remaining round; ``self.position`` is the position after
        the round just yielded (what a checkpoint written after that round must hold)."""
        p = self.position
        while p.done < self.iterations:
            starts_stage = self._stage_over(p)
            if starts_stage:
                p.stage, p.stage_rounds = p.stage + 1, 0
            if self.kind == "stagewise":
                steps, lr = self.local_steps, stagewise_lr(self.lr, self.lr_decay, p.stage)
            else:
                steps, lr = geometric_stage(self.local_steps, self.lr, self.growth, p.stage)
            steps = min(steps, self.iterations - p.done)
            plan = RoundPlan(round=p.round + 1, stage=p.stage, steps=steps, lr=lr, iteration=p.done)
            p.done, p.round, p.stage_rounds = p.done + steps, p.round + 1, p.stage_rounds + 1
            yield plan, starts_stage


def planned_rounds(config: ScheduleSection) -> int:
    """How many rounds a run of ``config`` has, as :meth:`Schedule.plans` plans them (the one count: the privacy
    accountant's planned rounds, the last round a participation record may name)."""
    return sum(1 for _ in Schedule(config, warn=False).plans())
