"""A run folder and what goes into it.

    config.yaml      the resolved config (reloads to the same run)
    metrics.jsonl    one JSON record per evaluation
    metrics.csv      the same, flattened (task_auc.<task>, client_auc.<id> columns)
    train.log        one line per evaluation, plus warnings and events (client failures, stage switches)
    events/          TensorBoard event files (when the tensorboard package is installed)
    checkpoint.pt    the latest checkpoint (atomic; see fdam_ray.checkpoint)
    model.pt         the final model: {"model": state_dict, "a", "b", "alpha", "task_names"}
    summary.json     best and final test AUC, rounds, bytes moved, wall time, samples/s
"""

from __future__ import annotations

import csv
import json
import logging
from datetime import datetime
from pathlib import Path

import torch
import yaml

from fdam_ray.checkpoint import save_checkpoint
from fdam_ray.state import RoundPlan

log = logging.getLogger(__name__)
_notice_given = False


def flatten_record(rec: dict) -> dict:
    out = {}
    for key, value in rec.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def _tensorboard_writer(path: Path):
    global _notice_given
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _notice_given:
            log.warning("TensorBoard files are not written: the 'tensorboard' package is not installed "
                        "(pip install tensorboard)")
            _notice_given = True
        return None
    return SummaryWriter(log_dir=str(path))


class RunWriter:
    """Writes a run's files as the run goes; on resume, rewrites the metric files from the checkpoint's history."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, history: list[dict] | None = None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "w", encoding="utf-8")
        self._csv_file = open(self.dir / "metrics.csv", "w", encoding="utf-8", newline="")
        self._csv: csv.DictWriter | None = None
        self.log = logging.getLogger(f"fdam_ray.run.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        self._handler = logging.FileHandler(self.dir / "train.log", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(self._handler)
        self._tb = _tensorboard_writer(self.dir / "events") if tensorboard else None
        for rec in history or []:
            self._write_metrics(rec)

    def write_config(self, config_dict: dict) -> None:
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in config_dict.items()}
        (self.dir / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False), encoding="utf-8")

    def _write_metrics(self, rec: dict) -> None:
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        flat = flatten_record(rec)
        if self._csv is None:
            self._csv = csv.DictWriter(self._csv_file, fieldnames=list(flat), extrasaction="ignore")
            self._csv.writeheader()
        self._csv.writerow(flat)
        self._csv_file.flush()

    def record(self, rec: dict) -> None:
        """Write one evaluation record to every output."""
        self._write_metrics(rec)
        self.log.info(
            "iteration %d round %d stage %d lr %.4g loss %s test_auc %.6f bytes %d wall_s %.1f",
            rec["iteration"], rec["round"], rec["stage"], rec["lr"],
            "-" if rec.get("train_loss") is None else f"{rec['train_loss']:.6f}", rec["test_auc"],
            rec["bytes_up"] + rec["bytes_down"], rec["wall_s"],
        )
        if self._tb is not None:
            step = rec["iteration"]
            for key, value in flatten_record(rec).items():
                if key not in ("iteration",) and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key.replace(".", "/"), value, step)
            self._tb.flush()

    def event(self, message: str, *args, level: int = logging.INFO) -> None:
        self.log.log(level, message, *args)

    def checkpoint(self, payload: dict) -> None:
        save_checkpoint(self.dir / "checkpoint.pt", payload)

    def finish(self, model_payload: dict, summary: dict) -> None:
        torch.save(model_payload, self.dir / "model.pt")
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        self.log.removeHandler(self._handler)
        self._handler.close()
        if self._tb is not None:
            self._tb.close()


def make_run_dir(config) -> Path:
    """Create the run folder (refusing to reuse a non-empty one)."""
    root = Path(config.out_dir)
    if config.run_name:
        path = root / config.run_name
        if path.exists() and any(path.iterdir()):
            raise ValueError(f"run folder '{path}' already exists and is not empty; choose another run_name "
                             "or continue it with --resume")
    else:
        base = f"{datetime.now():%Y%m%d-%H%M%S}-{config.algorithm}-{config.dataset}"
        path, n = root / base, 1
        while path.exists():
            path, n = root / f"{base}-{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


class Progress:
    """A progress bar over iterations (tqdm) with round, stage, lr, last test AUC and rate."""

    def __init__(self, total: int, initial: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True, leave=True)
        self.auc = float("nan")

    def update(self, plan: RoundPlan, steps: int, auc: float | None = None) -> None:
        if auc is not None:
            self.auc = auc
        self.bar.set_postfix(round=plan.round, stage=plan.stage, lr=f"{plan.lr:.3g}", auc=f"{self.auc:.4f}",
                             refresh=False)
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()
