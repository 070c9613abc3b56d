"""scikit-learn's bundled 8x8 digits (1797 images, offline): digits 5-9 positive by default."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fdam_ray.data.pooled import ClassPoolSource

SPLIT_SEED = 20210101  # the held-out split is the same for every run seed, so runs compare on one test set


class DigitsSource(ClassPoolSource):
    input_shape = (1, 8, 8)
    default_positive_classes = (5, 6, 7, 8, 9)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.test_fraction = config.test_fraction

    def load_pool(self):
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=self.test_fraction, stratify=y, random_state=SPLIT_SEED
        )
        return x_tr, y_tr, x_te, y_te
