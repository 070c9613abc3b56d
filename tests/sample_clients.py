"""Small data the tests share: heterogeneous Gaussian clients, and every array inside a nested result."""

from __future__ import annotations

import numpy as np
import torch


def gaussian_clients(num_clients=3, n=40, d=5, seed=0, shift=1.0, pos_frac=0.25):
    """Small heterogeneous Gaussian clients (X float32, y 0/1) plus a test set."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    out = []
    for k in range(num_clients):
        n_pos = max(1, int(pos_frac * n) + k)
        y = np.r_[np.ones(n_pos), np.zeros(n - n_pos)]
        X = rng.standard_normal((n, d)) + np.outer(2 * y - 1, u) * 0.8 + shift * rng.standard_normal(d)
        out.append((X.astype(np.float32), y.astype(np.float32)))
    yt = np.r_[np.ones(50), np.zeros(50)]
    Xt = (rng.standard_normal((100, d)) + np.outer(2 * yt - 1, u) * 0.8).astype(np.float32)
    return out, (Xt, yt.astype(np.float32))


def arrays_in(obj):
    """Every numpy array inside a nested result (dataclasses, dicts, lists, tensors): what crossed to the driver."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, torch.Tensor):
        yield obj.numpy()
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from arrays_in(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from arrays_in(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            yield from arrays_in(getattr(obj, f))
