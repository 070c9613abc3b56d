"""CIFAR-10 and CIFAR-100 from the files of the official Python release, read through torchvision.

``data_root`` is the folder that holds ``cifar-10-batches-py/`` (data_batch_1..5,
test_batch, batches.meta) or ``cifar-100-python/`` (train, test, meta) as
unpacked from ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``.
torchvision checks every file's MD5 against the official release; with
``download: true`` it fetches and unpacks the archive into ``data_root`` first.

CIFAR100-IH as in the paper (Sec. 5, "IH benchmark datasets"): classes 0-49
negative, 50-99 positive, each side split into K class-disjoint groups, and
positives dropped so that every client has ``imratio`` positives; the test set
(10000 images, 100 per class) is untouched and balanced. CIFAR-10 uses the
same half/half rule: classes 0-4 (airplane, automobile, bird, cat, deer)
negative, 5-9 (dog, frog, horse, ship, truck) positive, so its IH partition
takes at most K = 5 clients.

The images stay uint8 in memory and are converted (and, with ``augment``,
randomly cropped and flipped) one at a time as the DataLoader reads them.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from fdam_ray.data.base import DatasetSplit
from fdam_ray.data.images import ArrayImages, cifar_transform, split_seed
from fdam_ray.data.pooled import ClassPoolSource
from fdam_ray.data.sections import DataSection
from fdam_ray.files.extras import require


class CifarSource(ClassPoolSource):
    name: str
    torchvision_class: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    input_shape = (3, 32, 32)

    @classmethod
    def root_problem(cls, section: DataSection, root: str) -> str | None:
        path = os.path.expanduser(root)
        if section.download and not os.path.exists(path):
            return None  # download=true fetches the archive into it
        return super().root_problem(section, root)

    def __init__(self, section: DataSection) -> None:
        super().__init__(section)
        if section.data_root is None:
            raise ValueError(f"dataset={self.name} needs data_root: the folder that holds "
                             f"{self._dataset_class().base_folder}/")
        root = os.path.normpath(os.path.expanduser(section.data_root))
        if os.path.basename(root) == self._dataset_class().base_folder:
            root = os.path.dirname(root)  # data_root may also name the unpacked folder itself
        self.root = root
        self.download = section.download
        self.augment = section.augment
        self.num_workers = section.data_workers

    def _dataset_class(self):
        require("torchvision", "images", f"dataset {self.torchvision_class}")
        import torchvision.datasets

        return getattr(torchvision.datasets, self.torchvision_class)

    def local_problems(self) -> list[str]:
        """The files of data_root this source lacks (none with download=true), for the driver's check."""
        cls = self._dataset_class()
        names = [n for n, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        if self.download or all(os.path.isfile(os.path.join(self.root, cls.base_folder, n)) for n in names):
            return []
        return [self._problem().removeprefix(f"dataset={self.name}: ")]

    def _problem(self) -> str:
        cls = self._dataset_class()
        folder = os.path.join(self.root, cls.base_folder)
        names = [n for n, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            return (f"dataset={self.name}: '{folder}' lacks {', '.join(missing)}. data_root must hold the folder "
                    f"{cls.base_folder}/ unpacked from {cls.filename}; set download=true to fetch it into "
                    f"data_root '{self.root}'")
        return (f"dataset={self.name}: the files in '{folder}' do not match the official release's MD5 checksums "
                f"(an incomplete download?); unpack {cls.filename} there again, or set download=true")

    def _read(self, train: bool) -> tuple[np.ndarray, np.ndarray]:
        cls = self._dataset_class()
        try:
            dataset = cls(self.root, train=train, download=self.download)
        except RuntimeError:
            raise ValueError(self._problem()) from None
        except OSError as exc:
            raise ValueError(f"dataset={self.name}: download=true could not fetch {cls.url}: {exc}") from None
        return dataset.data, np.asarray(dataset.targets, dtype=np.int64)

    def load_pool(self):
        """uint8 images (n, 32, 32, 3) and class indices, for the training and the test files."""
        return (*self._read(True), *self._read(False))

    def load_test(self):
        return self._read(False)

    def make_split(self, x: np.ndarray, classes: np.ndarray, *, client_id: int | None) -> DatasetSplit:
        images = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
        labels = self.binary_labels(classes)
        augment = self.augment and client_id is not None
        augment_seed = split_seed(self.seed, client_id) if augment and client_id is not None else None
        dataset = ArrayImages(images, labels, cifar_transform(self.mean, self.std, augment=augment),
                              augment_seed=augment_seed)
        return DatasetSplit(dataset, labels.numpy(), num_workers=self.num_workers)


class Cifar10Source(CifarSource):
    name = "cifar10"
    torchvision_class = "CIFAR10"
    default_positive_classes = (5, 6, 7, 8, 9)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class Cifar100Source(CifarSource):
    name = "cifar100"
    torchvision_class = "CIFAR100"
    default_positive_classes = tuple(range(50, 100))
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
