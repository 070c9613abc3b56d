"""ImageNet-style folders: class numbering, seeded half/half split, IH partition, lazy reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from image_fixtures import write_image_folder
from PIL import Image

from fdam_ray.config import build_config
from fdam_ray.data import DatasetSplit, make_source
from fdam_ray.data.imagefolder import CLASS_SPLIT_SEED
from fdam_ray.data.images import IMAGENET_MEAN, IMAGENET_STD

NAMES = ["n05", "n01", "n03", "n02", "n06", "n04"]  # sorted: n01..n06 -> classes 0..5


@pytest.fixture
def folder(tmp_path):
    train = {name: 4 + i for i, name in enumerate(NAMES)}
    val = {name: 2 for name in NAMES if name != "n02"}  # val lacks one class
    write_image_folder(tmp_path, train, val)
    return tmp_path, train


def cfg(root, **kw):
    return build_config(dataset="imagefolder", data_root=str(root), image_size=8, **kw)


def grey_level(x: torch.Tensor) -> float:
    """Undo the normalisation of a flat image: its grey level in 0..255."""
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return float(((x * std + mean) * 255).mean())


def test_default_split_is_a_seeded_half_of_the_sorted_classes(folder):
    root, _ = folder
    src = make_source(cfg(root, num_clients=3))
    assert src.class_names == ("n01", "n02", "n03", "n04", "n05", "n06")
    expected = sorted(np.random.default_rng(CLASS_SPLIT_SEED).permutation(6)[:3].tolist())
    assert src.positive_classes == tuple(expected)
    assert make_source(cfg(root, num_clients=3, seed=9)).positive_classes == src.positive_classes
    assert src.input_shape == (3, 8, 8)


def test_ih_partition_and_lazy_reads_of_the_right_files(folder):
    root, train = folder
    src = make_source(cfg(root, num_clients=3, imratio=0.2, positive_classes=[0, 2, 4]))
    _, classes, _, _ = src._pool
    assert len(classes) == sum(train.values())
    seen: set[int] = set()
    for k in range(3):
        shard = src.client_shard(k).train
        assert isinstance(shard, DatasetSplit)
        ix = src.client_indices()[k]
        cls = set(classes[ix].tolist())
        assert len(cls) == 2 and not cls & seen  # one positive, one negative class, none shared
        seen |= cls
        pos = np.isin(classes[ix], (0, 2, 4))
        assert abs(pos.sum() - 0.2 * len(ix)) < 1.0 and pos.sum() >= 1
        for i in range(len(shard)):
            img, y = shard.dataset[i]
            assert img.shape == (3, 8, 8)
            assert grey_level(img) == pytest.approx(20 * (classes[ix[i]] + 1), abs=1.5)  # the file of its class
            assert float(y) == float(classes[ix[i]] in (0, 2, 4))
    assert seen == set(range(6))


def test_val_folder_is_the_untouched_test_set_numbered_by_training_names(folder):
    root, _ = folder
    test = make_source(cfg(root, positive_classes=[0, 2, 4])).test_set()
    assert len(test) == 10  # 5 classes x 2, n02 has no val images
    levels = sorted(round(grey_level(test.dataset[i][0])) for i in range(len(test)))
    assert levels == sorted([20 * (c + 1) for c in (0, 2, 3, 4, 5)] * 2)  # n04 is still class 3, not 2
    assert float(test.y.sum()) == 6


def test_class_lists_and_bad_folders(folder, tmp_path_factory):
    root, _ = folder
    src = make_source(cfg(root, negative_classes=[1, 3]))
    assert src.positive_classes == (0, 2, 4, 5)  # the rest
    src = make_source(cfg(root, positive_classes=[5], negative_classes=[0]))
    assert len(src.test_set()) == 4
    empty = tmp_path_factory.mktemp("empty")
    (empty / "train").mkdir()
    with pytest.raises(ValueError, match=r"val' is not a folder; data_root must hold val/<class>/"):
        make_source(cfg(empty))
    with pytest.raises(ValueError, match="needs data_root"):
        make_source(build_config(dataset="imagefolder"))
    (root / "val" / "n99").mkdir()
    with pytest.raises(ValueError, match=r"classes that train/ lacks: \['n99'\]"):
        make_source(cfg(root)).test_set()


def test_augmented_training_reads_keep_the_shape(folder):
    root, _ = folder
    shard = make_source(cfg(root, num_clients=1, imratio=0.4, augment=True)).client_shard(0).train
    shapes = {tuple(shard.dataset[0][0].shape) for _ in range(3)}
    assert shapes == {(3, 8, 8)}


@pytest.fixture
def textured(tmp_path):
    """A folder whose images have texture (random pixels), so a crop or a flip changes what is read."""
    rng = np.random.default_rng(5)
    for part, n in (("train", 6), ("val", 3)):
        for name in ("n01", "n02"):
            folder = tmp_path / part / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return tmp_path


def reads(root, *, augment: bool, seed: int = 0, times: int = 3) -> list[torch.Tensor]:
    """The first training image of client 0, read ``times`` times."""
    src = make_source(cfg(root, num_clients=1, imratio=0.4, positive_classes=[0], augment=augment, seed=seed))
    shard = src.client_shard(0).train
    return [shard.dataset[0][0] for _ in range(times)]


def test_augment_changes_the_training_pixels_and_is_seeded(textured):
    plain = reads(textured, augment=False)
    assert all(torch.equal(plain[0], x) for x in plain)  # without augment every read is the same
    augmented = reads(textured, augment=True)
    assert all(x.shape == (3, 8, 8) for x in augmented)
    assert all(not torch.equal(x, plain[0]) for x in augmented)  # augment changes the pixels ...
    assert not torch.equal(augmented[0], augmented[1])  # ... with a new draw on every read
    again = reads(textured, augment=True)
    assert all(torch.equal(x, y) for x, y in zip(augmented, again, strict=True))  # the same seed, the same pixels
    other = reads(textured, augment=True, seed=1)
    assert not any(torch.equal(x, y) for x, y in zip(augmented, other, strict=True))  # another seed, others


def test_augment_leaves_the_test_split_untouched(textured):
    def test_pixels(augment: bool) -> torch.Tensor:
        test = make_source(cfg(textured, positive_classes=[0], augment=augment)).test_set()
        return torch.stack([test.dataset[i][0] for i in range(len(test))] * 2)

    plain, augmented = test_pixels(False), test_pixels(True)
    assert len(plain) == 12 and torch.equal(plain, augmented)
