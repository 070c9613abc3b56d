"""Stage schedules (ALGORITHMS.md s.5): which rounds run, with how many local steps and which lr.

``stagewise`` (the paper's experiments): rounds of I local steps; a stage ends at
the first round end at or after T0 iterations into the stage, then lr is
divided by ``lr_decay``. When T0 is not a multiple of I the switch therefore
falls up to I - 1 iterations late (warned once).

``geometric`` (the theory): stage s runs R rounds of I_s = I_0 rho^(s-1) local
steps with lr_s = lr_0 / rho^(s-1), so lr_s I_s stays constant.

Both stop after ``iterations`` local steps; the last round is shortened if needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from fdam_ray.state import RoundPlan

log = logging.getLogger(__name__)


class Schedule:
    """Generates the :class:`RoundPlan` of every round; ``ends_stage`` tells the driver when to switch."""

    def __init__(self, config) -> None:
        self.kind = config.schedule
        self.iterations = config.iterations
        self.local_steps = config.local_steps
        self.lr = config.lr
        self.stage_length = config.stage_length
        self.lr_decay = config.lr_decay
        self.growth = config.stage_growth
        self.rounds_per_stage = config.rounds_per_stage
        if self.kind == "stagewise" and self.stage_length % self.local_steps and self.stage_length < self.iterations:
            log.warning(
                "stage_length=%d is not a multiple of local_steps=%d: each stage switch happens at the first "
                "round end at or after stage_length iterations into the stage",
                self.stage_length, self.local_steps,
            )

    def plans(self) -> Iterator[tuple[RoundPlan, bool]]:
        """Yield (plan, ends_stage) for every round of the run."""
        done, rnd, stage, stage_start, stage_rounds = 0, 0, 1, 0, 0
        while done < self.iterations:
            if self.kind == "stagewise":
                steps, lr = self.local_steps, self.lr / self.lr_decay ** (stage - 1)
            else:
                factor = self.growth ** (stage - 1)
                steps, lr = max(1, round(self.local_steps * factor)), self.lr / factor
            steps = min(steps, self.iterations - done)
            rnd += 1
            stage_rounds += 1
            after = done + steps
            if self.kind == "stagewise":
                ends = after - stage_start >= self.stage_length
            else:
                ends = stage_rounds >= self.rounds_per_stage
            ends = ends and after < self.iterations
            yield RoundPlan(round=rnd, stage=stage, steps=steps, lr=lr, iteration=done), ends
            done = after
            if ends:
                stage, stage_start, stage_rounds = stage + 1, done, 0
