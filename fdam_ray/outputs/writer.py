"""The files of a run folder, written as the run goes (see :mod:`fdam_ray.outputs` for the list)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import logging
import os
from pathlib import Path

import torch
import yaml

from fdam_ray.checkpoint import Checkpoint, DiskFullError, disk_full, save_checkpoint, write_atomically
from fdam_ray.outputs.records import NOTES_KEY, finite_or_null, flatten_record, grouped_scalars, strict_summary
from fdam_ray.settings.redact import RedactingFilter

log = logging.getLogger("fdam_ray.outputs")
PRIVATE_MODE = 0o600  # files that hold the config or messages about it: the owner's only (as checkpoint.pt is)


def private_file(path: Path, text: str | None = None) -> Path:
    """Make ``path`` readable by its owner only (created if missing) and, given ``text``, write it: the config and
    the log may name addresses, storage paths and factories that others on the machine need not see."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if text is not None else os.O_APPEND)
    fd = os.open(path, flags, PRIVATE_MODE)
    with os.fdopen(fd, "a" if text is None else "w", encoding="utf-8") as fh:
        os.fchmod(fd, PRIVATE_MODE)  # a file of an earlier session (resume) keeps its mode otherwise
        if text is not None:
            fh.write(text)
    return path


def tensorboard_installed() -> bool:
    """Whether the tensorboard package is there (``tensorboard: auto`` writes event files only then)."""
    return importlib.util.find_spec("tensorboard") is not None


def _tensorboard_writer(path: Path, wanted: bool | str):
    """TensorBoard's writer for ``tensorboard`` = ``wanted``: true (the config refused it without the package),
    false, or auto (on where the package is installed, silent where it is not)."""
    if wanted is False or (wanted == "auto" and not tensorboard_installed()):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # installed but broken
        if wanted == "auto":
            log.debug("tensorboard=auto: TensorBoard cannot be imported (%s); no event files", exc)
            return None
        raise ValueError(f"config field 'tensorboard': true, but TensorBoard cannot be imported ({exc}); reinstall "
                         "it (pip install --force-reinstall tensorboard) or set tensorboard=auto or false") from None
    return SummaryWriter(log_dir=str(path))


class _LogFile(logging.FileHandler):
    """``train.log``: a line that cannot be written (a full disk) is lost quietly; the run's own error says why
    (logging would print a traceback for every line)."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _append_whole(parts: list[tuple[io.RawIOBase, bytes]]) -> None:
    """Append each ``(file, bytes)`` whole, or, when a write fails (a disk full mid-row), none of them: every file
    is cut back to where it ended, so the metric files never hold half a row, nor a row one has and the other not."""
    starts = [fh.tell() for fh, _ in parts]
    try:
        for fh, data in parts:
            view = memoryview(data)
            while view:
                view = view[fh.write(view):]
    except BaseException:
        for (fh, _), start in zip(parts, starts, strict=True):
            with contextlib.suppress(OSError):
                fh.truncate(start)
                fh.seek(start)
        raise


class RunWriter:
    """Writes a run's files as the run goes; on resume, rewrites the metric files from the checkpoint's history."""

    def __init__(self, run_dir: Path, *, tensorboard: bool | str, history: list[dict] | None = None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # unbuffered: a row goes to the file whole or not at all (_append_whole)
        self._jsonl = open(self.dir / "metrics.jsonl", "wb", buffering=0)
        self._csv_file = open(self.dir / "metrics.csv", "wb", buffering=0)
        self._csv_fields: list[str] | None = None
        self.log = logging.getLogger(f"fdam_ray.run.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        log_file = private_file(self.dir / "train.log")
        self._handler = _LogFile(log_file, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self._handler.addFilter(RedactingFilter())  # credentials in a URI an event or a warning names
        self.log.addHandler(self._handler)
        # the package's warnings while the run writes here (a client replaced or dropped, a late stage switch)
        self._warnings = _LogFile(log_file, encoding="utf-8")
        self._warnings.setLevel(logging.WARNING)
        self._warnings.addFilter(RedactingFilter())
        self._warnings.setFormatter(self._handler.formatter)
        logging.getLogger("fdam_ray").addHandler(self._warnings)
        self._tb = _tensorboard_writer(self.dir / "events", tensorboard)
        for rec in history or []:
            self._write_metrics(rec)

    def write_config(self, config_dict: dict) -> None:
        self.write_yaml("config.yaml", config_dict, "the run's config")

    def write_yaml(self, name: str, values: dict, what: str) -> None:
        """Write ``values`` as YAML to ``name`` in the folder, atomically (a reader never sees half a file) and
        readable by the owner only (a config may name addresses, storage paths and factories)."""
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        text = yaml.safe_dump(plain, sort_keys=False).encode("utf-8")
        write_atomically(self.dir / name, lambda fh: fh.write(text), what, private=True)

    def _write_metrics(self, rec: dict) -> None:
        try:
            self._append_metrics(rec)
        except OSError as exc:
            if disk_full(exc) is None:
                raise
            error = DiskFullError(f"no space left on {self.dir} (writing the metrics files); the last checkpoint "
                                  "is kept: free space there, then continue the run with --resume")
            error.errno = exc.errno
            raise error from None

    def _append_metrics(self, rec: dict) -> None:
        line = json.dumps(finite_or_null(rec), allow_nan=False) + "\n"  # strict: NaN as null
        flat = flatten_record(rec)
        fields = self._csv_fields or list(flat)
        text = io.StringIO(newline="")
        table = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
        if self._csv_fields is None:
            table.writeheader()
        table.writerow(flat)
        _append_whole([(self._jsonl, line.encode("utf-8")), (self._csv_file, text.getvalue().encode("utf-8"))])
        self._csv_fields = fields

    def record(self, rec: dict) -> None:
        """Write one evaluation record to every output."""
        self._write_metrics(rec)
        self.log.info(
            "iteration %d round %d stage %d lr %.4g loss %s test_auc %.6f%s bytes %d wall_s %.1f",
            rec["iteration"], rec["round"], rec["stage"], rec["lr"],
            "-" if rec.get("train_loss") is None else f"{rec['train_loss']:.6f}", rec["test_auc"],
            "" if "val_auc" not in rec else f" val_auc {rec['val_auc']:.6f}",
            rec["bytes_up"] + rec["bytes_down"], rec["wall_s"],
        )
        if self._tb is not None:
            step = rec["iteration"]
            for tag, value in grouped_scalars(rec).items():  # auc/..., comm/..., train/...
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()

    def event(self, message: str, *args, level: int = logging.INFO) -> None:
        self.log.log(level, message, *args)

    def checkpoint(self, checkpoint: Checkpoint) -> None:
        save_checkpoint(self.dir / "checkpoint.pt", checkpoint)

    def best_model(self, model_payload: dict, record: dict) -> None:
        """``best_model.pt``: the model at the best validation AUC (``model.pt``'s format)."""
        write_atomically(self.dir / "best_model.pt", lambda fh: torch.save(model_payload, fh), "the best model")
        self.log.info("best_model.pt: the model of iteration %d (val AUC %.6f)", record["iteration"],
                      record["val_auc"])

    def finish(self, model_payload: dict, summary: dict) -> None:
        write_atomically(self.dir / "model.pt", lambda fh: torch.save(model_payload, fh), "the final model")
        strict = strict_summary(summary)  # strict JSON: a NaN (an AUC of one class) is null, and notes say why
        for key, why in strict.get(NOTES_KEY, {}).items():
            self.log.info("summary.json: %s: %s", key, why)
        if NOTES_KEY in strict:
            summary[NOTES_KEY] = strict[NOTES_KEY]  # what the run returns says it too
        text = (json.dumps(strict, indent=2, allow_nan=False) + "\n").encode("utf-8")
        write_atomically(self.dir / "summary.json", lambda fh: fh.write(text), "the summary")

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        self.log.removeHandler(self._handler)
        self._handler.close()
        logging.getLogger("fdam_ray").removeHandler(self._warnings)
        self._warnings.close()
        if self._tb is not None:
            self._tb.close()
