"""MkDocs hook: the reference pages' tables, generated from the code at build time.

The config reference is made from the same field table that ``fdam fields`` prints (each field declared once with
``setting()`` in a section dataclass), and the CLI reference from the ``fdam`` command's argparse parser, so
neither page can drift from the code. A page asks for a table with a marker line:

- ``<!-- fdam:config-fields -->``: every config field, section by section (name, default, allowed values,
  whether a resume may change it, meaning);
- ``<!-- fdam:cli -->``: the ``--help`` text of ``fdam`` and of each of its commands;
- ``<!-- fdam:changelog -->``: CHANGELOG.md as it stands (the changelog page).

The figures the benchmarks draw (``benchmarks/results/*.png``) are added to the site as ``results/<name>.png``
(the results page shows them), read from where the benchmarks write them rather than copied into docs/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CONFIG_MARKER = "<!-- fdam:config-fields -->"
CLI_MARKER = "<!-- fdam:cli -->"
CHANGELOG_MARKER = "<!-- fdam:changelog -->"
FIGURES = "benchmarks/results"  # the benchmarks' figures, served as results/<name>.png
ROOT = Path(__file__).resolve().parents[2]


def _cell(text: object) -> str:
    """One Markdown table cell: pipes escaped, line breaks folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _allowed(field: Any) -> str:
    allowed = ", ".join(f"`{c}`" for c in field.choices) if field.choices else field.allowed
    if field.kind == "factory":
        allowed = (allowed + ", or " if allowed else "") + "your own `module:attr`"
    if field.optional:
        allowed = (allowed + "; " if allowed else "") + "null"
    return allowed


def config_reference() -> str:
    """Every config field, grouped by the section that declares it, as Markdown."""
    from fdam_ray.config import FIELDS, SECTION_CLASSES

    out: list[str] = []
    for cls in SECTION_CLASSES:
        fields = [f for f in FIELDS if f.section == cls.name]
        out += [f"## `{cls.name}`", "",
                f"Declared in `{cls.__module__}.{cls.__name__}`; `fdam fields {cls.name}` prints these.", "",
                "| field | default | allowed | on resume | meaning |", "|---|---|---|---|---|"]
        for f in fields:
            default = "null" if f.default is None else f.default
            resume = "may change" if f.resume else ""
            out.append(f"| `{f.name}` | `{_cell(default)}` | {_cell(_allowed(f))} | {resume} | {_cell(f.doc)} |")
        out.append("")
    from fdam_ray.executors.flower_section import catalog_rows

    out += ["## `flower`", "", "The `flower:` section of the same file, read by a consortium's server "
            "(`fdam_ray.executors.flower_section.FlowerSection`; checked by every run, ignored by simulations; the "
            "server's own, so a resume may change it); `fdam fields flower` prints these.", "",
            "| field | default | allowed | on resume | meaning |", "|---|---|---|---|---|"]
    out += [f"| `{name}` | `{_cell(default)}` | {_cell(allowed)} | may change | {_cell(doc)} |"
            for _, name, default, doc, allowed in catalog_rows()]
    return "\n".join([*out, ""])


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """``fdam --help`` and each command's ``--help``, as Markdown."""
    import os

    from fdam_ray.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width: fix it for a stable page
    try:
        parser = build_parser()
        out = ["## `fdam`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subparsers(parser).items():
            out += [f"## `fdam {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:  # the process's own width as it was (a test session calls this too)
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(out)


def changelog() -> str:
    """CHANGELOG.md, for the changelog page."""
    return (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def figures() -> list[Path]:
    """The benchmarks' figures the site serves."""
    return sorted((ROOT / FIGURES).glob("*.png"))


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the benchmarks' figures to the site, as ``results/<name>.png``."""
    from mkdocs.structure.files import File

    for figure in figures():
        files.append(File.generated(config, f"results/{figure.name}", abs_src_path=str(figure)))
    return files


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the markers of a page with the tables they stand for."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if CHANGELOG_MARKER in markdown:
        markdown = markdown.replace(CHANGELOG_MARKER, changelog())
    return markdown
