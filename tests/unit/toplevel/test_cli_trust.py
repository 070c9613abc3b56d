"""``fdam train`` reads and checks its command line and config file before torch is imported (tens of seconds
on a loaded machine): a config error comes back in a second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN = """
import sys
from fdam_ray.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:  # --version, --help
    rc = exc.code
print(f"rc={rc} torch={'torch' in sys.modules} ray={'ray' in sys.modules}", file=sys.stderr)
"""


def fdam(*args: str, cwd) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's fdam_ray, whatever the working folder
    got = subprocess.run([sys.executable, "-c", RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                         env=env)
    return got.returncode, got.stderr.strip().splitlines()


@pytest.mark.parametrize(("args", "said"), [
    (["train", "--config", "missing.yaml"], "fdam: error: config file 'missing.yaml' does not exist"),
    (["train", "--config", "list.yaml"], "fdam: error: config file 'list.yaml' must hold a mapping of field: value, "
                                         "not list"),
    (["train", "--config", "broken.yaml"], "fdam: error: config file 'broken.yaml' "),
    (["train", "lr"], "fdam: error: override 'lr' is not of the form key=value"),
    (["train", "=0.1"], "fdam: error: override '=0.1' is not of the form key=value"),
])
def test_a_config_error_of_form_is_one_line_before_torch_is_imported(tmp_path, args, said):
    (tmp_path / "list.yaml").write_text("- lr: 0.1\n")
    (tmp_path / "broken.yaml").write_text("lr: [0.1\n")
    rc, lines = fdam(*args, cwd=tmp_path)
    assert rc == 0 and len(lines) == 2 and lines[0].startswith(said), lines  # the command's rc is printed
    assert lines[1] == "rc=2 torch=False ray=False", lines


def test_fdam_version_imports_neither_torch_nor_ray(tmp_path):
    rc, lines = fdam("--version", cwd=tmp_path)
    assert rc == 0 and lines == ["rc=0 torch=False ray=False"], lines
