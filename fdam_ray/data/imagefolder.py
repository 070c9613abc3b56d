"""ImageNet-style folders: ``data_root/train/<class>/<image>`` and ``data_root/val/<class>/<image>``.

Classes are numbered by their sorted folder names, as torchvision's
``ImageFolder`` numbers them; ``positive_classes`` / ``negative_classes`` take
those numbers. By default the classes are split half/half at random with a
fixed seed, so every run seed sees the same task (the paper's ImageNet-IH picks
500 of the 1000 classes as positive, Sec. 5). The IH or Dirichlet partition
then works as for CIFAR; the ``val`` images are the test set, untouched.

Images are opened one at a time by the DataLoader: resized so the short side
is image_size / 0.875 and centre-cropped to ``image_size`` (224 by default),
or, for training with ``augment``, randomly resized, cropped and flipped.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from fdam_ray.data.base import DatasetSplit
from fdam_ray.data.images import FileImages, folder_transform, split_seed
from fdam_ray.data.pooled import ClassPoolSource
from fdam_ray.data.sections import DataSection

log = logging.getLogger(__name__)

CLASS_SPLIT_SEED = 20210301
DEFAULT_IMAGE_SIZE = 224


class ImageFolderSource(ClassPoolSource):
    def __init__(self, section: DataSection) -> None:
        from torchvision.datasets.folder import find_classes

        super().__init__(section)
        if section.data_root is None:
            raise ValueError("dataset=imagefolder needs data_root: the folder that holds train/<class>/ and "
                             "val/<class>/")
        self.root = os.path.normpath(os.path.expanduser(section.data_root))
        for part in ("train", "val"):
            if not os.path.isdir(os.path.join(self.root, part)):
                raise ValueError(f"dataset=imagefolder: '{os.path.join(self.root, part)}' is not a folder; "
                                 f"data_root must hold {part}/<class>/<image files>")
        try:
            self.class_names = tuple(find_classes(os.path.join(self.root, "train"))[0])
        except FileNotFoundError as exc:
            raise ValueError(f"dataset=imagefolder: {exc}") from None
        n = len(self.class_names)
        if not section.positive_classes:
            if self.negative_classes is not None:
                self.positive_classes = tuple(c for c in range(n) if c not in self.negative_classes)
            else:
                order = np.random.default_rng(CLASS_SPLIT_SEED).permutation(n)
                self.positive_classes = tuple(sorted(order[: n // 2].tolist()))
        self.image_size = section.image_size or DEFAULT_IMAGE_SIZE
        self.input_shape = (3, self.image_size, self.image_size)
        self.augment = section.augment
        self.num_workers = section.data_workers

    def _scan(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

        folder = os.path.join(self.root, part)
        index = {name: i for i, name in enumerate(self.class_names)}
        names = find_classes(folder)[0] if part != "train" else list(self.class_names)
        extra = sorted(set(names) - set(index))
        if extra:
            raise ValueError(f"dataset=imagefolder: '{folder}' has classes that train/ lacks: {extra[:5]}")
        if len(names) < len(index):
            log.warning("imagefolder: %s has %d of the %d training classes", folder, len(names), len(index))
        try:
            samples = make_dataset(folder, {name: index[name] for name in names}, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as exc:
            raise ValueError(f"dataset=imagefolder: {exc}") from None
        relpaths = np.array([os.fsencode(os.path.relpath(path, self.root)) for path, _ in samples])
        return relpaths, np.array([c for _, c in samples], dtype=np.int64)

    def load_pool(self):
        """Relative file names (bytes) and class numbers of the train and val images."""
        return (*self._scan("train"), *self._scan("val"))

    def load_test(self):
        return self._scan("val")

    def make_split(self, x: np.ndarray, classes: np.ndarray, *, client_id: int | None) -> DatasetSplit:
        labels = self.binary_labels(classes)
        augment = self.augment and client_id is not None
        augment_seed = split_seed(self.seed, client_id) if augment and client_id is not None else None
        dataset = FileImages(self.root, x, labels, folder_transform(self.image_size, augment=augment),
                             augment_seed=augment_seed)
        return DatasetSplit(dataset, labels.numpy(), num_workers=self.num_workers)
