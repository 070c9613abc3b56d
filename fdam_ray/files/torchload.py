"""Reading a file torch saved without letting it run code: ``torch.load(weights_only=True)`` and why it refused.

Used wherever fdam reads a ``.pt`` file (initial weights, checkpoints, a run's model), so it sits low.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
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


_WEIGHT_DTYPES = (torch.float32, torch.float64)  # what a float32 network takes without losing a digit


def value_problems(own: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> list[str]:
    """What keeps the tensors of ``state`` from being copied into a network whose state_dict is ``own``, key for
    key, a phrase per entry: a floating-point entry must be float32 or float64 (an integer one truncates every
    weight, a float16 or complex one loses digits or parts) and finite (a NaN or infinite value poisons every
    score); an integer entry (BatchNorm's num_batches_tracked) must be an integer."""
    problems = []
    for key, mine in own.items():
        value = state.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if mine.is_floating_point():
            if value.dtype not in _WEIGHT_DTYPES:
                problems.append(f"'{key}' is {str(value.dtype).removeprefix('torch.')}, not float32 or float64")
            elif value.numel() and not bool(torch.isfinite(value).all()):
                nan = bool(torch.isnan(value).any())
                problems.append(f"'{key}' holds {'NaN' if nan else 'infinite'} values")
        elif value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            problems.append(f"'{key}' is {str(value.dtype).removeprefix('torch.')}, not an integer like the "
                            f"model's {str(mine.dtype).removeprefix('torch.')}")
    return problems
