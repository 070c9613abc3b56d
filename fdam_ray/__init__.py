"""fdam-ray: federated deep AUC maximization (CODA+, CODASCA and baselines) on Ray.

Yuan, Guo, Xu, Ying, Yang. "Federated Deep AUC Maximization for Heterogeneous
Data with a Constant Communication Complexity." ICML 2021.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fdam_ray.api import load_model, train, train_arrays, train_datasets
    from fdam_ray.assembly.recipe import resume, run
    from fdam_ray.config import Config, ConfigError, build_config
    from fdam_ray.loop.federation import DivergenceError
    from fdam_ray.loop.summary import RunResult

# The public names, imported when first used: `fdam` reads and checks its command line and config file before
# torch is imported (seconds on a loaded machine).
_HOME = {"load_model": "api", "train": "api", "train_arrays": "api", "train_datasets": "api", "Config": "config",
         "ConfigError": "config", "build_config": "config", "DivergenceError": "loop.federation",
         "RunResult": "loop.federation",
         "resume": "assembly.recipe", "run": "assembly.recipe"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule, as the eager imports made them
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


__all__ = ["Config", "ConfigError", "DivergenceError", "RunResult", "build_config", "load_model", "resume", "run",
           "train", "train_arrays", "train_datasets"]
__version__ = "0.1.0"
