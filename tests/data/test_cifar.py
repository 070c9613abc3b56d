"""CIFAR-10/100 loaders on generated files in the official pickle format, read through torchvision."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from image_fixtures import accept_checksums, write_cifar

import fdam_ray
from fdam_ray.config import build_config
from fdam_ray.data import DataSection, LoaderSampler, make_source
from fdam_ray.data.cifar import Cifar100Source


@pytest.fixture
def cifar100(tmp_path, monkeypatch):
    written = write_cifar(tmp_path, "cifar100", train_per_class=6, test_per_class=2)
    accept_checksums(monkeypatch, "cifar100", written)
    return tmp_path, written


@pytest.fixture
def cifar10(tmp_path, monkeypatch):
    written = write_cifar(tmp_path, "cifar10", train_per_class=24, test_per_class=10, seed=1)
    accept_checksums(monkeypatch, "cifar10", written)
    return tmp_path, written


def test_generated_files_load_through_torchvision(cifar100, cifar10):
    for (root, written), cls in ((cifar100, torchvision.datasets.CIFAR100), (cifar10, torchvision.datasets.CIFAR10)):
        for train, part in ((True, "train"), (False, "test")):
            ds = cls(str(root), train=train, download=False)
            np.testing.assert_array_equal(ds.data, written[f"x_{part}"])
            assert ds.targets == written[f"y_{part}"].tolist()
    assert torchvision.datasets.CIFAR10(str(cifar10[0])).classes[5] == "dog"


def test_files_that_differ_from_the_release_are_refused(tmp_path):
    write_cifar(tmp_path, "cifar100", train_per_class=1, test_per_class=1)  # md5s not accepted here
    with pytest.raises(ValueError, match="MD5"):
        Cifar100Source(DataSection.of(build_config(dataset="cifar100", data_root=str(tmp_path)))).test_set()


def test_missing_files_name_the_expected_folder(tmp_path):
    with pytest.raises(ValueError, match=r"cifar-100-python.*lacks train, test, meta.*download=true"):
        make_source(build_config(dataset="cifar100", data_root=str(tmp_path))).test_set()
    with pytest.raises(ValueError, match="needs data_root"):
        make_source(build_config(dataset="cifar10"))


def test_cifar100_ih_with_16_clients(cifar100):
    root, written = cifar100
    src = make_source(build_config(dataset="cifar100", data_root=str(root), num_clients=16, imratio=0.1))
    parts = src.client_indices()
    classes = written["y_train"]
    seen: set[int] = set()
    pos_groups = np.array_split(np.arange(50, 100), 16)  # client k owns the k-th run of positive classes
    for k, ix in enumerate(parts):
        cls = set(classes[ix].tolist())
        assert not cls & seen
        seen |= cls
        pos = classes[ix] >= 50
        neg_classes = set(classes[ix][~pos].tolist())
        assert len(neg_classes) in (3, 4) and max(neg_classes) - min(neg_classes) == len(neg_classes) - 1
        assert set(classes[ix][pos].tolist()) <= set(pos_groups[k].tolist())
        assert abs(pos.sum() - 0.1 * len(ix)) < 1.0 and pos.sum() >= 1
        assert (~pos).sum() == 6 * len(neg_classes)  # negatives untouched
    assert seen >= set(range(50))  # every negative class is on some client
    # a client's shard: lazily converted images of exactly its indices, binary labels
    k = 3
    shard = src.client_shard(k).train
    ix = parts[k]
    assert len(shard) == len(ix)
    np.testing.assert_array_equal(shard.labels.ravel(), (classes[ix] >= 50).astype(np.float32))
    x, y = shard.dataset[1]
    mean, std = torch.tensor(src.mean).view(3, 1, 1), torch.tensor(src.std).view(3, 1, 1)
    raw = torch.from_numpy(written["x_train"][ix[1]]).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(x, (raw - mean) / std)
    assert float(y) == float(classes[ix[1]] >= 50)
    # the test set: every test image, in file order, balanced
    test = src.test_set()
    assert len(test) == 200 and float(test.y.mean()) == 0.5
    np.testing.assert_array_equal(test.dataset.images.permute(0, 2, 3, 1).numpy(), written["x_test"])


def test_cifar100_ih_k16_at_imratio_03_and_dirichlet_alternative(cifar100):
    root, written = cifar100
    src = make_source(build_config(dataset="cifar100", data_root=str(root), num_clients=16, imratio=0.3))
    for ix in src.client_indices():
        pos = written["y_train"][ix] >= 50
        assert abs(pos.sum() - 0.3 * len(ix)) < 1.0
    cfg = build_config(dataset="cifar100", data_root=str(root), num_clients=4, imratio=0.2, partition="dirichlet")
    parts = make_source(cfg).client_indices()
    allix = np.concatenate(parts)
    assert len(allix) == len(set(allix.tolist()))
    assert (written["y_train"][allix] >= 50).mean() == pytest.approx(0.2, abs=0.005)


def test_cifar10_default_split_and_class_lists(cifar10):
    root, written = cifar10
    src = make_source(build_config(dataset="cifar10", data_root=str(root), num_clients=5, imratio=0.2))
    assert src.positive_classes == (5, 6, 7, 8, 9)
    with pytest.raises(ValueError, match="num_clients=6 is more than the 5 positive classes"):
        make_source(build_config(dataset="cifar10", data_root=str(root), num_clients=6)).client_indices()
    # explicit lists: classes in neither are left out of training and test
    src = make_source(build_config(dataset="cifar10", data_root=str(root), num_clients=2, imratio=0.25,
                                   positive_classes=[3, 5], negative_classes=[0, 1, 2]))
    used = {3, 5, 0, 1, 2}
    for ix in src.client_indices():
        assert set(written["y_train"][ix].tolist()) <= used
    test = src.test_set()
    assert len(test) == 50 and float(test.y.sum()) == 20
    with pytest.raises(ValueError, match=r"classes \[12\] are not in the test data"):
        make_source(build_config(dataset="cifar10", data_root=str(root), positive_classes=[12])).test_set()
    with pytest.raises(ValueError, match=r"classes \[12\] are not in the training data"):
        make_source(build_config(dataset="cifar10", data_root=str(root), positive_classes=[12])).client_shard(0)
    with pytest.raises(ValueError, match="both positive_classes and negative_classes"):
        make_source(build_config(dataset="cifar10", data_root=str(root), positive_classes=[1],
                                 negative_classes=[1, 2]))


def test_augmentation_is_random_seeded_and_training_only(cifar10):
    root, _ = cifar10
    cfg = build_config(dataset="cifar10", data_root=str(root), num_clients=2, imratio=0.2, augment=True)
    a, b = make_source(cfg).client_shard(0).train.dataset, make_source(cfg).client_shard(0).train.dataset
    draws_a = [a[0][0] for _ in range(6)]
    draws_b = [b[0][0] for _ in range(6)]
    assert any(not torch.equal(draws_a[0], d) for d in draws_a[1:])  # random crops / flips
    assert all(torch.equal(p, q) for p, q in zip(draws_a, draws_b, strict=True))  # seeded per client
    state = torch.get_rng_state()
    a[0]
    assert torch.equal(state, torch.get_rng_state())  # torch's global generator is left alone
    test = make_source(cfg).test_set().dataset
    assert torch.equal(test[0][0], test[0][0])


def test_data_workers_reach_the_dataloader(cifar10):
    root, _ = cifar10
    batches = {}
    for workers in (0, 1):
        cfg = build_config(dataset="cifar10", data_root=str(root), num_clients=2, imratio=0.2, data_workers=workers)
        split = make_source(cfg).client_shard(1).train
        assert split.num_workers == workers
        sampler = LoaderSampler(split, 8, seed=4, device=torch.device("cpu"))
        batches[workers] = [sampler.next()[0] for _ in range(2)]
    assert all(torch.equal(p, q) for p, q in zip(batches[0], batches[1], strict=True))


def test_short_federated_run_on_cifar_files(cifar10):
    root, written = cifar10
    cfg = build_config(dataset="cifar10", data_root=str(root), num_clients=2, imratio=0.2, model="resnet20",
                       algorithm="codasca", iterations=24, local_steps=4, batch_size=16, lr=0.1, eval_every=24,
                       executor="inline")
    result = fdam_ray.train(cfg, save=False)
    src = make_source(cfg)
    parts = src.client_indices()
    n_pos = sum(int((written["y_train"][ix] >= 5).sum()) for ix in parts)
    assert result.summary["positive_ratio"] == [pytest.approx(n_pos / sum(map(len, parts)), abs=1e-6)]
    assert result.history[-1]["test_samples"] == 100
    assert result.summary["final_test_auc"] > 0.9  # positives are brighter in the red plane
