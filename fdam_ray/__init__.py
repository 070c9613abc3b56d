"""fdam-ray: federated deep AUC maximization (CODA+, CODASCA and baselines) on Ray.

Yuan, Guo, Xu, Ying, Yang. "Federated Deep AUC Maximization for Heterogeneous
Data with a Constant Communication Complexity." ICML 2021.
"""

from fdam_ray.api import load_model, train, train_arrays, train_datasets
from fdam_ray.config import Config, ConfigError, build_config
from fdam_ray.federation import DivergenceError, RunResult
from fdam_ray.recipe import resume, run

__all__ = ["Config", "ConfigError", "DivergenceError", "RunResult", "build_config", "load_model", "resume", "run",
           "train", "train_arrays", "train_datasets"]
__version__ = "0.1.0"
