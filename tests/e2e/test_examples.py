"""The scripts in examples/, each run in its reduced form (--quick), as a user would run them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# examples/sweep.py runs in tests/tuning/test_tune.py, which has a Ray session for its sweeps


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_readme_lists_every_example():
    listed = set(re.findall(r"`(\w+\.py)`", (EXAMPLES / "README.md").read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} <= listed
    assert {"hospitals.py", "sweep.py", "own_model_and_data.py"} <= listed


def test_every_example_that_uses_ray_starts_it_as_fdam_does():
    """A bare ``ray.init()``, or Ray Tune left to start Ray itself, gives an instance whose servers listen on every
    interface; the examples (and any script in tune/) start Ray through fdam's own start, which joins the cluster
    named or this user's ``ray start`` cluster, else starts a private one on 127.0.0.1 only
    (docs/explanation/trust.md), or through an fdam entry point that does (``train_arrays``, ``run_sweep``)."""
    scripts = [*EXAMPLES.glob("*.py"), *(EXAMPLES.parent / "tune").glob("**/*.py")]
    assert len(scripts) >= 5
    for path in scripts:
        text = path.read_text()
        assert not re.search(r"\bray\.init\s*\(|\bfrom ray import\b[^\n]*\binit\b", text), path.name
        if re.search(r"\bTuner\s*\(", text):
            assert re.search(r"\bensure_ray\s*\(", text), f"{path.name} lets Ray Tune start Ray on every interface"


def test_hospitals_splits_real_imbalanced_data_and_reports_pooled_and_per_site_auc(capsys):
    hospitals = load("hospitals")
    sites = hospitals.hospitals()
    assert [name for name, _, _ in sites] == ["general", "screening", "referral"]
    rates = [float(train[1].mean()) for _, train, _ in sites]
    assert rates[0] < 0.25 < rates[1] < 0.4 < 0.6 < rates[2]  # imbalanced, and differently so per site
    assert sum(len(train[1]) + len(test[1]) for _, train, test in sites) == 569  # every patient, once
    assert all(0 < test[1].mean() < 1 for _, _, test in sites)  # each site's test split has both classes

    assert hospitals.main(["--quick"]) == 0
    out = capsys.readouterr().out
    pooled = float(re.search(r"pooled test AUC: ([\d.]+)", out).group(1))
    assert pooled > 0.85  # untrained scores sit near 0.5
    rows = re.findall(r"^(general|screening|referral)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["general", "screening", "referral"]
    assert all(0.7 < float(r[1]) <= 1 and 0 < float(r[2]) <= 1 for r in rows)


def test_hospitals_with_the_privacy_guides_config_reports_both_epsilons_and_no_site_auc(capsys, tmp_path):
    """docs/how-to/privacy.md's config block, given to the study with --config: each site's training records at
    the target epsilon, the test records at theirs, and no per-site AUC (dp_eval releases pooled counts only)."""
    page = (EXAMPLES.parent / "docs" / "how-to" / "privacy.md").read_text()
    block = re.search(r"```yaml\n(# private\.yaml\n.*?)```", page, re.S).group(1)
    config = tmp_path / "private.yaml"
    config.write_text(block)
    assert load("hospitals").main(["--quick", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"training records: epsilon (3\.99\d|4\.000) \(the largest site's\), delta 1e-05", out), out
    assert re.search(r"test records: epsilon (7\.99\d|8\.000), delta 1e-05", out), out
    assert 0 <= float(re.search(r"pooled test AUC: ([\d.]+)", out).group(1)) <= 1
    rows = re.findall(r"^(general|screening|referral)\s+(\S+)\s+([\d.]+)$", out, re.M)
    assert [r[1] for r in rows] == ["-", "-", "-"]


def test_hospitals_refuses_a_config_file_that_is_not_a_mapping(tmp_path):
    config = tmp_path / "list.yaml"
    config.write_text("- dp\n- sample\n")
    with pytest.raises(SystemExit):
        load("hospitals").main(["--quick", "--config", str(config)])
