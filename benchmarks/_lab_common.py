"""What the fault lab records of one fault, and the audit of a run folder after it (nothing lost?).

A fault's row (:class:`Fault`) says what was done, at which seeded point, the
outcome (finished equal to the uninterrupted study bit for bit; finished equal to
its replay from the participation record; stopped with one line and resumed), the
time lost against the uninterrupted study, and what was lost. :func:`audit`
finds what a fault may lose in a run folder: a round counted twice, a metric row
missing or duplicated, a checkpoint older than the last completed round. The
lab's studies evaluate after every round, so the metric rows are the rounds the
run completed.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BIT_FOR_BIT = "finished: equal to the uninterrupted study bit for bit"
REPLAYED = "finished: equal to its replay from the participation record"
RESUMED = "stopped with one line, resumed: equal to the uninterrupted study bit for bit"
# the figures of a metric row that must repeat exactly when the training did (the rest are times and rates)
TIMING_KEYS = {"wall_s", "samples_per_s"}


@dataclass
class Fault:
    """One fault injected into a running study and what it did.

    Attributes:
        name: short id (``supernode_kill``, ``raylet_kill``, ...).
        what: the fault in words (``site 1's SuperNode SIGKILLed, restarted 5 s later``).
        at: the seeded point it was injected at (``round 4 + 1.2 s``).
        outcome: one of :data:`BIT_FOR_BIT`, :data:`REPLAYED`, :data:`RESUMED` (with any detail after it), or what
            happened instead.
        survived: the outcome is one of the three and nothing was lost.
        time_lost_s: the faulted study's wall time (its resume included) minus the uninterrupted study's.
        lost: what :func:`audit` found lost (empty: nothing).
        message: the one line a stopped run printed (empty when it did not stop).
        max_diff: largest |difference| of the final state from what it must equal (0.0: bit for bit).
    """

    name: str
    what: str
    at: str
    outcome: str
    survived: bool
    time_lost_s: float
    lost: list[str] = field(default_factory=list)
    message: str = ""
    max_diff: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def seeded_point(seed: int, name: str, first: int, last: int) -> tuple[int, float]:
    """A round in first..last and an offset in [0, 1) of a round, drawn from ``seed`` and the fault's name (the
    same point on every run of the lab with that seed)."""
    rng = random.Random(f"{seed}:{name}")
    return rng.randint(first, last), rng.random()


def max_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """Largest |a - b| over the arrays both name (float64); inf when a name is in one only or shapes differ."""
    if set(a) != set(b):
        return math.inf
    worst = 0.0
    for name in a:
        x, y = np.asarray(a[name], dtype=np.float64), np.asarray(b[name], dtype=np.float64)
        if x.shape != y.shape:
            return math.inf
        if x.size:
            worst = max(worst, float(np.abs(x - y).max()))
    return worst


def metric_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def audit(run_dir: str | Path, reference: Sequence[Mapping[str, Any]] | None = None, *,
          checkpoint_round: int | None = None, same_training: bool = True) -> list[str]:
    """What a fault lost in ``run_dir``: [] when nothing.

    - every metric row's round once, in order (a round counted twice shows as a row repeated or out of order);
    - the rounds of ``reference`` (the uninterrupted study's rows) all present, none extra; with
      ``same_training``, every figure but the times equal to the reference's (a row written from another
      state is lost data too);
    - ``checkpoint_round`` (the round the run folder's checkpoint holds, when the caller read it): not older
      than the last completed round (the last metric row's).
    """
    rows = metric_rows(run_dir)
    lost: list[str] = []
    rounds = [int(r["round"]) for r in rows]
    seen: set[int] = set()
    for r in rounds:
        if r in seen:
            lost.append(f"round {r}'s metric row written twice")
        seen.add(r)
    if rounds != sorted(rounds):
        lost.append(f"metric rows out of order: rounds {rounds}")
    if reference is not None:
        want = {int(r["round"]): r for r in reference}
        missing = sorted(set(want) - seen)
        extra = sorted(seen - set(want))
        if missing:
            lost.append(f"metric rows of rounds {missing} missing")
        if extra:
            lost.append(f"metric rows of rounds {extra} not in the uninterrupted study")
        if same_training:
            for row in rows:
                ref = want.get(int(row["round"]))
                if ref is None:
                    continue
                differ = sorted(k for k in set(ref) | set(row) if k not in TIMING_KEYS and k in ref and k in row
                                and ref[k] != row[k] and not _both_nan(ref[k], row[k]))
                if differ:
                    lost.append(f"round {row['round']}'s metric row differs from the uninterrupted study's in "
                                f"{', '.join(differ[:4])}")
    if checkpoint_round is not None and rounds and checkpoint_round < max(rounds):
        lost.append(f"the checkpoint holds round {checkpoint_round}, older than the last completed round "
                    f"{max(rounds)}")
    return lost


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
