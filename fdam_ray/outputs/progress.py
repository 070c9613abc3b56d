"""What a run shows on the terminal: the progress bar (drawn also where the terminal reports no size) and the
evaluation lines, each fitted to the terminal's width without cutting a number.

A line wider than the terminal is wrapped between its fields (continuation lines indented), never inside a
number, and the bar's text is shortened as the terminal narrows (the rate, then the time estimates, and the
stage and lr as room requires, are left out), so that it too fits, down to 60 columns, without the terminal or
tqdm cutting a number in two. Output that is not a terminal (a file, a pipe) keeps one line per evaluation unless
``COLUMNS`` says how wide to be.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from fdam_ray.core.state import RoundPlan
from fdam_ray.outputs.observer import Observer, RunStart, Snapshot

INDENT = "  "  # the start of a wrapped line's continuation
WIDE_BAR = 100  # columns from which the bar shows tqdm's default text (rate, time, round, stage, lr, AUC)
TIMED_BAR = 72  # columns from which the bar shows elapsed and remaining time


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


def line_width(fp: Any) -> int | None:
    """The width lines written to ``fp`` are fitted to: its terminal's (:func:`terminal_size`), else a
    ``COLUMNS`` set in the environment, else None (a file or pipe: lines are not wrapped)."""
    try:
        is_terminal = fp.isatty()
    except (AttributeError, ValueError, OSError):
        is_terminal = False
    if is_terminal:
        return terminal_size(fp)[0]
    given = os.environ.get("COLUMNS", "")
    return int(given) if given.isdigit() and int(given) > 0 else None


def fit_fields(fields: Sequence[tuple[str, str]], width: int | None) -> list[str]:
    """``fields`` (separator before it, text) joined into lines no wider than ``width``, broken only between
    fields (a continuation line starts with :data:`INDENT`; a field wider than a line stands alone); one line
    when ``width`` is None."""
    lines: list[str] = []
    line = ""
    for separator, text in fields:
        if not line:
            line = text
        elif width is None or len((line + separator + text).rstrip()) <= width:
            line += separator + text
        else:
            lines.append(line.rstrip())
            line = INDENT + text
    lines.append(line if width is None else line.rstrip())
    return lines


def fit_text(text: str, width: int | None) -> list[str]:
    """``text`` in lines no wider than ``width``, broken after its ``, `` and ``; `` (else at spaces): never
    inside a number or a word."""
    if width is None or len(text) <= width:
        return [text]
    fields: list[tuple[str, str]] = []
    for clause in _split_after(text, ("; ", ", ")):
        words = [clause] if len(clause) <= width - len(INDENT) else clause.split(" ")
        fields.extend((" " if fields else "", word) for word in words)
    return fit_fields(fields, width)


def _split_after(text: str, separators: tuple[str, ...]) -> list[str]:
    """``text`` cut after each of ``separators`` (which stay with the part before, less their space)."""
    parts, start, i = [], 0, 0
    while i < len(text):
        if any(text.startswith(s, i) for s in separators):
            parts.append(text[start:i + 1])
            start = i = i + 2
            continue
        i += 1
    parts.append(text[start:])
    return [p for p in parts if p]


def evaluation_fields(rec: dict) -> list[tuple[str, str]]:
    """An evaluation record's fields as :func:`fit_fields` takes them; on one line they read
    ``iter       4  round     1  stage  1  lr 0.1      loss    0.0405  test AUC 0.5119  [4.2 s]``."""
    loss = rec.get("train_loss")
    loss_s = f"{loss:9.4f}" if loss is not None else "        -"
    return [("", f"iter {rec['iteration']:>7}"), ("  ", f"round {rec['round']:>5}"), ("  ", f"stage {rec['stage']:>2}"),
            ("  ", f"lr {rec['lr']:<8.4g}"), (" ", f"loss {loss_s}"),
            ("  ", f"test AUC {rec['test_auc']:.4f}{_interval(rec)}"),
            *([] if "val_auc" not in rec else [("  ", f"val AUC {rec['val_auc']:.4f}")]),
            ("  ", f"[{rec['wall_s']:.1f} s]")]


def _interval(rec: dict) -> str:
    """`` [low, high]``, the test AUC's 95 % interval on the logit scale (inside [0, 1]) where the record has one
    (``clinical: on``), else ''."""
    low, high = rec.get("test_auc_ci_logit_low"), rec.get("test_auc_ci_logit_high")
    return "" if low is None or high is None else f" [{low:.4f}, {high:.4f}]"


def evaluation_lines(rec: dict, width: int | None) -> list[str]:
    """The lines showing one evaluation record, fitted to ``width`` (None: one line)."""
    return fit_fields(evaluation_fields(rec), width)


def write_evaluation(rec: dict, file: Any = None) -> None:
    """Show one evaluation record on ``file`` (default: stdout), fitted to its width, above a progress bar if one
    is drawn (which stays intact)."""
    from tqdm.auto import tqdm

    fp = file if file is not None else sys.stdout
    for line in evaluation_lines(rec, line_width(fp)):
        tqdm.write(line, file=fp)


class Progress(Observer):
    """A progress bar over iterations (tqdm) with round, stage, lr, last test AUC (and validation AUC) and rate;
    on a narrower terminal, fewer of them (see the module docstring).

    Args:
        file: where the bar is drawn (default: stderr).
    """

    def __init__(self, file: Any = None) -> None:
        self.bar: Any = None
        self.auc = float("nan")
        self.val_auc: float | None = None  # with a validation split
        self.file = file
        self.columns = 80

    def start(self, run: RunStart) -> None:
        from tqdm.auto import tqdm

        if run.history:  # a resumed run: its last evaluation until the next one
            self.auc, self.val_auc = run.history[-1]["test_auc"], run.history[-1].get("val_auc")
        # tqdm's own size query gives 0 x 0 where the terminal reports no size, and then it draws nothing
        file = self.file if self.file is not None else sys.stderr
        self.columns, lines = terminal_size(file)
        self.bar = tqdm(total=run.iterations, initial=run.iteration, unit="it", leave=True, file=file,
                        ncols=self.columns, nrows=lines, bar_format=bar_format(self.columns))
        self.bar.dynamic_ncols = terminal_size  # follows a resized terminal

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.auc, self.val_auc = record["test_auc"], record.get("val_auc")  # the initial evaluation too

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot | None) -> None:
        if self.bar is None:
            return
        if record is not None:
            self.auc, self.val_auc = record["test_auc"], record.get("val_auc")
        shown = {} if self.val_auc is None else {"val": f"{self.val_auc:.4f}"}
        if self.columns >= WIDE_BAR:
            self.bar.set_postfix(round=plan.round, stage=plan.stage, lr=f"{plan.lr:.3g}", auc=f"{self.auc:.4f}",
                                 **shown, refresh=False)
        else:
            items = {"round": str(plan.round), "stage": str(plan.stage), "lr": f"{plan.lr:.3g}",
                     "auc": f"{self.auc:.4f}", **shown}
            self.bar.set_postfix_str(fitted_postfix(items, self.columns, self.bar.total), refresh=False)
        self.bar.update(plan.steps)

    def close(self, error: BaseException | None) -> None:
        if self.bar is not None:
            self.bar.close()


SHOWN_FIRST = ("round", "auc", "val", "stage", "lr")  # what a narrow bar keeps, in this order
BAR_MIN = 10  # columns the bar itself keeps


def fitted_postfix(items: dict[str, str], columns: int, total: int) -> str:
    """The bar's ``key=value`` text for a terminal ``columns`` wide (below :data:`WIDE_BAR`): as many of
    ``items`` as fit beside the percentage, a bar of :data:`BAR_MIN` columns, the count and (from
    :data:`TIMED_BAR` columns) the time estimates, taken in :data:`SHOWN_FIRST` order and shown in the order
    given; round and AUC always."""
    room = columns - len("100%|") - BAR_MIN - len(f"| {total}/{total}") - 2  # ", " before the text
    if columns >= TIMED_BAR:
        room -= len(" [00:00:00<00:00:00]")
    chosen: set[str] = set()
    for key in SHOWN_FIRST:
        if key not in items:
            continue
        text = ", ".join(f"{k}={v}" for k, v in items.items() if k in chosen | {key})
        if key in ("round", "auc") or len(text) <= room:
            chosen.add(key)
    return ", ".join(f"{k}={v}" for k, v in items.items() if k in chosen)


def bar_format(columns: int) -> str | None:
    """tqdm's bar format for a terminal ``columns`` wide: its default from :data:`WIDE_BAR` columns on, else
    percentage, bar, count and the postfix (round and AUC), with the time estimates from :data:`TIMED_BAR`."""
    if columns >= WIDE_BAR:
        return None
    timed = " [{elapsed}<{remaining}{postfix}]" if columns >= TIMED_BAR else "{postfix}"
    return "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}" + timed
