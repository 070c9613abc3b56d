"""The README and the documentation site (docs/): every fenced code block is run by a test or marked as a fragment,
the references are generated from the code, and the site builds with ``mkdocs build --strict``.

A block is a fragment when the line before its fence is a visible mark, a line in italics that begins with
``Excerpt`` (``*Excerpt: ...*``: a block with names the reader fills in, or one shown for reading). A ``text`` block
right after a run block is that block's output, checked in tests/project/test_doc_outputs.py. Any other block is
claimed here: its ``fdam`` commands run in tests/project/test_readme.py, its example scripts
in the tests that run them with the same arguments, its set-up commands are the ones .ci/run runs, its YAML is
loaded as a config or a search space, and its Python runs (the README's) or is run by the test named for its page.
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fdam_ray.config import FIELDS, SECTIONS, build_config, load_config_file
from fdam_ray.tuning import load_space

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = re.compile(r"^\*Excerpt\b[^*]*\*$")  # the visible mark of a fragment
# Python blocks of a page that a test elsewhere runs: the page, and the test that reads it and runs its block.
PYTHON_RUN_ELSEWHERE = {"docs/tutorials/own-loop.md": "tests/loop/test_optim_choice.py",
                        "docs/how-to/resume.md": "tests/project/test_doc_outputs.py"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    fragment: bool


def load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"```(\w*)\s*$", lines[i])
        if opening:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            fragment = i > 0 and bool(FRAGMENT.match(lines[i - 1].strip()))
            found.append(Block(str(path.relative_to(ROOT)), i + 1, opening.group(1), "\n".join(lines[i + 1 : end]),
                               fragment))
            i = end
        i += 1
    return found


BLOCKS = [b for page in pages() for b in blocks_of(page)]
RUN = [b for b in BLOCKS if not b.fragment and b.lang != "text"]  # text blocks: outputs (test_doc_outputs.py)


def commands_of(block: Block) -> list[str]:
    """A bash block's commands: continuation lines joined, comments dropped, `a && b` split."""
    joined = block.text.replace("\\\n", " ")
    return [part.strip() for line in joined.splitlines() for part in line.split("#")[0].split("&&") if part.strip()]


def ci_lines() -> list[str]:
    return (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_pages_have_blocks_and_each_is_a_fragment_or_a_known_kind():
    assert len(pages()) > 20 and len(RUN) > 20
    assert {b.lang for b in RUN} <= {"bash", "python", "yaml"}, {(b.page, b.line, b.lang) for b in RUN}
    assert not any("<!-- fragment -->" in page.read_text() for page in pages())  # the old, invisible mark


def example_run_by_a_test(script: str, args: list[str]) -> bool:
    """Some test runs examples/<script> with these arguments first (perhaps more after them, for its folders)."""
    name = Path(script).stem
    listed = ", ".join(f'"{a}"' for a in args)
    forms = ("[" + listed, f'{name}.py"), ' + listed)  # main([...]), or [python, ".../<name>.py"), ...]
    return any(name in text and any(form in text for form in forms)
               for text in (p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("test_*.py")))


@pytest.mark.parametrize("block", [b for b in RUN if b.lang == "bash"], ids=lambda b: f"{b.page}:{b.line}")
def test_every_bash_command_is_one_a_test_runs(block):
    readme_tests = load_by_path("readme_commands_of_the_pages", ROOT / "tests/project/test_readme.py")
    fdam_commands = readme_tests.readme_commands()
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    extras = parser["options.extras_require"]
    for command in commands_of(block):
        words = shlex.split(command)
        if "--" in words:  # ray job submit ... -- fdam ...
            words = words[words.index("--") + 1 :]
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[0] == "fdam":  # run, shortened, or its fields checked, by tests/project/test_readme.py
            assert " ".join(words) in fdam_commands, command
        elif len(words) > 1 and words[0] == "python" and words[1].startswith("examples/"):
            assert example_run_by_a_test(words[1], words[2:]), f"no test runs {command}"
        elif command == 'pip install -e ".[dev]"':  # the README's set-up command: .ci/run installs exactly this
            assert 'pip install --quiet -e ".[dev]"' in ci_lines()
        elif re.fullmatch(r'pip install -e "\.\[(\w+)\]"', command):
            extra = re.search(r"\[(\w+)\]", command).group(1)
            assert extra in extras, f"setup.cfg has no extra {extra!r}"
        elif command == "pytest":  # .ci/run runs the default tests in two layers, together `pytest`
            assert {"pytest tests/unit", "pytest --ignore=tests/unit --durations=15"} <= {
                line.split("#")[0].strip() for line in ci_lines()}
        elif command == "python -m build":
            assert '"-m", "build"' in (ROOT / "tests/project/test_wheel.py").read_text()
        elif command == 'mkdocs build --strict --site-dir "$(mktemp -d)"':  # .ci/run and test_the_site_builds
            assert command in [line.split("  #")[0].strip() for line in ci_lines()]
        elif command == "mkdocs serve":
            from mkdocs.__main__ import cli

            assert "serve" in cli.commands and (ROOT / "mkdocs.yml").is_file()
        else:
            pytest.fail(f"{block.page}:{block.line}: a command no test runs: {command}")


@pytest.mark.parametrize("block", [b for b in RUN if b.lang == "yaml"], ids=lambda b: f"{b.page}:{b.line}")
def test_every_yaml_block_is_a_valid_config_or_search_space(block, tmp_path):
    file = tmp_path / "block.yaml"
    file.write_text(block.text)
    if re.search(r"^base:", block.text, re.M):
        space = load_space(str(file))
        assert space.search, block.page
    else:
        build_config(load_config_file(str(file)))


def test_python_blocks_run_here_or_in_the_test_named_for_their_page():
    python = [b for b in RUN if b.lang == "python"]
    assert {b.page for b in python} == {"README.md", *PYTHON_RUN_ELSEWHERE}, [(b.page, b.line) for b in python]
    for page, test in PYTHON_RUN_ELSEWHERE.items():
        assert page in (ROOT / test).read_text(), f"{test} does not run the block of {page}"


def test_the_readme_example_trains_three_hospitals_in_seconds():
    (block,) = [b for b in RUN if b.page == "README.md" and b.lang == "python"]
    assert len(block.text.splitlines()) <= 25
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        exec(compile(block.text, "README.md", "exec"), {"__name__": "readme_example"})
    auc = float(re.search(r"pooled test AUC ([\d.]+)", out.getvalue()).group(1))
    assert auc > 0.9  # untrained scores sit near 0.5
    assert time.perf_counter() - start < 60


def test_the_readme_is_short_and_installs_from_the_checkout_or_a_wheel():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    setup = next(b for b in BLOCKS if b.page == "README.md" and b.lang == "bash")
    assert commands_of(setup) == ['pip install -e ".[dev]"', "fdam train", "pytest"]
    for page in pages():
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"pip install [\"']?fdam[-_]ray\b", text), f"{page}: installs fdam-ray by a bare name"
    assert "mkdocs serve" in readme


def test_the_generated_references_cover_every_field_section_and_command():
    hook = load_by_path("docs_reference_hook", ROOT / "docs/hooks/reference.py")
    fields = hook.config_reference()
    for f in FIELDS:
        assert f"| `{f.name}` |" in fields, f.name
    assert all(f"## `{name}`" in fields for name in SECTIONS)
    cli = hook.cli_reference()
    for command in ("train", "tune", "plot", "fields"):
        assert f"## `fdam {command}`" in cli and f"usage: fdam {command}" in cli
    assert "--trust-storage" in cli and "--resume RUN_DIR" in cli
    assert hook.CONFIG_MARKER in (ROOT / "docs/reference/config.md").read_text()
    assert hook.CLI_MARKER in (ROOT / "docs/reference/cli.md").read_text()


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))
    assert {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")} <= listed


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "config" / "index.html").is_file()
    config = (tmp_path / "reference" / "config" / "index.html").read_text()
    assert all(f"<code>{f.name}</code>" in config for f in FIELDS)
    api = (tmp_path / "reference" / "api" / "index.html").read_text()
    assert 'id="fdam_ray.api.train_arrays"' in api and 'id="fdam_ray.optim.PrimalDualSGD"' in api
    assert not re.search(r":(func|class|meth|attr|mod|data|exc|obj):", api)  # no Sphinx role shown raw
    assert 'href="#fdam_ray.api.train"' in api and "Parameters:" in api  # cross-references, parameter tables
    assert (tmp_path / "results" / "privacy.png").is_file() and (tmp_path / "images" / "consortium.svg").is_file()
    assert "Unreleased" in (tmp_path / "changelog" / "index.html").read_text()


def test_the_changelog_page_is_changelog_md_and_the_results_page_shows_the_benchmarks_figures():
    hook = load_by_path("docs_reference_hook_pages", ROOT / "docs/hooks/reference.py")
    page = (ROOT / "docs/changelog.md").read_text()
    assert hook.on_page_markdown(page) == (ROOT / "CHANGELOG.md").read_text() + "\n"
    figures = {p.name for p in hook.figures()}
    assert {"comm_window.png", "privacy.png", "rounds_vs_clients.png"} <= figures
    shown = set(re.findall(r"\]\(results/([\w.]+\.png)\)", (ROOT / "docs/results.md").read_text()))
    assert shown and shown <= figures, shown - figures


def test_the_glossary_names_real_fields():
    from fdam_ray.config import FIELD_BY_NAME

    rows = [line.split("|") for line in (ROOT / "docs/glossary.md").read_text().splitlines()
            if line.startswith("| **")]
    assert len(rows) > 20
    named = {n for row in rows for n in re.findall(r"`(\w+)`", row[3])}
    assert {"num_clients", "clients_per_round", "local_steps", "global_lr", "stage_length", "dp_epsilon"} <= named
    assert named <= set(FIELD_BY_NAME), named - set(FIELD_BY_NAME)


def test_the_troubleshooting_messages_are_the_packages_own():
    """Each message quoted on the troubleshooting page (a paragraph that is one backticked line) is, away from its
    example values, text of the package's source: most of its words lie in runs of three found there."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "fdam_ray").rglob("*.py"))
    source = re.sub(r"\"\s*\n\s*f?\"", "", source)  # adjacent string literals, joined
    page = (ROOT / "docs/troubleshooting.md").read_text()
    messages = [m.strip() for m in re.findall(r"^(``?)(.{40,})\1$", page, re.M) for m in m[1:]]
    assert len(messages) >= 12
    for message in messages:
        words = message.split()
        plain = [bool(re.fullmatch(r"[A-Za-z_,;:()^.-]+", w)) for w in words]
        covered = set()
        for i in range(len(words) - 2):
            if all(plain[i : i + 3]) and " ".join(words[i : i + 3]) in source:
                covered |= set(range(i, i + 3))
        assert len(covered) >= 0.6 * sum(plain), (message, [w for i, w in enumerate(words) if plain[i] and
                                                            i not in covered])
