"""The pages' output blocks: a ``text`` block right after a command block (nothing between them, or a sentence
ending in a colon that introduces it) shows what that block prints. Each is checked against a run of the block made
here: ``fdam train`` commands shortened as tests/project/test_readme.py shortens them (a few rounds, clients in this
process), an example script with the arguments shown, a Python block as it is. Every line shown must have the shape
of a line the run printed: numbers, paths and the executor's name are left free (the run differs from the reader's
in exactly those), and ``...`` stands for lines left out. A block shown with a command that logs a warning on its
full config shows the warning, so no command of a page warns unexplained. One run per command, whichever pages show
it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import logging
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?")


def load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


DOCS = load_by_path("docs_blocks_for_outputs", ROOT / "tests/project/test_docs.py")


def output_pairs() -> list[tuple]:
    """(command block, output block) for every output block of the pages."""
    pairs = []
    for page in DOCS.pages():
        lines = page.read_text(encoding="utf-8").split("\n")
        blocks = DOCS.blocks_of(page)
        for before, block in itertools.pairwise(blocks):
            if block.lang != "text" or block.fragment:
                continue
            closing = before.line + len(before.text.split("\n"))  # the 0-based index of its closing fence
            between = lines[closing + 1 : block.line - 1]
            said = [s for s in between if s.strip()]  # nothing, or a sentence that introduces the output: ...:
            follows = not said or said[-1].rstrip().endswith(":")
            assert before.lang in ("bash", "python") and not before.fragment and follows, (
                f"{block.page}:{block.line}: a text block that does not follow a command block (mark it *Excerpt*)")
            pairs.append((before, block))
    return pairs


PAIRS = output_pairs()


def shape(line: str) -> str:
    """A line with what a shortened run changes left free: paths (their last part kept), the executor, numbers."""
    line = re.sub(r"\S*/(\S+)", r".../\1", line)
    line = re.sub(r"executor \w+", "executor *", line)
    return " ".join(NUMBER.sub("#", line).split())


def test_the_tutorials_show_what_their_commands_print():
    shown = {b.page for _, b in PAIRS}
    assert {"docs/getting-started.md", "docs/tutorials/first-federation.md", "docs/tutorials/own-loop.md",
            "docs/how-to/resume.md"} <= shown, shown
    assert shape("iter   100  round 10  lr 0.03333  loss -0.0366  [10.3 s]") == "iter # round # lr # loss # [# s]"
    assert shape("run folder: runs/20261202-102500-codasca-digits") == shape("run folder: /t/runs/2-1-codasca-digits")
    assert shape("loss         -") != shape("loss -0.1")  # the dash of no loss yet is not a number


def last_command(block) -> str:
    return DOCS.commands_of(block)[-1]


def run_fdam(command: str, folder: Path) -> str:
    """The command's stdout, run shortened: two evaluations a few rounds apart, clients in this process."""
    from fdam_ray.cli import main
    from fdam_ray.config import build_config, parse_overrides

    overrides = [w for w in shlex.split(command)[2:] if "=" in w and not w.startswith("-")]
    config = build_config(parse_overrides(overrides))
    short = [f"iterations={config.local_steps * 2}", f"eval_every={config.local_steps}", "executor=inline",
             f"out_dir={folder / 'runs'}", "tensorboard=false"]
    kept = [w for w in overrides if w.split("=", 1)[0] not in {s.split("=", 1)[0] for s in short}]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", *kept, *short, "--no-progress"]) == 0
    return out.getvalue()


def run_example(command: str) -> str:
    words = shlex.split(command)
    module = load_by_path(f"example_{Path(words[1]).stem}_for_outputs", ROOT / words[1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(words[2:]) == 0
    return out.getvalue()


def run_python(block) -> str:
    import torch

    torch.manual_seed(0)  # as tests/loop/test_optim_choice.py runs the own-loop block
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.text, block.page, "exec"), {"__name__": "doc_block"})
    return out.getvalue()


RUNS: dict[str, str] = {}


def produced(block, folder: Path) -> str:
    key = block.text if block.lang == "python" else last_command(block)
    if key not in RUNS:
        cwd, columns = os.getcwd(), os.environ.pop("COLUMNS", None)  # output to a pipe: lines not fitted to a width
        os.chdir(folder)  # a block's relative run folders land here
        try:
            if block.lang == "python":
                RUNS[key] = run_python(block)
            elif key.startswith("fdam train"):
                RUNS[key] = run_fdam(key, folder)
            elif key.startswith("python examples/"):
                RUNS[key] = run_example(key)
            else:
                pytest.fail(f"{block.page}:{block.line}: no runner for the output of {key}")
        finally:
            os.chdir(cwd)
            if columns is not None:
                os.environ["COLUMNS"] = columns
    return RUNS[key]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[1].page}:{p[1].line}")
def test_each_line_shown_is_a_line_the_command_prints(pair, tmp_path):
    command, output = pair
    printed = {shape(line) for line in produced(command, tmp_path).splitlines()}
    shown = [line for line in output.text.splitlines() if line.strip() and line.strip() != "..."]
    assert shown, f"{output.page}:{output.line}: an empty output block"
    missing = [line for line in shown if shape(line) not in printed]
    assert not missing, (f"{output.page}:{output.line}: lines shown that the command does not print: {missing}; "
                         f"it printed: {sorted(printed)}")


@pytest.mark.parametrize("pair", [p for p in PAIRS if p[0].lang == "bash" and last_command(p[0]).startswith(
    "fdam train")], ids=lambda p: f"{p[1].page}:{p[1].line}")
def test_a_command_shown_with_its_output_warns_only_where_the_page_shows_it(pair):
    """The schedule's warnings of the command's full config (not the shortened run's), e.g. a stage_length that is
    not a multiple of local_steps, appear in the block or are not logged."""
    from fdam_ray.config import build_config, parse_overrides
    from fdam_ray.core.schedules import Schedule

    command, output = pair
    config = build_config(parse_overrides([w for w in shlex.split(last_command(command))[2:] if "=" in w]))
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("fdam_ray.core.schedules")
    logger.addHandler(handler)
    try:
        Schedule(config)
        Schedule(config.replace(local_steps=64))  # the check itself: a stage_length=1000 run at I = 64 warns
    finally:
        logger.removeHandler(handler)
    assert logged and "not a multiple of local_steps=64" in logged[-1]
    shown = {shape(line) for line in output.text.splitlines()}
    assert all(shape(m) in shown for m in logged[:-1]), (logged[:-1], output.page)


def test_the_resume_pages_block_and_the_message_without_its_source(tmp_path, monkeypatch):
    """The resume guide's block resumes a train_arrays run with its source; without it, the one line names the
    source to give (not train_arrays alone, which would start another run)."""
    import fdam_ray
    from fdam_ray.config import build_config
    from fdam_ray.data import make_source

    (block,) = [b for b in DOCS.RUN if b.page == "docs/how-to/resume.md" and b.lang == "python"]
    monkeypatch.chdir(tmp_path)
    space: dict = {"__name__": "doc_block"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.text, block.page, "exec"), space)
    assert space["longer"].summary["iterations"] == 80 and space["longer"].run_dir == space["first"].run_dir
    with pytest.raises(ValueError) as refused:
        fdam_ray.resume(space["first"].run_dir, {"iterations": 120})
    assert "fdam_ray.resume(run_dir, source=fdam_ray.data.arrays.ArraysSource(clients, test, client_tests))" in str(
        refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"source=fdam_ray\.data\.datasets\.DatasetsSource\(clients, test, "):
        make_source(build_config(dataset="datasets"))
