"""Gaussian class mixtures over clients with a heterogeneity knob.

Every client draws negatives around -c u and positives around +c u (u a random
unit vector, c = 1.25, unit covariance), each class centre moved by a client's
own offset of length about ``heterogeneity`` x the class separation. With
heterogeneity 0 the clients share one distribution; at 1 a client's offsets
are as large as the gap between the classes, so its best local scorer points
elsewhere than the global one. Each client keeps a balanced test split from its
own distribution; together they form the (pooled) test set.
"""

from __future__ import annotations

import numpy as np
import torch

from fdam_ray.data.base import DataSource, Shard, Split
from fdam_ray.data.sections import SyntheticSection

HALF_GAP = 1.25


class SyntheticSource(DataSource):
    def __init__(self, section: SyntheticSection) -> None:
        self.num_clients = section.num_clients
        self.num_features = section.num_features
        self.samples = section.samples_per_client
        self.imratio = section.imratio
        self.heterogeneity = section.heterogeneity
        self.seed = section.seed
        self.input_shape = (section.num_features,)

    def _draw(self, rng: np.random.Generator, centre: np.ndarray, n: int) -> np.ndarray:
        return (centre + rng.standard_normal((n, self.num_features))).astype(np.float32)

    def client_shard(self, client_id: int) -> Shard:
        d = self.num_features
        u = np.random.default_rng([self.seed, 1]).standard_normal(d)
        u /= np.linalg.norm(u)
        rng = np.random.default_rng([self.seed, 2, client_id])
        scale = self.heterogeneity * 2 * HALF_GAP / np.sqrt(d)
        centre_pos = HALF_GAP * u + scale * rng.standard_normal(d)
        centre_neg = -HALF_GAP * u + scale * rng.standard_normal(d)

        def split(n_pos: int, n_neg: int) -> Split:
            x = np.concatenate([self._draw(rng, centre_pos, n_pos), self._draw(rng, centre_neg, n_neg)])
            y = np.concatenate([np.ones(n_pos), np.zeros(n_neg)]).astype(np.float32)
            order = rng.permutation(len(y))
            return Split(torch.from_numpy(x[order]), torch.from_numpy(y[order]))

        n_pos = max(1, round(self.imratio * self.samples))
        train = split(n_pos, self.samples - n_pos)
        n_test = max(100, self.samples // 2)
        return Shard(train=train, test=split(n_test // 2, n_test - n_test // 2))

    def test_set(self) -> None:
        return None
