"""The `fdam` command: the default job end to end, outputs, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, parse_overrides


def test_default_job_reaches_a_band_an_untrained_model_cannot(tmp_path, capsys):
    # The default job (digits-IH, K=4, CODASCA, cnn) with fewer iterations.
    rc = main(["train", f"out_dir={tmp_path}", "run_name=r", "iterations=300", "eval_every=100", "executor=inline"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "test AUC" in out and "run folder:" in out
    run = tmp_path / "r"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["iteration"] == 0 and records[-1]["iteration"] == 300
    assert records[0]["test_auc"] < 0.75  # untrained
    assert records[-1]["test_auc"] > 0.95
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_test_auc"] == records[-1]["test_auc"]
    assert summary["rounds"] == 30 and summary["bytes_up"] > 0
    saved = torch.load(run / "model.pt", weights_only=True)
    assert set(saved) >= {"model", "a", "b", "alpha"}
    assert any("running_mean" in k for k in saved["model"])
    cfg = (run / "config.yaml").read_text()
    assert "algorithm: codasca" in cfg and "num_clients: 4" in cfg


def test_config_file_and_overrides(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("algorithm: coda_plus\nmodel: mlp\nlocal_steps: 5\niterations: 20\neval_every: 10\n")
    assert main(["train", "--config", str(conf), f"out_dir={tmp_path}", "run_name=x", "local_steps=4",
                 "executor=inline"]) == 0
    saved = (tmp_path / "x" / "config.yaml").read_text()
    assert "algorithm: coda_plus" in saved and "local_steps: 4" in saved and "model: mlp" in saved


BAD = [
    (["foo=1"], "unknown config field 'foo'"),
    (["lr=0"], "config field 'lr': 0.0 is not allowed (> 0)"),
    (["lr=-0.1"], "'lr': -0.1"),
    (["local_steps=0"], "config field 'local_steps': 0 is not allowed (>= 1)"),
    (["imratio=0.6"], "config field 'imratio': 0.6 is not allowed (in (0, 0.5])"),
    (["imratio=0"], "'imratio': 0.0"),
    (["num_clients=6"], "num_clients=6 is more than the 5 positive classes"),
    (["imratio=0.001"], "is left with no positives"),
    (["algorithm=codasc"], "did you mean 'codasca'"),
    (["model=vgg"], "config field 'model': 'vgg' is not allowed"),
    (["dataset=imagenet"], "config field 'dataset': 'imagenet' is not allowed"),
    (["lr=fast"], "config field 'lr': 'fast' is not allowed (a number"),
    (["local_steps=2.5"], "'local_steps': 2.5 is not allowed (an integer"),
    (["algorithm=fedavg", "objective=auc_square"], "algorithm 'fedavg' takes one of bce"),
    (["algorithm=npa", "local_steps=4"], "algorithm 'npa' requires local_steps = 1"),
    (["model=resnet20", "dataset=synthetic"], "needs image inputs"),
    (["lr"], "not of the form key=value"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(args, message, tmp_path, capsys):
    out_dir = tmp_path / "runs"
    rc = main(["train", f"out_dir={out_dir}", "executor=inline", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out_dir.exists()


def test_missing_config_file_is_reported(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_existing_run_folder_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "keep.txt").write_text("x")
    assert main(["train", f"out_dir={tmp_path}", "run_name=r", "iterations=2", "executor=inline"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "r" / "keep.txt").read_text() == "x"


def test_build_config_applies_preset_defaults_and_user_values():
    assert build_config(algorithm="fedavg").objective == "bce"
    assert build_config(algorithm="fedavg").prox_weight == 0.0
    assert build_config(algorithm="fedavg", prox_weight=0.1).prox_weight == 0.1
    assert build_config(algorithm="centralized").num_clients == 1
    assert build_config(batch_size="full").batch_size == 0
    with pytest.raises(ConfigError, match="centralized' requires num_clients = 1"):
        build_config(algorithm="centralized", num_clients=3)
    cfg = build_config(lr=0.5)
    assert build_config(cfg.to_dict()) == cfg  # a saved config reloads to the same config


def test_console_script_fields_lists_every_name():
    out = subprocess.run([sys.executable, "-m", "fdam_ray", "fields"], capture_output=True, text=True, check=True)
    for name in ("local_steps", "global_lr", "prox_weight", "stage_length", "lr_decay", "num_clients", "imratio"):
        assert name in out.stdout


def test_scientific_notation_is_a_number_on_the_command_line_and_in_yaml(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("lr: 1e-3\nglobal_lr: 1E0\niterations: 6e0\nmodel: {name: mlp}\n")
    assert main(["train", "--config", str(conf), f"out_dir={tmp_path}", "run_name=a", "dataset=synthetic",
                 "local_steps=3", "executor=inline", "tensorboard=false", "--quiet"]) == 0
    saved = (tmp_path / "a" / "config.yaml").read_text()
    assert "lr: 0.001" in saved and "iterations: 6" in saved
    assert build_config(parse_overrides(["lr=5e-2", "prox_weight=+2.5E-3", "iterations=1e3"])).lr == 0.05
    assert build_config(parse_overrides(["prox_weight=+2.5E-3"])).prox_weight == 0.0025
    assert build_config(parse_overrides(["iterations=1e3"])).iterations == 1000
    assert build_config(parse_overrides(["run_name=1e3"])).run_name == "1e3"  # text fields stay text


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("lr: 0.1\nmodel: mlp\nlr: 0.2\n")
    assert main(["train", "--config", str(conf), f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert f"config file '{conf}': key 'lr' is given twice (again on line 3)" in err
    assert err.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_a_misspelt_field_gets_the_nearest_name():
    with pytest.raises(ConfigError, match="unknown config field 'lern_rate'; did you mean 'lr'"):
        build_config(parse_overrides(["lern_rate=0.1"]))


def test_version_prints_the_packages_version(capsys):
    import fdam_ray

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"fdam {fdam_ray.__version__}\n"


def test_fields_filters_by_section_or_word(capsys):
    from fdam_ray.config import FIELDS, SECTION_CLASSES, SECTIONS
    from fdam_ray.executors.ray_section import RaySection

    def listed(*terms):
        assert main(["fields", *terms]) == 0
        return [line.split()[0] for line in capsys.readouterr().out.splitlines()]

    everything = listed()
    flower = [n for n in everything if n.startswith("flower.")]  # the consortium's section, listed last
    assert flower == listed("flower") and "flower.site_keys" in flower and "flower.connect_timeout_s" in flower
    everything = everything[:len(everything) - len(flower)]
    assert everything == [f.name for f in FIELDS]
    assert listed("ray") == ["address", "cpus_per_actor", "gpus_per_actor", "placement_strategy", "client_resources",
                             "reduce", "transport", "collective_rounds", "collective_backend", "channel_wait",
                             "placement_timeout_s",
                             "gpu_memory_cap", "fold_order", "ray_timeout_s"]
    assert set(listed("ray")) < {f.name for f in dataclasses.fields(RaySection)}  # its own fields, not shared ones
    assert listed("RAY") == listed("ray")
    assert listed("schedule") == list(SECTIONS["schedule"])
    # a section of `fdam fields` is a section class: every field in exactly one, in the class's order
    assert list(SECTIONS) == [cls.name for cls in SECTION_CLASSES]
    assert [name for cls in SECTION_CLASSES for name in listed(cls.name)] == everything
    assert listed("precision") == ["precision", "channels_last", "deterministic"]
    assert listed("executor") == ["executor", "device", "clients_per_actor", "threads_per_actor", "eval_on",
                                  "on_client_failure", "max_client_retries"]
    gpu = listed("gpu")  # a word: in the name, or starting a word of the meaning
    assert {"gpus_per_actor", "gpu_memory_cap", "device", "deterministic"} <= set(gpu) and "lr" not in gpu
    # several terms: each selects
    assert listed("ray", "gpu") == ["gpus_per_actor", "transport", "collective_backend", "gpu_memory_cap"]
    assert all(name in everything for names in SECTIONS.values() for name in names)  # no stale section entry
    assert main(["fields", "nothing-like-this"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fdam: error: no config field matches 'nothing-like-this'; give a section (algorithm, ")
    assert err.count("\n") == 1
