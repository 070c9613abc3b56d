"""``client_data_roots``: refused for datasets that read no folder, every bad folder named on the driver, and one
class numbering for image folders whatever classes each site holds."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from image_fixtures import write_image_folder

from fdam_ray.config import ConfigError, build_config
from fdam_ray.data import make_source
from fdam_ray.data.images import IMAGENET_MEAN, IMAGENET_STD

NAMES = ["a", "b", "c", "d"]


# -- datasets that read no folder -------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset,says", [
    ("digits", "dataset=digits reads no data folder, so every client would train on the same whole dataset; "
               "per-client folders work with cifar10, cifar100, imagefolder: remove client_data_roots"),
    ("synthetic", "dataset=synthetic reads no data folder"),
    ("mnist5k", "dataset=mnist5k reads no data folder"),
    ("own_fixtures:client_dataset", "dataset 'own_fixtures:client_dataset' is your own factory, called as "
                                    "factory(client_id, num_clients, split), and reads no data folder"),
])
def test_roots_for_a_dataset_that_reads_no_folder_are_refused_in_one_line(dataset, says, tmp_path):
    roots = [str(tmp_path / "site0"), str(tmp_path / "site1")]
    for root in roots:
        (tmp_path / root).mkdir()
    with pytest.raises(ConfigError) as info:
        build_config(dataset=dataset, num_clients=2, data_root=str(tmp_path), client_data_roots=roots)
    line = str(info.value)
    assert line.startswith("config field 'client_data_roots': ") and says in line and "\n" not in line


def test_make_source_refuses_them_too_when_given_a_section_built_by_hand(tmp_path):
    config = build_config(dataset="digits", num_clients=2, data_root=str(tmp_path))
    by_hand = dataclasses.replace(config, client_data_roots=(str(tmp_path), str(tmp_path)))
    with pytest.raises(ValueError, match=r"^client_data_roots: dataset=digits reads no data folder"):
        make_source(by_hand)


def test_a_long_list_of_roots_is_shortened_in_the_message(tmp_path):
    roots = [f"/data/site{k}/" + "x" * 200 for k in range(50)]
    with pytest.raises(ConfigError) as info:
        build_config(dataset="digits", num_clients=50, client_data_roots=roots)
    assert len(str(info.value)) < 600 and "(50 in all)" in str(info.value)


# -- every bad folder, on the driver ------------------------------------------------------------------------------
@pytest.fixture
def sites(tmp_path):
    """Three sites (site 1 lacks class b, class 1) and a test folder, images levelled by the global class list."""
    for k in range(3):
        names = [n for n in NAMES if not (k == 1 and n == "b")]
        write_image_folder(tmp_path / f"site{k}", {n: 3 + k for n in names}, {n: 1 for n in names}, classes=NAMES)
    write_image_folder(tmp_path / "test", {n: 1 for n in NAMES}, {n: 2 for n in NAMES})
    return tmp_path


def roots_config(tmp, roots, **kw):
    return build_config(dict(dataset="imagefolder", data_root=str(tmp / "test"), image_size=8, imratio=0.5,
                             num_clients=len(roots), client_data_roots=[str(tmp / r) for r in roots], **kw))


def test_every_bad_folder_is_named_in_one_line_before_any_client_starts(sites):
    (sites / "notes.txt").write_text("not a folder")
    (sites / "flat").mkdir()
    (sites / "flat" / "train").mkdir()
    with pytest.raises(ValueError) as info:
        make_source(roots_config(sites, ["site0", "gone", "notes.txt", "flat"], executor="inline"))
    line = str(info.value)
    assert line.startswith("client_data_roots: client 1: ")
    assert f"client 1: '{sites / 'gone'}' does not exist" in line
    assert f"client 2: '{sites / 'notes.txt'}' is not a folder" in line
    assert f"client 3: '{sites / 'flat'}' has no val/ folder" in line
    assert "client 0" not in line and "\n" not in line


def test_folders_on_a_cluster_are_the_nodes_to_check_not_the_driver(sites, monkeypatch):
    config = roots_config(sites, ["site0", "only_on_a_node"], executor="ray", address="10.1.2.3:6379")

    def source_of(c):  # as a run's assembly makes it: where the clients run is the config's executor and address
        return make_source(c, executor=c.executor, address=c.address)

    assert source_of(config).num_clients == 2  # nothing read of the clients' folders here
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert source_of(dataclasses.replace(config, address=None)).num_clients == 2
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ValueError, match=r"client 1: .*only_on_a_node' does not exist"):  # a local Ray: this machine
        source_of(dataclasses.replace(config, address=None))
    with pytest.raises(ValueError, match=r"client 1: .*only_on_a_node' does not exist"):  # a section alone: inline
        make_source(config)


# -- one class numbering across sites -----------------------------------------------------------------------------
def grey_level(x: torch.Tensor) -> int:
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return round(float(((x * std + mean) * 255).mean()))


def levels_and_labels(source, k: int) -> list[tuple[int, float]]:
    """(the class an image was written as, via its grey level 20 * (class + 1); its label) of client k's shard."""
    train = source.for_client(k).client_shard(k).train
    return [(grey_level(train.dataset[i][0]) // 20 - 1, float(train.labels[i, 0])) for i in range(len(train))]


def test_a_site_lacking_a_class_keeps_every_other_class_number_and_says_what_it_lacks(sites, caplog):
    source = make_source(roots_config(sites, ["site0", "site1", "site2"], positive_classes=[2]))
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        read = {k: levels_and_labels(source, k) for k in range(3)}
    for k, pairs in read.items():
        classes = {c for c, _ in pairs}
        assert classes == ({0, 2, 3} if k == 1 else {0, 1, 2, 3}), k
        assert all(label == float(c == 2) for c, label in pairs), k  # class c is positive on every site
        assert any(label == 1 for _, label in pairs)
    lacking = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert lacking and all(str(sites / "site1") in m and "lacks b (class 1)" in m for m in lacking)
    test = source.test_set()
    assert sorted(grey_level(test.dataset[i][0]) // 20 - 1 for i in range(len(test))) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert float(test.y.sum()) == 2  # the two test images of class c


def test_the_class_list_is_the_union_of_the_sites_even_when_the_test_folder_lacks_one(sites):
    write_image_folder(sites / "site3", {n: 3 for n in [*NAMES, "e"]}, {"a": 1}, classes=[*NAMES, "e"])
    source = make_source(roots_config(sites, ["site1", "site3"], positive_classes=[4]))
    assert source.inner.class_names == ("a", "b", "c", "d", "e")
    pairs = levels_and_labels(source, 1)
    assert {c for c, label in pairs if label == 1} == {4}


def test_class_names_given_fix_the_numbering_and_a_site_with_another_class_is_refused(sites):
    order = ["d", "c", "b", "a"]
    source = make_source(roots_config(sites, ["site0", "site1"], class_names=order, positive_classes=[0]))
    pairs = levels_and_labels(source, 1)
    assert {c for c, label in pairs if label == 1} == {3}  # written as class 3 (d), numbered 0 by class_names
    with pytest.raises(ValueError) as info:
        make_source(roots_config(sites, ["site0", "site1"], class_names=["a", "c", "d"],
                                 positive_classes=[1])).for_client(0).client_shard(0)
    line = str(info.value)
    assert line.startswith(f"client 0 (client_data_roots[0] = '{sites / 'site0'}'): ")
    assert "has classes outside the class list" in line and "['b']" in line and "class_names" in line
    with pytest.raises(ConfigError, match="class_names"):
        build_config(dataset="imagefolder", class_names=["a", "a"])


def test_positive_classes_name_numbers_of_the_class_list(sites):
    with pytest.raises(ValueError, match=r"positive_classes: classes \[7\] are not among the 4 classes"):
        make_source(roots_config(sites, ["site0", "site1"], positive_classes=[7])).for_client(1).client_shard(1)
    default = make_source(roots_config(sites, ["site0", "site1"]))
    assert default.inner.positive_classes == make_source(
        roots_config(sites, ["site0", "site2"])).inner.positive_classes  # the same default split: 4 classes
    assert np.isin(default.inner.positive_classes, range(4)).all()
