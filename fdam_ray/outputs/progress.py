"""The console progress bar, drawn also where the terminal reports no size."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from fdam_ray.outputs.observer import Observer, RunStart, Snapshot
from fdam_ray.state import RoundPlan


def terminal_size(fp: Any) -> tuple[int, int]:
    """Columns and lines of the terminal ``fp`` writes to; where it reports none or zero (``script``, some CI
    runners and containers), ``COLUMNS`` and ``LINES``, else 80 x 24."""
    try:
        size = os.get_terminal_size(fp.fileno())
    except (AttributeError, ValueError, OSError):
        size = os.terminal_size((0, 0))
    fallback = shutil.get_terminal_size((80, 24))  # COLUMNS / LINES, else stdout's size, else 80 x 24
    columns = size.columns if size.columns > 0 else fallback.columns if fallback.columns > 0 else 80
    lines = size.lines if size.lines > 0 else fallback.lines if fallback.lines > 0 else 24
    return columns, lines


class Progress(Observer):
    """A progress bar over iterations (tqdm) with round, stage, lr, last test AUC (and validation AUC) and rate.

    Args:
        file: where the bar is drawn (default: stderr).
    """

    def __init__(self, file: Any = None) -> None:
        self.bar: Any = None
        self.auc = float("nan")
        self.val_auc: float | None = None  # with a validation split
        self.file = file

    def start(self, run: RunStart) -> None:
        from tqdm.auto import tqdm

        if run.history:  # a resumed run: its last evaluation until the next one
            self.auc, self.val_auc = run.history[-1]["test_auc"], run.history[-1].get("val_auc")
        # tqdm's own size query gives 0 x 0 where the terminal reports no size, and then it draws nothing
        file = self.file if self.file is not None else sys.stderr
        columns, lines = terminal_size(file)
        self.bar = tqdm(total=run.iterations, initial=run.iteration, unit="it", leave=True, file=file,
                        ncols=columns, nrows=lines)
        self.bar.dynamic_ncols = terminal_size  # follows a resized terminal

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.auc, self.val_auc = record["test_auc"], record.get("val_auc")  # the initial evaluation too

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot) -> None:
        if self.bar is None:
            return
        if record is not None:
            self.auc, self.val_auc = record["test_auc"], record.get("val_auc")
        shown = {} if self.val_auc is None else {"val": f"{self.val_auc:.4f}"}
        self.bar.set_postfix(round=plan.round, stage=plan.stage, lr=f"{plan.lr:.3g}", auc=f"{self.auc:.4f}",
                             **shown, refresh=False)
        self.bar.update(plan.steps)

    def close(self, error: BaseException | None) -> None:
        if self.bar is not None:
            self.bar.close()
