"""Reading a file torch saved without letting it run code: ``torch.load(weights_only=True)`` and why it refused.

Used wherever fdam reads a ``.pt`` file (initial weights, checkpoints, a run's model), so it sits low.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch


def safe_load(path: str | Path) -> Any:
    """``torch.load(weights_only=True)`` on CPU, without torch's warnings about the pickle protocol of a file it
    then refuses or reads (the refusal says what matters, in one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(path, map_location="cpu", weights_only=True)


def torch_load_failure(exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line; torch's advice to load the file's
    foreign objects unchecked (which could run code from the file) is not repeated."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    if "Weights only load failed" in first:
        return "it holds objects other than tensors and plain values, refused (unpickling them could run code)"
    return f"{type(exc).__name__}: {first[:200]}"
