"""What ``setup.cfg`` asks pip for: a core with Ray pinned to the range the Ray executor supports, one extra
per optional part (the names the package's messages use), a ``dev`` extra holding every other one, and no
instruction anywhere in the package that installs fdam-ray by a bare name from an index."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from fdam_ray.executors.ray.compat import SUPPORTED, RayVersionError, check_ray_version
from fdam_ray.files.extras import EXTRAS, extra_hint

ROOT = Path(__file__).resolve().parents[3]


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def requirements(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def name_of(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_core_pins_ray_to_the_supported_range_and_leaves_the_optional_parts_out():
    core = requirements(setup_cfg()["options"]["install_requires"])
    assert f"ray[default,tune]{','.join(SUPPORTED)}" in core
    assert {name_of(r) for r in core} == {"ray", "torch", "numpy", "scikit-learn", "pyyaml", "tqdm"}


def test_the_extras_are_the_names_the_messages_use_and_dev_holds_every_other():
    extras = {name: requirements(text) for name, text in setup_cfg()["options.extras_require"].items()}
    assert set(extras) == set(EXTRAS)
    others = {r for name, reqs in extras.items() if name != "dev" for r in reqs}
    assert others <= set(extras["dev"]), sorted(others - set(extras["dev"]))
    assert {name_of(r) for r in extras["dev"]} >= {"pytest", "ruff", "mypy", "build"}
    assert set(extras["trackers"]) == {*extras["mlflow"], *extras["wandb"], *extras["tensorboard"]}
    assert not [r for reqs in extras.values() for r in reqs if name_of(r) == "fdam-ray"]  # never itself, by name


def test_no_message_installs_fdam_ray_by_a_bare_name():
    bare = re.compile(r"pip install\s+(-U\s+|--upgrade\s+)?['\"]?fdam[-_]ray\b")
    files = [*(ROOT / "fdam_ray").rglob("*.py"), *(ROOT / "examples").rglob("*"), *(ROOT / "deploy").rglob("*"),
             *(ROOT / "docs").rglob("*.md"), *(ROOT / "tests").rglob("*.py"), ROOT / "README.md"]
    said = {p.relative_to(ROOT).as_posix() for p in files
            if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".service", "") and bare.search(p.read_text())}
    assert not said


def test_an_extra_hint_names_the_wheel_and_the_checkout_and_the_package_alone():
    hint = extra_hint("dicom", "pydicom")
    assert "\n" not in hint
    assert 'pip install "./fdam_ray-<version>-py3-none-any.whl[dicom]"' in hint
    assert 'pip install -e ".[dicom]"' in hint and hint.endswith("pip install pydicom")
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        extra_hint("gpu")


@pytest.mark.parametrize("version", ["2.60.0", "2.60.7"])
def test_a_ray_in_the_supported_range_is_taken(version):
    assert check_ray_version(version) == version


@pytest.mark.parametrize("version", ["2.59.9", "2.61.0", "3.0.0"])
def test_another_ray_is_refused_in_one_line_naming_it_and_the_range(version):
    with pytest.raises(RayVersionError) as caught:
        check_ray_version(version)
    message = str(caught.value)
    assert "\n" not in message and f"Ray {version} is installed" in message and ">=2.60,<2.61" in message
    assert isinstance(caught.value, ValueError)  # the CLI reports it in one line
