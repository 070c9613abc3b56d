"""Partitions and the offline datasets."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from fdam_ray.config import build_config
from fdam_ray.data import DataSection, SyntheticSection
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.data.digits import DigitsSource
from fdam_ray.data.partition import dirichlet_partition, ih_partition
from fdam_ray.data.synthetic import SyntheticSource


@pytest.mark.parametrize("num_clients,imratio", [(4, 0.1), (5, 0.3), (2, 0.05), (1, 0.1)])
def test_ih_partition_is_class_disjoint_with_imratio_per_client(num_clients, imratio):
    src = DigitsSource(DataSection.of(build_config(num_clients=num_clients, imratio=imratio)))
    _, classes, _, _ = src.load_pool()
    parts = src.client_indices()
    assert len(parts) == num_clients
    seen = set()
    for ix in parts:
        cls = set(classes[ix].tolist())
        assert not cls & seen, "a class is on two clients"
        seen |= cls
        n_pos = np.isin(classes[ix], src.positive_classes).sum()
        # pos / (pos + neg) = imratio to within one sample
        assert abs(n_pos - imratio * len(ix)) < 1.0
        assert n_pos >= 1
    assert seen == set(range(10))  # every class is on some client


def test_ih_partition_keeps_positives_stratified_by_class():
    classes = np.repeat(np.arange(4), [100, 100, 60, 40])  # 0, 1 negative; 2, 3 positive
    (ix,) = ih_partition(classes, (2, 3), num_clients=1, imratio=0.2, rng=np.random.default_rng(0))
    kept = np.bincount(classes[ix], minlength=4)
    assert kept[0] == kept[1] == 100
    assert kept[2] + kept[3] == 50 and (kept[2], kept[3]) == (30, 20)  # 60:40 kept in proportion


def test_ih_partition_drops_negatives_when_positives_run_short():
    classes = np.repeat(np.arange(2), [1000, 20])
    (ix,) = ih_partition(classes, (1,), num_clients=1, imratio=0.5, rng=np.random.default_rng(0))
    assert np.bincount(classes[ix]).tolist() == [20, 20]


def test_digits_test_set_is_untouched_and_balanced():
    src = DigitsSource(DataSection.of(build_config(num_clients=4, imratio=0.1, test_fraction=0.3)))
    x_tr, _, x_te, c_te = src.load_pool()
    assert len(c_te) == pytest.approx(0.3 * 1797, abs=1)
    assert np.bincount(c_te).min() >= 50  # every class present, stratified
    test = src.test_set()
    assert float(test.y.mean()) == pytest.approx(0.5, abs=0.02)  # balanced: no positives dropped
    # the test images are real digits images, disjoint from training ones
    all_x = load_digits().data / 16.0
    te = {r.tobytes() for r in x_te.reshape(len(x_te), -1).astype(np.float32)}
    tr = {r.tobytes() for r in x_tr.reshape(len(x_tr), -1).astype(np.float32)}
    assert len(te & tr) <= 5  # (digits has a handful of duplicate images)
    assert len(te) + len(tr) >= len({r.tobytes() for r in all_x.astype(np.float32)}) - 5


def test_dirichlet_partition_covers_pool_and_gives_each_client_both_labels():
    rng = np.random.default_rng(0)
    classes = rng.integers(0, 10, 3000)
    parts = dirichlet_partition(classes, (5, 6, 7, 8, 9), num_clients=6, imratio=0.2, concentration=0.5,
                                rng=np.random.default_rng(1))
    allix = np.concatenate(parts)
    assert len(allix) == len(np.unique(allix))  # disjoint
    is_pos = np.isin(classes[allix], (5, 6, 7, 8, 9))
    assert is_pos.mean() == pytest.approx(0.2, abs=0.001)
    for ix in parts:
        pos = np.isin(classes[ix], (5, 6, 7, 8, 9))
        assert pos.any() and (~pos).any()
    sizes = [len(ix) for ix in parts]
    assert max(sizes) > 1.3 * min(sizes)  # heterogeneous


def test_dirichlet_gives_a_clear_error_when_impossible():
    classes = np.array([0] * 10 + [1] * 2)
    with pytest.raises(ValueError, match="dirichlet"):
        dirichlet_partition(classes, (1,), num_clients=8, imratio=0.2, concentration=0.01,
                            rng=np.random.default_rng(0))


def test_synthetic_heterogeneity_moves_client_centres():
    def centres(h):
        src = SyntheticSource(SyntheticSection.of(build_config(dataset="synthetic", num_clients=3, heterogeneity=h,
                                                               samples_per_client=2000, imratio=0.5)))
        out = []
        for k in range(3):
            tr = src.client_shard(k).train
            y = tr.y.numpy().ravel()
            out.append(tr.x.numpy()[y == 1].mean(0))
        return np.array(out)

    spread0 = np.linalg.norm(centres(0.0) - centres(0.0).mean(0), axis=1).mean()
    spread2 = np.linalg.norm(centres(2.0) - centres(2.0).mean(0), axis=1).mean()
    assert spread0 < 0.2 < 1.0 < spread2
    shard = SyntheticSource(SyntheticSection.of(build_config(dataset="synthetic", imratio=0.1))).client_shard(0)
    assert float(shard.train.y.mean()) == pytest.approx(0.1, abs=0.002)
    assert float(shard.test.y.mean()) == pytest.approx(0.5, abs=0.01)


def test_source_specs_are_deterministic_and_travel_without_data():
    import pickle

    cfg = build_config(num_clients=3, partition="dirichlet", seed=5)
    a, b = DigitsSource(DataSection.of(cfg)), DigitsSource(DataSection.of(cfg))
    a.client_shard(0)  # loads and caches the pool on a
    assert len(pickle.dumps(a)) < 2000
    for k in range(3):
        np.testing.assert_array_equal(a.client_shard(k).train.x.numpy(), b.client_shard(k).train.x.numpy())


def test_arrays_source_rejects_bad_labels():
    X = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"clients\[0\]: label 2.0 at row 1"):
        ArraysSource([(X, np.array([0, 2, 1]))], (X, np.array([0, 1, 1])))
    with pytest.raises(ValueError, match="different sample shapes"):
        ArraysSource([(X, np.array([0, 1, 1])), (np.zeros((3, 4)), np.array([0, 1, 1]))], (X, np.array([0, 1, 1])))
