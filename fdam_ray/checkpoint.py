"""Checkpoint files: written atomically, read without unpickling arbitrary objects.

A checkpoint is a nested structure of dicts, lists, strings, numbers, numpy
arrays and torch tensors. Numpy arrays are stored as tensors (tagged so they
come back as arrays), and the file is read with ``torch.load(weights_only=True)``,
which refuses anything but tensors and plain containers: opening a checkpoint
never runs code from it. Writing goes to a temporary file in the same folder,
is flushed to disk, then renamed over the old file, so a crash mid-write
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "fdam-ray-checkpoint/1"
_ARRAY = "__ndarray__"


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged or of another format."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {_ARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY}:
            return obj[_ARRAY].numpy()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": FORMAT, "payload": _encode(payload)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` (no arbitrary unpickling)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at '{path}'")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated zip, a pickle of foreign objects, ...
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read (damaged, truncated or not an fdam-ray checkpoint): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not an fdam-ray checkpoint ({FORMAT})")
    return _decode(data["payload"])
