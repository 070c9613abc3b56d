"""Chest X-ray sources read from generated files in each publisher's layout; splits; a 3-source CODASCA run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import chestxray_fixtures as F
import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score

import fdam_ray
from fdam_ray.config import CHESTXRAY_SOURCES, ConfigError, build_config, parse_overrides
from fdam_ray.data import ChestXraySection, make_source
from fdam_ray.data.chestxray import SOURCES, ChestXrayImages, ChestXraySource
from fdam_ray.data.chestxray_readers import TASKS
from fdam_ray.data.images import read_dicom, read_gray
from fdam_ray.models import build_model

NAN = math.nan
WRITERS = {"chexpert": F.write_chexpert, "nih": F.write_nih, "padchest": F.write_padchest, "mimic": F.write_mimic,
           "vindr": F.write_vindr}


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("cxr")
    out = {name: write(base) for name, write in WRITERS.items()}
    out["vindr_kaggle_labels"] = F.write_vindr(base / "kaggle_labels", edema_column=False)
    out["vindr_kaggle_boxes"] = F.write_vindr_kaggle(base)
    return out


def config(roots, sources, **kw):
    values = dict(dataset="chestxray", chestxray_sources=list(sources), num_clients=len(sources), image_size=16,
                  model="cnn", model_width=4, seed=0)
    values.update({f"chestxray_{s}_root": str(roots[s]) for s in sources})
    values.update(kw)
    return build_config(values)


def section(roots, sources, **kw) -> ChestXraySection:
    """What a ChestXraySource takes of :func:`config`."""
    return ChestXraySection.of(config(roots, sources, **kw))


def labels_by_path(source: ChestXraySource, name: str, root: Path) -> dict[str, list[float]]:
    table, labels = source.table(name)
    return {str(Path(p).relative_to(root)): labels[i].tolist() for i, p in enumerate(table.paths)}


def same(a, b) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ config
def test_config_fields_from_yaml_lists_commas_and_sections(roots):
    assert CHESTXRAY_SOURCES == SOURCES
    a = build_config(dict(dataset="chestxray", chestxray_sources=["nih", "chexpert"]))
    b = build_config(parse_overrides(["dataset=chestxray", "chestxray_sources=nih,chexpert"]))
    c = build_config({"dataset": "chestxray", "chestxray": {"sources": ["nih", "chexpert"], "nih_root": "/d/nih"}})
    assert a.chestxray_sources == b.chestxray_sources == c.chestxray_sources == ("nih", "chexpert")
    assert c.chestxray_nih_root == "/d/nih"
    assert a.chestxray_uncertain == ("zeros", "ones", "zeros", "ones", "zeros")
    with pytest.raises(ConfigError, match=r"chestxray_sources.*chexpert, nih, padchest, mimic, vindr"):
        build_config(dict(chestxray_sources=["chexpert", "stanford"]))
    with pytest.raises(ConfigError, match="each source once"):
        build_config(dict(chestxray_sources=["nih", "nih"]))
    with pytest.raises(ConfigError, match=r"chestxray_uncertain.*1 or 5"):
        build_config(dict(chestxray_uncertain=["ones", "zeros"]))
    with pytest.raises(ConfigError, match=r"chestxray_uncertain.*ones, zeros, ignore"):
        build_config(dict(chestxray_uncertain=["maybe"]))


def test_bad_federation_settings_are_named(roots):
    with pytest.raises(ValueError, match=r"one client per source.*num_clients=4"):
        ChestXraySource(section(roots, ["chexpert", "nih"], num_clients=4))
    with pytest.raises(ValueError, match="chestxray_padchest_root is not set"):
        ChestXraySource(ChestXraySection.of(build_config(dict(dataset="chestxray", chestxray_sources=["padchest"],
                                                                num_clients=1))))
    with pytest.raises(ValueError, match="sum to num_clients=4"):
        ChestXraySource(section(roots, ["chexpert", "nih"], num_clients=4, chestxray_clients="patient",
                               chestxray_clients_per_source=[1, 2]))
    with pytest.raises(ValueError, match="at least the number of sources"):
        ChestXraySource(section(roots, ["chexpert", "nih", "mimic"], num_clients=2, chestxray_clients="patient"))


# ------------------------------------------------------------------ labels per source
CODE = {"1.0": 1.0, "0.0": 0.0, "-1.0": -1.0, "": NAN}


def expected_from_strings(values, uncertain, blank="zeros"):
    out = []
    for v, policy in zip(values, uncertain, strict=True):
        c = CODE[v]
        if c == -1.0:
            out.append({"ones": 1.0, "zeros": 0.0, "ignore": NAN}[policy])
        elif math.isnan(c):
            out.append(0.0 if blank == "zeros" else NAN)
        else:
            out.append(c)
    return out


@pytest.mark.parametrize("uncertain, blank", [
    (("zeros", "ones", "zeros", "ones", "zeros"), "zeros"),
    (("ignore",) * 5, "zeros"),
    (("ones",) * 5, "ignore"),
])
def test_chexpert_labels_follow_the_uncertain_and_blank_policies(roots, uncertain, blank):
    src = ChestXraySource(section(roots, ["chexpert"], chestxray_uncertain=list(uncertain), chestxray_blank=blank))
    got = labels_by_path(src, "chexpert", roots["chexpert"])
    frontal = [r for r in F.CHEXPERT_ROWS if r[3]]
    assert len(got) == len(frontal)
    for patient, study, view, _, values in frontal:
        key = f"train/patient{patient:05d}/study{study}/{view}.jpg"
        assert same(got[key], expected_from_strings(values, uncertain, blank)), key
    # LibAUC's default, spelled out for the first image: Cardiomegaly 1, Edema -1 -> 1, blank -> 0,
    # Atelectasis -1 -> 1, Pleural Effusion 0
    if blank == "zeros" and uncertain[1] == "ones":
        assert got["train/patient00001/study1/view1_frontal.jpg"] == [1.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("prefix", ["CheXpert-v1.0-small/", "CheXpert-v1.0/"])
def test_chexpert_path_prefix_is_stripped_and_patient_read_from_the_path(tmp_path, prefix):
    root = F.write_chexpert(tmp_path, prefix=prefix)
    src = ChestXraySource(section({"chexpert": root}, ["chexpert"]))
    table, _ = src.table("chexpert")
    assert all(Path(p).is_file() for p in table.paths)
    assert table.patients[0] == "patient00001" and set(table.patients) == {f"patient{i:05d}" for i in range(1, 9)}


def test_nih_findings_map_to_the_tasks_with_effusion_as_pleural_effusion(roots):
    got = labels_by_path(ChestXraySource(section(roots, ["nih"])), "nih", roots["nih"])
    assert got["images_001/images/00000001_000.png"] == [1, 0, 0, 0, 1]  # Cardiomegaly|Effusion
    assert got["images_001/images/00000001_001.png"] == [0, 0, 0, 0, 0]  # No Finding
    assert got["images_001/images/00000002_001.png"] == [0, 0, 1, 1, 0]  # Atelectasis|Consolidation
    assert got["images_001/images/00000003_000.png"] == [0, 0, 0, 0, 1]  # Effusion|Pleural_Thickening
    assert got["images_002/images/00000004_000.png"] == [1, 1, 0, 1, 0]
    assert got["images_002/images/00000005_000.png"] == [0, 0, 0, 0, 0]  # Nodule|Mass
    assert len(got) == 12


def test_padchest_terms_match_exactly_and_unlabelled_rows_are_skipped(roots):
    got = labels_by_path(ChestXraySource(section(roots, ["padchest"])), "padchest", roots["padchest"])
    by_image = {Path(k).name: v for k, v in got.items()}
    assert by_image["pc_01.png"] == [0, 0, 0, 0, 0]  # pericardial effusion is not pleural effusion
    assert by_image["pc_03.png"] == [1, 0, 0, 0, 1]  # loculated pleural effusion, cardiomegaly
    assert by_image["pc_04.png"] == [0, 1, 0, 1, 0]  # lobar atelectasis, pulmonary edema
    assert by_image["pc_05.png"] == [0, 0, 1, 0, 0]  # kerley lines is not 'pulmonary edema'
    assert by_image["pc_06.png"] == [0, 0, 0, 0, 0]  # normal
    assert by_image["pc_07.png"] == [0, 0, 0, 1, 1]  # ' pleural effusion' with a stray space
    assert by_image["pc_10.png"] == [0, 0, 0, 1, 0]  # pleural thickening no; atelectasis basal yes
    assert "pc_09.png" not in by_image  # no Labels
    assert "pc_02.png" not in by_image  # lateral (L) view
    assert by_image.keys() == {f"pc_{i:02d}.png" for i in range(1, 13)} - {"pc_02.png", "pc_09.png"}


def test_mimic_images_take_their_study_labels_and_lateral_views_are_dropped(roots):
    src = ChestXraySource(section(roots, ["mimic"], chestxray_uncertain=["ignore"]))
    table, labels = src.table("mimic")
    studies = [Path(p).parent.name[1:] for p in table.paths]
    assert sorted(studies) == sorted(s for s, (_, _, v) in F.MIMIC_STUDIES.items() if v is not None)  # 1 PA each
    for study, row in zip(studies, labels, strict=True):
        assert same(row.tolist(), expected_from_strings(F.MIMIC_STUDIES[study][2], ("ignore",) * 5)), study
        subject = F.MIMIC_STUDIES[study][0]
        assert table.patients[studies.index(study)] == subject
    assert all(Path(p).parts[-4] == f"p{Path(p).parts[-3][1:3]}" for p in table.paths)  # files/pXX/pSUBJECT/...


def test_frontal_filter_keeps_only_frontal_views_unless_turned_off(roots):
    on = ChestXraySource(section(roots, ["chexpert"]))
    off = ChestXraySource(section(roots, ["chexpert"], chestxray_frontal_only=False))
    assert not any("lateral" in p for p in on.table("chexpert")[0].paths)
    assert sum("lateral" in p for p in off.table("chexpert")[0].paths) == 3
    assert len(off.table("chexpert")[0]) == len(F.CHEXPERT_ROWS)
    mimic_off = ChestXraySource(section(roots, ["mimic"], chestxray_frontal_only=False))
    assert len(mimic_off.table("mimic")[0]) == 2 * len(ChestXraySource(section(roots, ["mimic"])).table("mimic")[0])


@pytest.mark.parametrize("variant", ["vindr", "vindr_kaggle_labels", "vindr_kaggle_boxes"])
def test_vindr_is_the_union_over_readers_and_a_task_without_a_column_is_missing(roots, variant):
    src = ChestXraySource(section({"vindr": roots[variant]}, ["vindr"]))
    table, labels = src.table("vindr")
    assert [Path(p).stem for p in table.paths] == F.VINDR_IMAGES
    for i, row in enumerate(labels):
        union = np.max([marks for _, marks in F.vindr_reads(i)], axis=0).astype(float)
        if variant == "vindr":
            assert row.tolist() == union.tolist()
        else:
            assert np.isnan(row[1])  # Edema: missing, not negative
            assert np.delete(row, 1).tolist() == np.delete(union, 1).tolist()
    assert (labels[:, 0] == 1).any() and (labels[:, 0] == 0).any()
    assert not any(np.all([m[0] for _, m in F.vindr_reads(i)]) for i in range(12))  # no reader alone is the union


def test_missing_task_is_left_out_of_client_label_counts(roots):
    src = ChestXraySource(section({"vindr": roots["vindr_kaggle_labels"]}, ["vindr"]))
    _positives, labelled = src.client_shard(0).train.label_counts()
    assert labelled[1] == 0 and all(labelled[t] > 0 for t in (0, 2, 3, 4))


def test_a_label_outside_1_0_minus1_blank_names_file_line_and_column(tmp_path, roots):
    rows = list(F.CHEXPERT_ROWS)
    p, s, v, fr, values = rows[2]
    rows[2] = (p, s, v, fr, (values[0], "2.0", *values[2:]))
    root = F.write_chexpert(tmp_path, rows=rows)
    with pytest.raises(ValueError, match=r"train\.csv: line 4, column 'Edema': label '2.0' is not 1, 0, -1"):
        ChestXraySource(section({"chexpert": root}, ["chexpert"])).client_shard(0)
    bad_terms = [(*F.PADCHEST_ROWS[0][:3], "pleural effusion"), *F.PADCHEST_ROWS[1:]]
    root = F.write_padchest(tmp_path, rows=bad_terms)
    with pytest.raises(ValueError, match=r"line 2, column 'Labels'"):
        ChestXraySource(section({"padchest": root}, ["padchest"])).client_shard(0)
    bad_nih = [(F.NIH_ROWS[0][0], "Cardiomegaly|Efusion", 1, "PA"), *F.NIH_ROWS[1:]]
    root = F.write_nih(tmp_path, rows=bad_nih)
    with pytest.raises(ValueError, match=r"line 2, column 'Finding Labels': unknown finding\(s\) \['Efusion'\]"):
        ChestXraySource(section({"nih": root}, ["nih"])).client_shard(0)


# ------------------------------------------------------------------ images
def test_16_bit_png_is_scaled_by_its_range_not_clipped(tmp_path):
    a = np.full((8, 8), 1000, dtype=np.uint16)
    a[:, 4:] = 3000  # 12-bit values: a plain 8-bit conversion would make both halves white
    Image.fromarray(a).save(tmp_path / "x.png")
    assert Image.open(tmp_path / "x.png").mode.startswith("I")
    g = read_gray(str(tmp_path / "x.png"), 8)
    np.testing.assert_allclose(g[:, :3], 0.0, atol=1e-6)
    np.testing.assert_allclose(g[:, 5:], 1.0, atol=1e-6)


def test_dicom_pixels_follow_the_modality_lut_and_monochrome1_is_inverted(tmp_path):
    a = F.gray12(3)
    Image.fromarray(a).save(tmp_path / "x.png")
    png = read_gray(str(tmp_path / "x.png"), 10)
    F.write_dicom(tmp_path / "m2.dicom", a)
    F.write_dicom(tmp_path / "m1.dcm", a, monochrome1=True)
    F.write_dicom(tmp_path / "lut.dicom", a, slope=-2.0, intercept=100.0)  # a negative slope flips brightness
    np.testing.assert_allclose(read_gray(str(tmp_path / "m2.dicom"), 10), png, atol=1e-6)
    np.testing.assert_allclose(read_gray(str(tmp_path / "m1.dcm"), 10), 1.0 - png, atol=1e-6)
    np.testing.assert_allclose(read_gray(str(tmp_path / "lut.dicom"), 10), 1.0 - png, atol=1e-6)
    assert read_dicom(str(tmp_path / "m1.dcm")).max() == a.max() - a.min()


def test_vindr_dicoms_are_read_as_published_and_a_conversion_wins_when_both_are_there(tmp_path, roots):
    root = F.write_vindr(tmp_path / "d", dicom=True)
    src = ChestXraySource(section({"vindr": root}, ["vindr"]))
    table, labels = src.table("vindr")
    assert [Path(p).name for p in table.paths] == [f"{i}.dicom" for i in F.VINDR_IMAGES]
    assert labels.tolist() == ChestXraySource(section(roots, ["vindr"])).table("vindr")[1].tolist()
    x, _ = ChestXrayImages(table.paths, labels, image_size=12)[1]  # a MONOCHROME1 file
    gray = read_gray(table.paths[1], 12)
    torch.testing.assert_close(x[0] * 0.229 + 0.485, torch.from_numpy(gray), atol=1e-5, rtol=0)
    Image.fromarray(F.gray12(0)).save(root / "train" / f"{F.VINDR_IMAGES[0]}.png")
    paths = ChestXraySource(section({"vindr": root}, ["vindr"])).table("vindr")[0].paths
    assert Path(paths[0]).suffix == ".png" and Path(paths[1]).suffix == ".dicom"


def test_dicom_without_pydicom_or_damaged_says_what_to_do(tmp_path, monkeypatch):
    root = F.write_vindr(tmp_path, dicom=True)
    bad = root / "train" / f"{F.VINDR_IMAGES[2]}.dicom"
    bad.write_bytes(b"not a dicom file")
    with pytest.raises(ValueError, match=r"cannot read image '.*\.dicom': InvalidDicomError"):
        read_gray(str(bad), 8)
    monkeypatch.setitem(sys.modules, "pydicom", None)  # as if the dicom extra were not installed
    with pytest.raises(ValueError, match=r"VinDr-CXR's DICOM images needs pydicom: install fdam-ray's 'dicom' extra"):
        ChestXraySource(section({"vindr": root}, ["vindr"])).table("vindr")


def test_images_become_normalised_3_channel_tensors_with_seeded_augmentation(roots):
    table, labels = ChestXraySource(section(roots, ["padchest"])).table("padchest")
    plain = ChestXrayImages(table.paths, labels, image_size=12)
    x, y = plain[0]
    assert x.shape == (3, 12, 12) and x.dtype == torch.float32
    gray = torch.from_numpy(read_gray(table.paths[0], 12))
    for c, (m, s) in enumerate(zip((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), strict=True)):
        torch.testing.assert_close(x[c] * s + m, gray, atol=1e-5, rtol=0)
    assert y.tolist() == labels[0].tolist()
    a1 = ChestXrayImages(table.paths, labels, image_size=12, augment_seed=5)
    a2 = ChestXrayImages(table.paths, labels, image_size=12, augment_seed=5)
    draws = [a1[0][0] for _ in range(3)]
    assert all(torch.equal(d, a2[0][0]) for d in draws)
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], x)


# ------------------------------------------------------------------ clients and splits
def client_patients(src, k):
    train, test = src.client_rows(k)
    table, _ = src.table(src.places[k].source)
    return src.places[k].source, set(table.patients[train]), set(table.patients[test]), len(train) + len(test)


def test_one_client_per_source_with_a_patient_disjoint_test_split(roots):
    src = ChestXraySource(section(roots, ["chexpert", "nih", "padchest"], chestxray_test_fraction=0.3))
    for k in range(3):
        name, train, test, n = client_patients(src, k)
        assert train and test and not train & test
        assert n == len(src.table(name)[0])  # every kept image is either trained on or tested
        assert len(test) == round(0.3 * len(train | test))
    again = ChestXraySource(section(roots, ["nih", "chexpert"], chestxray_test_fraction=0.3, seed=9))
    assert client_patients(again, 1)[2] == client_patients(src, 0)[2]  # same test patients, any seed or order


def test_patient_groups_put_no_patient_on_two_clients(roots):
    cfg = config(roots, ["chexpert", "nih"], num_clients=5, chestxray_clients="patient",
                 chestxray_test_fraction=0.25)
    src = make_source(cfg)
    assert [(p.source, p.group) for p in src.places] == [("chexpert", 0), ("chexpert", 1), ("chexpert", 2),
                                                         ("nih", 0), ("nih", 1)]
    seen: dict[str, set] = {"chexpert": set(), "nih": set()}
    rows = {"chexpert": 0, "nih": 0}
    for k in range(5):
        name, train, test, n = client_patients(src, k)
        assert train and not train & test
        assert not (train | test) & seen[name]
        seen[name] |= train | test
        rows[name] += n
    assert rows == {"chexpert": len(src.table("chexpert")[0]), "nih": len(src.table("nih")[0])}
    other_seed = make_source(cfg.replace(seed=1))
    groups = [client_patients(s, k)[1] for s in (src, other_seed) for k in range(3)]
    assert groups[:3] != groups[3:]  # the grouping follows the run seed


def test_official_test_splits(roots):
    src = ChestXraySource(section(roots, ["chexpert", "mimic", "nih"], chestxray_test_split="official"))
    for k, expected in enumerate([{"patient64541", "patient64542"}, {"12000024"}, {"6"}]):
        _name, train, test, _ = client_patients(src, k)
        assert test == expected and not train & test


def test_a_client_reads_only_its_own_source(roots, tmp_path):
    cfg = config({**roots, "chexpert": tmp_path / "not-here"}, ["chexpert", "nih"])
    src = make_source(cfg)  # the driver touches no file
    shard = src.client_shard(1)
    assert len(shard.train) + len(shard.test) == 12
    with pytest.raises(ValueError, match=r"not-here.*train.csv"):
        src.client_shard(0)


# ------------------------------------------------------------------ a short federation
def test_codasca_on_three_sources_reports_pooled_per_client_and_per_task_auc(roots):
    three = {**roots, "vindr": roots["vindr_kaggle_labels"]}  # the VinDr variant without Edema
    cfg = config(three, ["chexpert", "padchest", "vindr"], image_size=32, model="cnn", model_width=8,
                 algorithm="codasca", iterations=12, local_steps=4, batch_size=4, eval_every=12, lr=0.1,
                 chestxray_test_fraction=0.4, augment=True, executor="inline", device="cpu")
    result = fdam_ray.train(cfg, save=False)
    last = result.history[-1]
    assert set(last["client_auc"]) == {"0", "1", "2"}
    assert list(last["task_auc"]) == list(TASKS)
    # an independent recomputation: the final global model scores every client's test split, pooled
    model = build_model("cnn", (3, 32, 32), 5, width=8, seed=0)
    model.load_state_dict(result.model_state)
    model.eval()
    source = make_source(cfg)
    scores, labels = [], []
    with torch.no_grad():
        for k in range(3):
            test = source.client_shard(k).test
            x = torch.stack([test.dataset[i][0] for i in range(len(test))])
            scores.append(torch.sigmoid(model(x)).numpy())
            labels.append(test.labels)
    scores, labels = np.concatenate(scores), np.concatenate(labels)
    assert last["test_samples"] == len(labels)
    for t, name in enumerate(TASKS):
        keep = ~np.isnan(labels[:, t])
        assert 0 < labels[keep, t].sum() < keep.sum(), f"the fixture's pooled test split lacks a class for {name}"
        assert last["task_auc"][name] == pytest.approx(roc_auc_score(labels[keep, t], scores[keep, t]), abs=1e-5)
    assert np.isnan(labels[:, 1]).any()  # VinDr's Edema stays missing in the pooled test set
