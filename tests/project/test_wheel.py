"""The package as users install it: `python -m build` makes an sdist and, from it, a wheel; the wheel installed into
a fresh virtual environment runs `fdam --version` and a short `fdam train`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import fdam_ray

ROOT = Path(__file__).resolve().parents[2]


def run(cmd, cwd, env, timeout=300):
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_environment_and_runs(tmp_path):
    pytest.importorskip("build")  # the dev extra installs it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    dist = tmp_path / "dist"
    # sdist first, then the wheel built from the unpacked sdist: the sdist must hold all a build needs
    run([sys.executable, "-m", "build", "--outdir", dist, ROOT], tmp_path, env)
    version = fdam_ray.__version__
    sdist, wheel = dist / f"fdam_ray-{version}.tar.gz", dist / f"fdam_ray-{version}-py3-none-any.whl"
    assert sdist.is_file() and wheel.is_file()

    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml", "fdam_ray/cli.py",
            "fdam_ray/outputs/trackers.py",
            "fdam_ray/tuning/spaces/small.yaml", "fdam_ray/tuning/spaces/paper_grid.yaml", "examples/hospitals.py",
            "examples/README.md",
            "docs/algorithms.md", "tests/conftest.py"} <= in_sdist
    assert not [n for n in in_sdist if n.startswith((".venv", "runs/", ".git/")) or "__pycache__" in n]

    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata = whl.read(f"fdam_ray-{version}.dist-info/METADATA").decode()
        entry_points = whl.read(f"fdam_ray-{version}.dist-info/entry_points.txt").decode()
    assert {"fdam_ray/__init__.py", "fdam_ray/outputs/trackers.py", "fdam_ray/tuning/sweep.py",
            "fdam_ray/executors/ray/actor.py", "fdam_ray/data/chestxray.py",
            "fdam_ray/tuning/spaces/small.yaml", "fdam_ray/tuning/spaces/paper_grid.yaml",
            "fdam_ray/settings/fields.json"} <= in_wheel  # the field table `fdam fields` reads without torch
    assert not [n for n in in_wheel if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert "fdam = fdam_ray.cli:main" in entry_points
    assert "Provides-Extra: mlflow" in metadata and "Provides-Extra: wandb" in metadata
    assert f"Version: {version}" in metadata

    # A fresh environment without pip; the wheel installed by this interpreter's pip without its dependencies,
    # which the new environment reads from this one's site-packages (a .pth line, so torch and Ray are not
    # installed again). Site-packages .pth files of this environment (the editable install of the source
    # tree) are not processed from there, so only the wheel provides fdam_ray.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                       env).strip())
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_parent_env.pth").write_text("".join(f"{p}\n" for p in sorted(here)))
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel],
        tmp_path, env)

    # where `import fdam_ray` finds the package (found, not imported: importing it takes seconds)
    where = run([python, "-c", "import importlib.util; print(importlib.util.find_spec('fdam_ray').origin)"],
                tmp_path, env).strip()
    assert Path(where).is_relative_to(purelib) and not Path(where).is_relative_to(ROOT), where
    fdam = venv / "bin" / "fdam"
    assert run([fdam, "--version"], tmp_path, env) == f"fdam {version}\n"
    assert "stage_length" in run([fdam, "fields", "schedule"], tmp_path, env)  # from the wheel's field table
    out = run([fdam, "train", "dataset=synthetic", "model=mlp", "num_clients=2", "samples_per_client=100",
               "local_steps=5", "iterations=20", "eval_every=10", "executor=inline", "tensorboard=false",
               f"out_dir={tmp_path / 'runs'}", "run_name=wheel", "--quiet"], tmp_path, env)
    assert "final test AUC" in out and (tmp_path / "runs" / "wheel" / "model.pt").is_file()

    # the hint of `fdam tune` without a space points into the installed package, where the example spaces are
    hint = subprocess.run([str(fdam), "tune"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert hint.returncode == 2, hint.stderr
    folder = Path(hint.stderr.split("copy one from ", 1)[1].split(" to start", 1)[0])
    assert folder.is_relative_to(purelib) and (folder / "small.yaml").is_file(), hint.stderr
