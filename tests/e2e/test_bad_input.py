"""The bad-input catalogue (README, "Bad input"): what the user sees, and that nothing already written changes.

Every case runs `fdam train ...` in a folder that already holds an earlier run;
afterwards that run's files are byte-for-byte the same, the message is one
line on stderr without a traceback, and the exit code is 2. Cases that fail
before training starts leave no new run folder behind.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import chestxray_fixtures
import pytest
import torch

from fdam_ray.cli import main

FAST = ["executor=inline", "tensorboard=false"]


def chexpert(tmp: Path, edit=None) -> str:
    root = chestxray_fixtures.write_chexpert(tmp / "cx")
    if edit:
        edit(root)
    return f"chestxray_chexpert_root={root}"


def drop_column(root: Path) -> None:
    path = root / "train.csv"
    rows = list(csv.reader(path.open()))
    i = rows[0].index("Frontal/Lateral")
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([r[:i] + r[i + 1:] for r in rows])


def bad_label(root: Path) -> None:
    path = root / "train.csv"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace(",1.0,", ",2.0,", 1)
    path.write_text("\n".join(lines) + "\n")


def garbage_image(root: Path) -> None:
    for img in sorted((root / "train").rglob("*.jpg")):
        img.write_bytes(b"not a jpeg")


CXR = ["dataset=chestxray", "chestxray_sources=chexpert", "num_clients=1", "model=cnn", "image_size=16",
       "batch_size=4", "iterations=4"]


def small_run(tmp: Path) -> Path:
    assert main(["train", f"out_dir={tmp / 'runs'}", "run_name=old", "dataset=synthetic", "model=mlp",
                 "iterations=6", "local_steps=3", *FAST, "--quiet"]) == 0
    return tmp / "runs" / "old"


def truncate_checkpoint(run: Path) -> None:
    ck = run / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[:200])


# (id, args builder, message that must appear, fails before training starts)
CASES = [
    ("unknown key", lambda t: ["lern_rate=0.1"], "unknown config field 'lern_rate'; did you mean 'lr'?", True),
    ("wrong type", lambda t: ["local_steps=many"], "config field 'local_steps': 'many' is not allowed", True),
    ("key given twice", lambda t: ["seed=1", "seed=2"],
     "config field 'seed' is given twice on the command line (seed=1, seed=2): give it once", True),
    ("integer beyond 64 bits", lambda t: ["seed=18446744073709551616"],
     "config field 'seed': 18446744073709551616 is not allowed (an integer >= 0 and below 2**63)", True),
    ("lr not positive", lambda t: ["lr=0"], "config field 'lr': 0.0 is not allowed (> 0)", True),
    ("imratio out of range", lambda t: ["imratio=0.7"], "'imratio': 0.7 is not allowed (in (0, 0.5])", True),
    ("unknown algorithm", lambda t: ["algorithm=fedadam"], "'algorithm': 'fedadam' is not allowed (one of", True),
    ("preset conflict", lambda t: ["algorithm=npa", "local_steps=8"], "algorithm 'npa' requires local_steps = 1",
     True),
    ("impossible IH partition", lambda t: ["num_clients=6"], "num_clients=6 is more than the 5 positive classes",
     True),
    ("client without positives", lambda t: ["imratio=0.001"], "is left with no positives", True),
    ("more clients than memory holds", lambda t: ["dataset=synthetic", "model=mlp", "num_clients=1000000000"],
     "num_clients=1000000000 needs about 7.01e+04 GB of memory on this machine (a model replica of 0.0564 MB, "
     "0.0701 MB per client) but", True),
    ("dirichlet: more clients than positives", lambda t: ["partition=dirichlet", "num_clients=200"],
     "partition=dirichlet: num_clients=200 is more than the 70 positive and", True),
    ("schedule decays lr to nothing", lambda t: ["stage_length=60", "iterations=6000"],
     "runs 100 stages and decays lr to 5.8e-49, below 1e-15", True),
    ("model needs images", lambda t: ["dataset=synthetic", "model=resnet20"], "needs image inputs", True),
    ("config file not a mapping", lambda t: ["--config", str(_write(t / "c.yaml", "- lr\n- 0.1\n"))],
     "must hold a mapping of field: value", True),
    ("a key given twice", lambda t: ["--config", str(_write(t / "c.yaml", "lr: 0.1\nmodel: mlp\nlr: 0.2\n"))],
     "key 'lr' is given twice (again on line 3)", True),
    ("config file not UTF-8", lambda t: ["--config", str(_write_bytes(t / "c.yaml", b"lr: 0.1\nrun_name: \xff\n"))],
     "is not UTF-8 text", True),
    ("missing dataset folder", lambda t: ["dataset=cifar10", f"data_root={t / 'nowhere'}"],
     "lacks data_batch_1", True),
    ("missing weights file", lambda t: [f"model_weights={t / 'w.pt'}"], "is not a file (weights are read from a",
     True),
    ("CSV missing a column", lambda t: [*CXR, chexpert(t, drop_column)],
     "CheXpert labels file lacks column(s) ['Frontal/Lateral']", True),
    ("label outside 1, 0, -1, blank", lambda t: [*CXR, chexpert(t, bad_label)],
     "column 'Cardiomegaly': label '2.0' is not 1, 0, -1 (uncertain) or blank", True),
    ("unreadable image", lambda t: [*CXR, chexpert(t, garbage_image)], "cannot read image", False),
    ("run folder exists", lambda t: ["run_name=old"], "already exists and is not empty", True),
    ("resume with another config", lambda t: ["--resume", str(t / "runs" / "old"), "lr=0.5"],
     "cannot resume", True),
    ("resume a folder without checkpoint", lambda t: ["--resume", str(t)], "has no checkpoint.pt", True),
    ("truncated checkpoint", lambda t: (truncate_checkpoint(t / "runs" / "old"),
                                        ["--resume", str(t / "runs" / "old")])[1],
     "cannot be read (damaged, truncated or not an fdam-ray checkpoint)", True),
    ("checkpoint without a run state", lambda t: (strip_checkpoint(t / "runs" / "old"),
                                                  ["--resume", str(t / "runs" / "old")])[1],
     "is damaged: its 'loop' entry is missing or not a dict", True),
    ("checkpoint of a newer schema", lambda t: (newer_checkpoint(t / "runs" / "old"),
                                                ["--resume", str(t / "runs" / "old")])[1],
     "has schema version 2, which this fdam-ray does not read (it reads version 1): a newer fdam-ray wrote it", True),
]


def strip_checkpoint(run: Path) -> None:
    ck = run / "checkpoint.pt"
    raw = torch.load(ck, weights_only=True)
    del raw["payload"]["loop"]
    torch.save(raw, ck)


def newer_checkpoint(run: Path) -> None:
    ck = run / "checkpoint.pt"
    raw = torch.load(ck, weights_only=True)
    raw["format"] = "fdam-ray-checkpoint/2"
    torch.save(raw, ck)


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def space_file(tmp: Path, text: str | None = None) -> str:
    body = text if text is not None else (
        "base: {dataset: synthetic, model: mlp, iterations: 4, executor: inline}\n"
        "search: {lr: {grid: [0.1, 0.01]}}\n")
    return str(_write(tmp / "space.yaml", body + f"tune: {{storage_path: '{tmp / 'sweeps'}', name: s}}\n"))


def damage_sweep(tmp: Path) -> str:
    sweep = tmp / "sweeps" / "s"
    sweep.mkdir(parents=True)
    _write(sweep / "fdam_space.yaml", "base: [1, 2\n")
    return str(sweep)


def copy_run(tmp: Path, edit) -> str:
    import shutil

    run = tmp / "copy"
    shutil.copytree(tmp / "runs" / "old", run)
    edit(run)
    return str(run)


# Other commands: (id, argv builder, message); each fails before it writes anything.
OTHER_CASES = [
    ("tune: a tune option that is not a number", lambda t: ["tune", space_file(t), "tune.reduction_factor=abc"],
     "tune option 'reduction_factor': 'abc' is not allowed (a number > 1)"),
    ("tune: ASHA grace period not a number",
     lambda t: ["tune", space_file(t), "tune.scheduler=asha", "tune.grace_period=abc"],
     "tune option 'grace_period': 'abc' is not allowed (an integer >= 1 or null)"),
    ("tune: a space section that is a list", lambda t: ["tune", space_file(t, "base: [lr, 0.1]\n")],
     "section 'base' must be a mapping of name: value, not list"),
    ("tune: range bounds that are not numbers",
     lambda t: ["tune", space_file(t, "search: {lr: {uniform: [low, high]}}\n"), "tune.searcher=random"],
     "search field 'lr': uniform needs [low, high] (two numbers), got ['low', 'high']"),
    ("tune: resuming a damaged sweep folder", lambda t: ["tune", "--resume", damage_sweep(t)],
     "fdam_space.yaml' is not valid YAML"),
    ("tune: resuming from a bucket without --trust-storage", lambda t: ["tune", "--resume", "s3://lab/sweeps/s1"],
     "--resume: 's3://lab/sweeps/s1' is remote storage; resuming unpickles the sweep's state"),
    ("plot: a damaged config.yaml", lambda t: ["plot", copy_run(t, lambda r: _write(r / "config.yaml", "lr: [0.1\n")),
                                               "--out", str(t / "fig")],
     "config.yaml' is not valid YAML"),
    ("plot: a damaged metrics.jsonl",
     lambda t: ["plot", copy_run(t, lambda r: _write(r / "metrics.jsonl", (r / "metrics.jsonl").read_text()[:-30])),
                "--out", str(t / "fig")],
     "metrics.jsonl', line 2 is not a JSON record"),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_error(argv: list[str], message: str, capsys) -> None:
    """``fdam`` exits 2 with ``message`` in one line on stderr and no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("name,args,message,early", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, args, message, early, tmp_path, capsys):
    old = small_run(tmp_path)
    built = args(tmp_path)
    before = snapshot(old)  # after the case has set itself up (a truncated checkpoint stays as it is)
    capsys.readouterr()
    argv = ["train", *built] if built[:1] == ["--resume"] else ["train", f"out_dir={tmp_path / 'runs'}", *built,
                                                                  *FAST]
    assert_one_line_error(argv, message, capsys)
    assert snapshot(old) == before
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    if early:
        assert runs == ["old"]


@pytest.mark.parametrize("name,args,message", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_bad_input_of_tune_and_plot(name, args, message, tmp_path, capsys):
    old = small_run(tmp_path)
    before = snapshot(old)
    argv = args(tmp_path)
    present = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    capsys.readouterr()
    assert_one_line_error(argv, message, capsys)
    assert snapshot(old) == before
    assert {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} == present  # no sweep folder, no figure


def test_readme_lists_every_case():
    readme = (Path(__file__).parents[2] / "docs/how-to/bad-input.md").read_text()
    table = readme[readme.index("# Bad input"):]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) - 2 >= 15
    for name, _, message, *_ in CASES + OTHER_CASES:
        assert re.search(re.escape(message.replace("|", "\\|")), table), f"README lacks {name!r}: {message}"
