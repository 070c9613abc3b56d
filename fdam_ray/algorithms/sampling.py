"""Which clients take part in a round, and how much each one weighs (docs/algorithms.md s.3b).

Client sampling: round r draws S of the K clients uniformly without
replacement from a generator seeded by (seed, r), so a resumed run draws the
same sets. With S = K (the default) every client takes part and nothing is
drawn. Client weights: ``uniform`` (the paper: f = (1/K) sum_k f_k) or
``samples`` (w_k = n_k, so f is the objective of the pooled data).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sample_clients(seed: int, round_: int, num_clients: int, clients_per_round: int | None) -> list[int] | None:
    """S_r in increasing order, or None when every client takes part."""
    if clients_per_round is None or clients_per_round >= num_clients:
        return None
    rng = np.random.default_rng([seed, round_])
    return sorted(int(k) for k in rng.choice(num_clients, size=clients_per_round, replace=False))


def client_weights(weighting: str, num_train: Sequence[int]) -> np.ndarray | None:
    """w_k by client id: None for ``uniform`` (plain means), the training-set sizes n_k for ``samples``."""
    if weighting == "uniform":
        return None
    if weighting == "samples":
        return np.asarray(num_train, dtype=np.float64)
    raise ValueError(f"client_weighting {weighting!r} is not known (uniform, samples)")
