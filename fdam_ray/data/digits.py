"""scikit-learn's bundled 8x8 digits (1797 images, offline): digits 5-9 positive by default."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits

from fdam_ray.data.pooled import HeldOutPoolSource


class DigitsSource(HeldOutPoolSource):
    input_shape = (1, 8, 8)
    default_positive_classes = (5, 6, 7, 8, 9)

    def load_samples(self):
        x, y = load_digits(return_X_y=True)
        return (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), y
