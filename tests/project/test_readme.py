"""Every `fdam` command the README and the documentation site (docs/) show: each one's fields are valid, and each
one that can run on this machine (built-in data, no cluster, no files of the reader's) runs, shortened, to its
summary."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fdam_ray.cli import build_parser, main
from fdam_ray.config import build_config, load_config_file, parse_overrides
from fdam_ray.tuning import load_space
from fdam_ray.tuning.space import example_names

ROOT = Path(__file__).resolve().parents[2]
LOCAL_DATA = ("digits", "synthetic")


def pages() -> list[Path]:
    """The README and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_commands() -> list[str]:
    """The `fdam ...` commands of the pages' bash blocks and of their prose (inline code with a key=value, not a
    synopsis with [...] or <...>; the bad-input table's rows fail on purpose and are tested elsewhere), one
    string each, comments dropped, continuation lines joined, a leading `VAR=value` or `ray job submit ... --`
    left out."""
    text = "\n".join(page.read_text() for page in pages())
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    prose = "\n".join(line for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines()
                      if not line.startswith("|"))
    lines += [c for c in re.findall(r"`(fdam [^`]+)`", prose.replace("\n", " "))
              if "=" in c and not re.search(r"[\[<]", c)]
    commands = []
    for line in lines:
        for part in line.split("#")[0].split("&&"):
            words = shlex.split(part)
            if "--" in words:  # ray job submit ... -- fdam ...
                words = words[words.index("--") + 1 :]
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # RAY_ADDRESS=... fdam train
                words = words[1:]
            if words and words[0] == "fdam":
                command = " ".join(words)
                if command not in commands:
                    commands.append(command)
    return commands


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands_this_test_reads():
    assert len(pages()) > 20  # the site's pages are read too
    assert "fdam train" in COMMANDS and "fdam fields ray" in COMMANDS
    assert "fdam train --address 10.0.0.5:6379 dataset=synthetic model=mlp num_clients=16" in COMMANDS
    assert any(c.startswith("fdam train dataset=cifar100 data_root=/data/cifar100") for c in COMMANDS)
    assert any(c.startswith("fdam tune small") for c in COMMANDS)


def placeholder(path: str) -> bool:
    """A path the reader supplies (my_run.yaml, runs/2026..., SPACE.yaml), not one of this checkout."""
    return not (ROOT / path).exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if command == "fdam --version":
        with pytest.raises(SystemExit) as stop:
            main(["--version"])
        assert stop.value.code == 0 and capsys.readouterr().out.startswith("fdam ")
        return
    args = build_parser().parse_known_args(shlex.split(command)[1:])[0]
    overrides = [w for w in shlex.split(command)[2:] if "=" in w and not w.startswith("-")]
    if args.command == "fields":
        assert main(["fields", *args.terms]) == 0
        assert capsys.readouterr().out.strip()
    elif args.command == "tune":
        if args.space in example_names():  # an example space shipped inside the package, by its name
            load_space(args.space, parse_overrides(overrides))
        elif args.space and not placeholder(args.space):
            load_space(str(ROOT / args.space), parse_overrides(overrides))  # the space and options are valid
        else:
            assert args.space in (None, "SPACE.yaml", "space.yaml") or args.resume, command
    elif args.command == "plot":
        assert all(placeholder(r) for r in args.runs)  # the reader's run folders
    elif args.command == "train":
        values = {}
        if args.config and not placeholder(args.config):
            values = load_config_file(str(ROOT / args.config))
        values.update(parse_overrides(overrides))
        config = build_config(values)  # every field and value is valid
        if args.resume or args.config or config.dataset not in LOCAL_DATA or config.trackers:
            return  # a run folder, a config file or data the reader has; trackers run in tests/outputs/test_trackers.py
        # Run here, shortened: no cluster (--address / RAY_ADDRESS drop out), clients in this process.
        short = [f"iterations={config.local_steps * 2}", f"eval_every={config.local_steps}", "executor=inline",
                 f"out_dir={tmp_path / 'runs'}", "tensorboard=false", "--quiet"]
        kept = [w for w in overrides if w.split("=", 1)[0] not in {s.split("=", 1)[0] for s in short}]  # once each
        assert main(["train", *kept, *short]) == 0, capsys.readouterr().err
        assert "final test AUC" in capsys.readouterr().out
    else:
        pytest.fail(f"a README command this test does not know: {command}")
