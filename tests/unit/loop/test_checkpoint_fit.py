"""A checkpoint entry of the wrong size or kind is 'checkpoint ... is damaged' naming the entry, rc 2, before a
round runs (fdam_ray.checkpoint.check_fits, called where a run resumes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fdam_ray.cli import main

OLD_CHECKPOINT = Path(__file__).parents[2] / "fixtures" / "checkpoint_v1.pt"


def _folder(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "old"
    folder.mkdir()
    data = torch.load(OLD_CHECKPOINT, weights_only=True)
    edit(data["payload"])
    torch.save(data, folder / "checkpoint.pt")
    return folder


def _shorter(where: dict, key: str) -> None:  # arrays are stored as {"__ndarray__": tensor}
    where[key] = {"__ndarray__": where[key]["__ndarray__"][:-3]}


def _as(where: dict, key: str, dtype: torch.dtype) -> None:
    where[key] = {"__ndarray__": where[key]["__ndarray__"].to(dtype)}


@pytest.mark.parametrize("edit, entry", [
    (lambda p: _shorter(p["loop"]["state"], "v"), "v"),
    (lambda p: _shorter(p["loop"], "reference"), "reference"),
    (lambda p: _as(p["loop"]["state"], "v", torch.float64), "v"),
    (lambda p: _as(p["loop"]["state"], "alpha", torch.int64), "alpha"),
    (lambda p: _as(p["loop"]["state"], "c_v", torch.float16), "c_v"),
    (lambda p: _shorter(p["clients"][1], "c_v"), "c_v"),
    (lambda p: _as(p["clients"][1], "c_v", torch.complex64), "c_v"),
])
def test_an_entry_of_the_wrong_size_or_kind_is_one_line_naming_it(tmp_path, capsys, edit, entry):
    folder = _folder(tmp_path, edit)
    before = sorted(p.name for p in folder.iterdir())
    assert main(["train", "--resume", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint '{folder / 'checkpoint.pt'}' is damaged" in err and f"'{entry}'" in err, err
    assert sorted(p.name for p in folder.iterdir()) == before
