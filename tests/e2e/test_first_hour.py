"""The first hour of a new user: what trips one up on the way to a first run, each fixed and pinned here.

A joined cluster too small for the actors fails at once saying what fits; a ``module:attr`` factory of the
current folder is found by ``fdam`` (no ``PYTHONPATH=.``) and by the Ray workers; a wrong data folder fails in
seconds, before Ray starts, naming every missing source; terminal output fits 60 columns without cutting a
number; the Python API shows progress when asked; the private local Ray starts without Ray's token-auth warning.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from raytest import free_ports, pids_using

import fdam_ray
from fdam_ray.cli import main
from fdam_ray.core.state import RoundPlan
from fdam_ray.outputs import progress
from fdam_ray.outputs.observer import RunStart

ROOT = Path(__file__).resolve().parents[2]
FDAM = str(Path(sys.executable).with_name("fdam"))  # the console script: its sys.path lacks the current folder
SMALL = ["dataset=synthetic", "num_clients=2", "samples_per_client=60", "iterations=4", "eval_every=2",
         "local_steps=2", "tensorboard=false", "--no-progress"]
MODULE = textwrap.dedent("""
    import torch.nn as nn


    def make(input_shape, num_tasks):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], num_tasks))
""")


def fdam_env(**extra: str) -> dict:
    """The environment of an ``fdam`` process: this checkout importable, no cluster address, no auth mode set
    (Ray's default), no width unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "COLUMNS")}
    env["PYTHONPATH"] = str(ROOT)  # fdam_ray itself; never the folder the command runs in
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def own_module_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mymod.py").write_text(MODULE)
    return folder


# -- the current folder is importable for module:attr ----------------------------------------------------
def test_fdam_finds_a_model_factory_in_the_folder_it_runs_in_inline(tmp_path):
    folder = own_module_folder(tmp_path)
    out = subprocess.run([FDAM, "train", "model=mymod:make", "executor=inline", *SMALL, f"out_dir={tmp_path}/runs"],
                         cwd=folder, env=fdam_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model mymod:make" in out.stdout and "final test AUC" in out.stdout


def test_a_module_found_in_the_current_folder_is_shipped_to_a_joined_cluster(tmp_path, monkeypatch):
    from fdam_ray.executors.ray import session
    from fdam_ray.settings import factories

    (tmp_path / "fh_own_model.py").write_text(MODULE)
    (tmp_path / "fh_own_pkg").mkdir()
    (tmp_path / "fh_own_pkg" / "__init__.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what the import adds is undone
    monkeypatch.setattr(factories, "_ADDED_FOLDERS", set())
    try:
        assert session._shipped() == {}
        assert callable(factories.resolve("fh_own_model:make", field="model"))
        assert callable(factories.resolve("fh_own_pkg:make", field="model"))
        assert sys.path[-1] == str(tmp_path)  # after the installed packages
        assert session._shipped() == {"runtime_env": {"py_modules": [str(tmp_path / "fh_own_model.py"),
                                                                     str(tmp_path / "fh_own_pkg")]}}
    finally:
        sys.modules.pop("fh_own_model", None)
        sys.modules.pop("fh_own_pkg", None)


def test_a_module_the_current_folder_lacks_is_still_one_line_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "model=nosuchmod:make", "executor=inline", *SMALL, f"out_dir={tmp_path}/runs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot import module 'nosuchmod' of 'nosuchmod:make'" in err


# -- one fdam run on a private local Ray: own module from the current folder, 60 columns, no token warning ----
@pytest.mark.slow  # in CI's slow tier: a private Ray and an fdam process, 19 s
def test_a_private_ray_run_from_the_modules_folder_fits_60_columns_without_the_token_warning(tmp_path):
    folder = own_module_folder(tmp_path)
    out = subprocess.run([FDAM, "train", "model=mymod:make", "executor=ray", "address=local", *SMALL,
                          f"out_dir={tmp_path}/runs"], cwd=folder, env=fdam_env(COLUMNS="60"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Token authentication is enabled" not in out.stderr  # Ray's warning on every private start
    lines = out.stdout.splitlines()
    wide = [x for x in lines if len(x) > 60 and not x.startswith("run folder:")]
    assert not wide, wide
    text = out.stdout
    # every number whole: the records' AUCs, the summary's
    assert len(re.findall(r"test AUC (?:\d\.\d{4}|nan)\b", text)) == 3 + 1, text  # iterations 0, 2, 4; the summary
    assert re.search(r"\(best \d\.\d{4} at iteration \d+\);", text), text


def test_evaluation_lines_break_between_fields_never_inside_a_number():
    record = dict(iteration=1234567, round=12345, stage=12, lr=1.234e-5, train_loss=0.123456, test_auc=0.87654,
                  wall_s=12345.6)
    one = progress.evaluation_lines(record, None)
    assert one == ["iter 1234567  round 12345  stage 12  lr 1.234e-05 loss    0.1235  test AUC 0.8765  "
                   "[12345.6 s]"]  # a file or pipe keeps the one-line form
    for width in (60, 40):
        lines = progress.evaluation_lines(record, width)
        assert len(lines) > 1 and all(len(x) <= width for x in lines), lines
        assert " ".join(" ".join(lines).split()) == " ".join(one[0].split())  # only the breaks differ
    summary = ("final test AUC 0.8487 (best 0.8487 at iteration 4); 1 rounds, 4 iterations, 0.0 MB moved, "
               "0.1 s, 14951.1 samples/s")
    lines = progress.fit_text(summary, 60)
    assert all(len(x) <= 60 for x in lines) and " ".join(" ".join(lines).split()) == summary


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_the_progress_bar_fits_the_terminal_without_cutting_a_number(columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    bar = progress.Progress(file=out)
    bar.start(RunStart(resumed=False, history=[], round=0, iteration=0, iterations=400000))
    bar.record({"test_auc": 0.8123}, dict)
    bar.round_end(RoundPlan(round=12345, stage=2, steps=123450, lr=0.0333, iteration=0), None, dict)
    bar.bar.refresh()
    shown = out.getvalue().split("\r")[-1]
    bar.close(None)
    assert len(shown) <= columns, shown
    assert re.search(r"round[ =]12345\b", shown) and re.search(r"auc[ =]0\.8123\b", shown), shown


# -- progress= in the Python API -------------------------------------------------------------------------
def test_the_python_api_shows_progress_when_asked_and_is_silent_otherwise(clients_and_test, capsys):
    clients, test = clients_and_test
    config = dict(model="mlp", model_width=8, iterations=4, eval_every=2, local_steps=2, executor="inline")
    fdam_ray.train_arrays(config, clients, test, progress=True)
    shown = capsys.readouterr()
    assert len(re.findall(r"^iter +\d+ +round", shown.out, flags=re.M)) == 3  # iterations 0, 2, 4
    assert "4/4" in shown.err  # the bar
    seen = []
    fdam_ray.train_arrays(config, clients, test, progress=False, on_eval=seen.append)
    assert capsys.readouterr() == ("", "") and len(seen) == 3
    fdam_ray.train_arrays(config, clients, test)  # the default: stderr is not a terminal here
    assert capsys.readouterr() == ("", "")


# -- data roots checked on the driver before Ray starts -------------------------------------------------
def test_every_missing_chestxray_source_is_one_error_before_ray_starts(tmp_path, capsys):
    import ray

    (tmp_path / "nih").mkdir()
    (tmp_path / "mimic").mkdir()
    (tmp_path / "mimic" / "mimic-cxr-2.0.0-split.csv.gz").write_bytes(b"")
    args = ["train", "executor=ray", "dataset=chestxray", "chestxray_sources=chexpert,nih,mimic", "num_clients=3",
            f"chestxray_chexpert_root={tmp_path / 'nowhere'}", f"chestxray_nih_root={tmp_path / 'nih'}",
            f"chestxray_mimic_root={tmp_path / 'mimic'}", "model=mlp", "iterations=2", "tensorboard=false",
            f"out_dir={tmp_path / 'runs'}", "--no-progress"]
    t0 = time.monotonic()
    assert main(args) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert not ray.is_initialized() and took < 30 and not (tmp_path / "runs").exists()
    assert err.count("\n") == 1, err
    assert f"chestxray_chexpert_root: '{tmp_path / 'nowhere'}' does not exist" in err
    assert f"chestxray_nih_root: '{tmp_path / 'nih'}' lacks Data_Entry_2017*.csv" in err
    assert (f"chestxray_mimic_root: '{tmp_path / 'mimic'}' lacks mimic-cxr-2.0.0-chexpert.csv.gz, "
            "mimic-cxr-2.0.0-metadata.csv.gz (checked on this machine, where the clients run, before starting "
            "them)") in err


def test_every_unset_chestxray_root_is_named_at_once():
    from fdam_ray.config import build_config
    from fdam_ray.data import ChestXraySection
    from fdam_ray.data.chestxray import ChestXraySource

    section = ChestXraySection.of(build_config(dict(dataset="chestxray", chestxray_sources=["padchest", "vindr"],
                                                    num_clients=2)))
    with pytest.raises(ValueError, match=r"lists 'padchest', 'vindr' but chestxray_padchest_root, "
                                         r"chestxray_vindr_root are not set"):
        ChestXraySource(section)


def test_missing_cifar_files_fail_before_ray_starts(tmp_path, capsys):
    import ray

    t0 = time.monotonic()
    assert main(["train", "executor=ray", "dataset=cifar10", f"data_root={tmp_path / 'nowhere'}", "model=mlp",
                 "iterations=2", "tensorboard=false", f"out_dir={tmp_path / 'runs'}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert not ray.is_initialized() and time.monotonic() - t0 < 30
    assert "lacks data_batch_1, data_batch_2" in err and "before starting them" in err


def test_the_chestxray_fixtures_pass_the_drivers_check(tmp_path):
    from chestxray_fixtures import write_chexpert, write_mimic, write_nih, write_padchest, write_vindr

    from fdam_ray.data.chestxray_readers import files_problem

    for name, write in (("chexpert", write_chexpert), ("nih", write_nih), ("padchest", write_padchest),
                        ("mimic", write_mimic), ("vindr", write_vindr)):
        root = write(tmp_path / name)
        assert files_problem(name, Path(root), official_test=True) is None, name


# -- a joined cluster too small for the actors ------------------------------------------------------------



def stop_head(head: subprocess.Popen, temp: str) -> None:
    """Stop a `ray start --block` head and what it started (by process group and by its temp folder)."""
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGTERM)  # --block stops the node's processes on SIGTERM
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for pid in pids_using(temp):  # what the head left, and only that
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if head.poll() is None:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # a `ray start` head of its own and a driver: about a minute here
def test_fdam_joining_a_2_cpu_ray_start_head_fails_within_30_s_saying_what_fits(tmp_path):
    """Someone ran `ray start --head` (2 CPUs): fdam joins it and, its 4 actors not fitting, says so at once,
    with the cpus_per_actor that fits and address=local, instead of waiting for nodes that never come."""
    temp = tempfile.mkdtemp(prefix="fdh", dir="/tmp")  # short: Ray's socket paths live under it
    home = Path(temp) / "home"
    (home / ".ray").mkdir(parents=True)
    token = Path.home() / ".ray" / "auth_token"
    if token.exists():
        (home / ".ray" / "auth_token").write_bytes(token.read_bytes())
    env = fdam_env(RAY_TMPDIR=temp, HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # it binds 127.0.0.1
    ports = ["--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port"]
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                             "--include-dashboard=false", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                             "--disable-usage-stats",
                             *(f"{p}={port}" for p, port in zip(ports, free_ports(len(ports)), strict=True))],
                            env=env, cwd=temp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    recorded = Path(temp) / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not (recorded.exists() and recorded.read_text().strip()):
            assert head.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        t0 = time.monotonic()
        small = [a for a in SMALL if not a.startswith("num_clients=")]  # a key is given once
        out = subprocess.run([FDAM, "train", "executor=ray", *small, "num_clients=4", "model=mlp",
                              f"out_dir={tmp_path}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        took = time.monotonic() - t0
        joined = subprocess.run([FDAM, "-v", "train", "executor=ray", *SMALL, "model=mymod:make",
                                 f"out_dir={tmp_path}/runs"], env=env, cwd=own_module_folder(tmp_path),
                                capture_output=True, text=True, timeout=300)
    finally:
        stop_head(head, temp)
    assert "joining the Ray cluster already running on this machine" in out.stderr, out.stderr[-3000:]
    assert out.returncode == 2 and took < 30 + 20, (took, out.stderr[-3000:])  # 20 s: starting Python and Ray
    line = out.stderr.splitlines()[-1]
    assert line.startswith("fdam: error: 4 actors need more than the cluster offers (CPU: 4 needed, 2 in the "
                           "cluster;"), line
    assert "(cpus_per_actor=0.5 fits)" in line and "address=local starts a private Ray" in line
    # what fits runs, with a model of the folder fdam runs in shipped to the cluster's workers
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert "shipping mymod.py of the current folder to the cluster" in joined.stderr
    assert "final test AUC" in joined.stdout


def test_a_joined_cluster_too_small_names_what_fits_and_the_private_ray(monkeypatch):
    """The same check in process, on a 4-CPU Ray taken as a joined cluster without an autoscaler (local=False)."""
    from raytest import ray_session

    from fdam_ray.config import build_config
    from fdam_ray.executors.ray import session
    from fdam_ray.executors.ray.placement import Placement

    config = build_config(dict(dataset="synthetic", model="mlp", num_clients=3, cpus_per_client=2.0))
    with ray_session():
        monkeypatch.setattr(session, "_joined_recorded", "127.0.0.1:6379")  # joined as `ray start` recorded it
        t0 = time.monotonic()
        with pytest.raises(ValueError) as refused:
            Placement(config, 600.0).place(3, local=False)
        assert time.monotonic() - t0 < 30
        monkeypatch.setattr(session, "_joined_recorded", None)  # joined by an address given
        with pytest.raises(ValueError) as given:
            Placement(config, 600.0).place(3, local=False)
    message = str(refused.value)
    assert message.startswith("3 actors need more than the cluster offers (CPU: 6 needed, 4 in the cluster;")
    assert "lower cpus_per_actor / gpus_per_actor (cpus_per_actor=1.33 fits)" in message
    assert message.endswith("address=local starts a private Ray sized for the run instead")
    assert "address=local" not in str(given.value) and "cpus_per_actor=1.33 fits" in str(given.value)
