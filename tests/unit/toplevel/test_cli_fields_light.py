"""``fdam train`` checks every key's name, and refuses a key given twice on its command line, before torch is
imported (a field error in a second, not after 4-14 s of imports); the message is the one ``build_config`` gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, parse_overrides

ROOT = Path(__file__).resolve().parents[3]
RUN = """
import sys
from fdam_ray.cli import main
rc = main(sys.argv[1:])
print(f"rc={rc} torch={'torch' in sys.modules}", file=sys.stderr)
"""


def fdam(*args: str, cwd) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's fdam_ray, wherever the command runs
    got = subprocess.run([sys.executable, "-c", RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                         env=env)
    assert got.returncode == 0, got.stderr
    return got.stderr.strip().splitlines()


def heavy_message(values: dict) -> str:
    with pytest.raises(ConfigError) as got:
        build_config(values)
    return str(got.value)


@pytest.mark.parametrize("overrides", [["bogus_field=1"], ["k=4"], ["model.bogus=1"], ["lr=0.1", "bachsize=3"],
                                       ["model.width=8", "model.name.x=1"], ["dp.mode=client"]])
def test_an_unknown_key_is_the_config_message_before_torch(tmp_path, overrides):
    said = heavy_message(parse_overrides(overrides))
    assert fdam("train", *overrides, cwd=tmp_path) == [f"fdam: error: {said}", "rc=2 torch=False"]


def test_an_unknown_key_in_the_config_file_is_refused_before_torch(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 0.1\nmodel:\n  name: mlp\n  bogus: 1\n")
    said = heavy_message({"lr": 0.1, "model": {"name": "mlp", "bogus": 1}})
    assert fdam("train", "--config", "c.yaml", cwd=tmp_path) == [f"fdam: error: {said}", "rc=2 torch=False"]


@pytest.mark.parametrize("overrides, field", [(["seed=1", "seed=2"], "seed"),
                                              (["model.weights=a.pt", "lr=1", "model_weights=b.pt"], "model_weights"),
                                              (["model=mlp", "model.name=cnn"], "model")])
def test_a_key_given_twice_on_the_command_line_is_refused_before_torch(tmp_path, overrides, field):
    lines = fdam("train", *overrides, cwd=tmp_path)
    assert lines[1] == "rc=2 torch=False", lines
    assert lines[0].startswith(f"fdam: error: config field '{field}' is given twice on the command line"), lines


@pytest.mark.parametrize("value", [2**64, 2**63, -(2**63) - 1])
def test_an_integer_beyond_64_bits_is_refused_naming_the_field(value, capsys):
    with pytest.raises(ConfigError, match=rf"^config field 'seed': {value} is not allowed \(.*2\*\*63.*\)$"):
        build_config(seed=value)
    assert main(["train", f"seed={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fdam: error: config field 'seed': {value} is not allowed") and err.count("\n") == 1


def test_the_privacy_seed_keeps_128_bits_of_entropy():
    base = {"algorithm": "coda_plus", "dp": "client", "model": "mlp", "dp_noise_multiplier": 1.0}
    assert build_config({**base, "dp_noise_seed": 2**128 - 1}).dp_noise_seed == 2**128 - 1
    with pytest.raises(ConfigError, match=r"^config field 'dp_noise_seed': \d+ is not allowed \(an integer >= 0 and "
                                          r"below 2\*\*128\)$"):
        build_config({**base, "dp_noise_seed": 2**128})
