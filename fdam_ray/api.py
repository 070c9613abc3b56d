"""The Python entry points: :func:`train` (a dataset by name) and :func:`train_arrays` (your own arrays)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fdam_ray.config import Config, build_config
from fdam_ray.data.arrays import ArrayPair, ArraysSource
from fdam_ray.federation import RunResult
from fdam_ray.recipe import run


def _config(config: Config | Mapping[str, Any] | None, **overrides: Any) -> Config:
    if isinstance(config, Config):
        return config.replace(**overrides) if overrides else config
    return build_config(dict(config or {}), **overrides)


def train(
    config: Config | Mapping[str, Any] | None = None,
    *,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train a federation on the dataset the config names; see :func:`fdam_ray.recipe.run`."""
    return run(_config(config), save=save, on_eval=on_eval)


def train_arrays(
    config: Config | Mapping[str, Any] | None,
    clients: Sequence[ArrayPair],
    test: ArrayPair | None,
    *,
    client_tests: Sequence[ArrayPair] | None = None,
    save: bool = False,
    on_eval: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train on in-memory data: one ``(X_k, y_k)`` pair per client and a test set ``(X, y)``.

    ``y`` holds 0 (negative), 1 (positive) or NaN (missing), of shape (n,) or
    (n, T) for T tasks. ``num_clients`` is taken from ``len(clients)``. Set
    ``batch_size`` to 0 (or "full") for full-batch, sampling-free, deterministic
    gradients. ``client_tests`` adds each client's own test split and a
    per-client AUC to the history.

    Returns:
        :class:`RunResult` with the final ``model_state`` (a ``state_dict``), ``a``,
        ``b``, ``alpha``, the global ``control_variates`` (or None) and ``history``.
    """
    source = ArraysSource(clients, test, client_tests)
    cfg = _config(config, dataset="arrays", num_clients=len(clients))
    return run(cfg, source=source, save=save, on_eval=on_eval)
