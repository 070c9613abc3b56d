"""Tiny datasets written in the exact on-disk formats the loaders read (generated, never downloaded)."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def cifar_images(classes: np.ndarray, rng: np.random.Generator, positive_from: int) -> np.ndarray:
    """uint8 rows of 3072 values (R, G, B planes of 32x32) with a brighter red plane for positive classes."""
    data = rng.integers(0, 120, size=(len(classes), 3, 1024))
    data[:, 0] += np.where(classes >= positive_from, 120, 0)[:, None]
    return data.reshape(len(classes), 3072).astype(np.uint8)


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=2)  # the official files are protocol-2 pickles


def write_cifar(root: Path, kind: str, *, train_per_class: int, test_per_class: int, seed: int = 0) -> dict:
    """Write cifar-10-batches-py/ or cifar-100-python/ under ``root``; return the arrays and file md5s."""
    n_classes = 10 if kind == "cifar10" else 100
    rng = np.random.default_rng(seed)
    y_tr = rng.permutation(np.repeat(np.arange(n_classes), train_per_class))
    y_te = rng.permutation(np.repeat(np.arange(n_classes), test_per_class))
    x_tr = cifar_images(y_tr, rng, n_classes // 2)
    x_te = cifar_images(y_te, rng, n_classes // 2)
    names = lambda prefix, y: [f"{prefix}_{i:05d}.png" for i in range(len(y))]
    if kind == "cifar10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        files = []
        for b, idx in enumerate(np.array_split(np.arange(len(y_tr)), 5), start=1):
            _dump(folder / f"data_batch_{b}", {"batch_label": f"training batch {b} of 5",
                                               "labels": y_tr[idx].tolist(), "data": x_tr[idx],
                                               "filenames": names(f"train{b}", idx)})
            files.append(f"data_batch_{b}")
        _dump(folder / "test_batch", {"batch_label": "testing batch 1 of 1", "labels": y_te.tolist(),
                                      "data": x_te, "filenames": names("test", y_te)})
        _dump(folder / "batches.meta", {"num_cases_per_batch": len(y_te), "label_names": CIFAR10_NAMES,
                                        "num_vis": 3072})
        train_files, test_files, meta = files, ["test_batch"], "batches.meta"
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        for part, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
            _dump(folder / part, {"filenames": names(part, y), "batch_label": f"{part}ing batch 1 of 1",
                                  "fine_labels": y.tolist(), "coarse_labels": (y // 5).tolist(), "data": x})
        _dump(folder / "meta", {"fine_label_names": [f"fine{c:02d}" for c in range(100)],
                                "coarse_label_names": [f"coarse{c:02d}" for c in range(20)]})
        train_files, test_files, meta = ["train"], ["test"], "meta"
    return {
        "x_train": x_tr.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), "y_train": y_tr,
        "x_test": x_te.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), "y_test": y_te,
        "train_list": [[f, md5(folder / f)] for f in train_files],
        "test_list": [[f, md5(folder / f)] for f in test_files],
        "meta_md5": md5(folder / meta),
    }


def accept_checksums(monkeypatch, kind: str, written: dict) -> None:
    """Make torchvision's class expect the generated files' md5s (in this test only)."""
    import torchvision.datasets

    cls = torchvision.datasets.CIFAR10 if kind == "cifar10" else torchvision.datasets.CIFAR100
    monkeypatch.setattr(cls, "train_list", written["train_list"])
    monkeypatch.setattr(cls, "test_list", written["test_list"])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": written["meta_md5"]})


def write_image_folder(root: Path, train: dict[str, int], val: dict[str, int], *, shape=(10, 14),
                       classes: list[str] | None = None) -> None:
    """``root/{train,val}/<class>/<i>.(png|jpg)``; every image of class c is one flat grey level 20 * (c + 1),
    c its index among the sorted training class names, or in ``classes`` (a federation's list, when this
    folder lacks some), so a read can be traced back to its class."""
    order = {name: i for i, name in enumerate(classes or sorted(train))}
    for part, counts in (("train", train), ("val", val)):
        for name, n in counts.items():
            folder = root / part / name
            folder.mkdir(parents=True)
            level = 20 * (order[name] + 1)
            for i in range(n):
                img = Image.fromarray(np.full((*shape, 3), level, dtype=np.uint8))
                img.save(folder / (f"{i}.png" if i % 2 else f"{i}.jpg"), quality=100)
