"""Limits the package holds, as tests: no module of ``fdam_ray/`` over 450 lines (headroom under 500: a file that
must grow to fix a bug need not be split in the same change) and no function over cyclomatic complexity 25, except
where ``ALLOWED`` says why.

The complexity is counted as radon counts it (``radon cc``; radon is not a dependency, so the count is made
here with :mod:`ast`): 1, plus one for each ``if``/``elif``, conditional expression, ``for``/``while`` (one more
for an ``else``), ``except`` handler (``except*`` too, which radon 6 misses; one more for a ``try``'s
``else``), boolean operator (``a and b or c``: 2), comprehension ``for`` and ``if``, ``assert``, and ``match``
case (a catch-all case excepted). A function nested in another (a closure, a class's method) is counted on its
own and not in the one around it; a lambda is counted in the function it is in. ruff's C901 (``ruff.toml``)
warns at the same bound while editing, but its McCabe count leaves out boolean operators, comprehensions and
conditional expressions and so reads lower: this test is the bound.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "fdam_ray"
MAX_LINES = 450
MAX_COMPLEXITY = 25

# "module path (under fdam_ray/)" or "module path::function's qualified name" -> why it may stay over the limit.
# Keep it short: an entry is a debt with a reason, and one that no longer names something over a limit fails.
ALLOWED: dict[str, str] = {}

_BRANCHES = (ast.If, ast.IfExp)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_TRIES = (ast.Try, ast.TryStar)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _decisions(node: ast.AST) -> int:
    """The decision points ``node`` adds to the function it is in, its own and those of what it holds (a nested
    function or class adds nothing here: it is counted on its own)."""
    if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
        return 0
    if isinstance(node, ast.Assert):  # radon counts an assert and looks no further inside it
        return 1
    own = 0
    if isinstance(node, _BRANCHES):
        own = 1
    elif isinstance(node, _LOOPS):
        own = 1 + bool(node.orelse)
    elif isinstance(node, _TRIES):
        own = len(node.handlers) + bool(node.orelse)
    elif isinstance(node, ast.BoolOp):
        own = len(node.values) - 1
    elif isinstance(node, ast.comprehension):
        own = 1 + len(node.ifs)
    elif isinstance(node, ast.Match):
        catch_all = any(isinstance(c.pattern, ast.MatchAs) and c.pattern.pattern is None for c in node.cases)
        own = max(0, len(node.cases) - catch_all)
    return own + sum(_decisions(child) for child in ast.iter_child_nodes(node))


def complexities(source: str) -> Iterator[tuple[str, int, int]]:
    """``(qualified name, first line, complexity)`` of every function and method in ``source``, nested ones
    included (``outer.inner``, ``Class.method``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                name = prefix + child.name
                yield name, child.lineno, 1 + sum(_decisions(stmt) for stmt in child.body)
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def _complexity_of(code: str, name: str) -> int:
    found = {n: c for n, _, c in complexities(textwrap.dedent(code))}
    return found[name]


# -- the counter itself, on code of known counts (radon 6.0.1 gives the same; it does not list the methods of a
# class defined inside a function, which are counted here) ------------------------------------------------------
@pytest.mark.parametrize(("code", "name", "expected"), [
    ("def f():\n    return 1\n", "f", 1),
    ("def f(x):\n    if x:\n        return 1\n    elif x > 2:\n        return 2\n    else:\n        return 3\n",
     "f", 3),
    ("def f(x):\n    return 1 if x else 2\n", "f", 2),
    ("def f(xs):\n    for x in xs:\n        pass\n    else:\n        pass\n    while xs:\n        break\n", "f", 4),
    ("def f():\n    try:\n        pass\n    except ValueError:\n        pass\n    except OSError:\n        pass\n"
     "    else:\n        pass\n    finally:\n        pass\n", "f", 4),
    ("def f(a, b, c):\n    return a and b or c\n", "f", 3),
    ("def f(xs):\n    return [x for x in xs if x if x > 1] + [y for y in xs for _ in y]\n", "f", 6),
    ("def f(x):\n    assert x and x > 1\n", "f", 2),  # radon does not look inside an assert
    ("def f(x):\n    match x:\n        case 1:\n            pass\n        case [y]:\n            pass\n"
     "        case _:\n            pass\n", "f", 3),
    ("def f(x):\n    with x:\n        return lambda y: 1 if y else 2\n", "f", 2),  # a lambda is part of f
    ("def f(x):\n    async def g():\n        async for _ in x:\n            pass\n    return g\n", "f", 1),
    ("def f(x):\n    async def g():\n        async for _ in x:\n            pass\n    return g\n", "f.g", 2),
    ("class C:\n    def m(self, x):\n        if x or self:\n            return [1 for _ in x]\n", "C.m", 4),
    ("def f(x):\n    class Inner:\n        def m(self):\n            return x if x else 0\n    return Inner\n",
     "f", 1),
    ("def f(x):\n    class Inner:\n        def m(self):\n            return x if x else 0\n    return Inner\n",
     "f.Inner.m", 2),
])
def test_the_counter_counts_as_radon_does(code, name, expected):
    assert _complexity_of(code, name) == expected


def test_the_counter_would_catch_a_function_over_the_limit():
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(MAX_COMPLEXITY))
    assert _complexity_of("def f(x):\n" + body, "f") == MAX_COMPLEXITY + 1
    assert _complexity_of("def f(x):\n" + "".join(body.splitlines(keepends=True)[2:]), "f") == MAX_COMPLEXITY


# -- the package ---------------------------------------------------------------------------------------------------
def _modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 50  # the walk sees the package at all
    return found


def _key(path: Path, function: str | None = None) -> str:
    rel = path.relative_to(PACKAGE).as_posix()
    return rel if function is None else f"{rel}::{function}"


@functools.cache
def _over_limits() -> dict[str, str]:
    """Everything over a limit, keyed as ``ALLOWED`` is, with what it measures (read once a session)."""
    over: dict[str, str] = {}
    for path in _modules():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_LINES:
            over[_key(path)] = f"{lines} lines"
        for name, line, cc in complexities(text):
            if cc > MAX_COMPLEXITY:
                over[_key(path, name)] = f"complexity {cc} (line {line})"
    return over


def test_no_module_passes_450_lines_and_no_function_complexity_25():
    over = {k: v for k, v in _over_limits().items() if k not in ALLOWED}
    assert over == {}, ("over the limits (split the module at a seam, or the function into named steps; only if "
                        f"neither helps, add it to ALLOWED with why): {over}")


def _allow_list_problems(allowed: dict[str, str], over: dict[str, str]) -> list[str]:
    """What is wrong with an allow-list, given what is over the limits: too long, stale entries, no reasons."""
    problems = []
    if len(allowed) > 5:
        problems.append("the allow-list is for a few exceptions, not a way around the limits")
    stale = sorted(set(allowed) - set(over))
    if stale:
        problems.append(f"no longer over a limit (or no longer there), remove from ALLOWED: {stale}")
    unexplained = sorted(k for k, why in allowed.items() if len(why.split()) < 4)
    if unexplained:
        problems.append(f"say in a line why each may stay: {unexplained}")
    return problems


def test_every_allowed_exception_is_still_over_a_limit_and_says_why():
    assert _allow_list_problems(ALLOWED, _over_limits()) == []


def test_the_allow_list_check_refuses_stale_unexplained_or_too_many_entries():
    over = {"a.py": "501 lines", "b.py::f": "complexity 26 (line 3)"}
    assert _allow_list_problems({"a.py": "a table of constants, one idea"}, over) == []
    assert "remove from ALLOWED: ['gone.py::g']" in _allow_list_problems({"gone.py::g": "it was long once"}, over)[0]
    assert "why each may stay: ['b.py::f']" in _allow_list_problems({"b.py::f": "long"}, over)[0]
    many = {f"m{i}.py": "a reason in words" for i in range(6)}
    assert "a few exceptions" in _allow_list_problems(many, {k: "501 lines" for k in many})[0]


def largest(n: int = 10) -> list[tuple[int, str]]:
    """The ``n`` most complex functions of the package, for a report (``python tests/unit/project/test_limits.py``)."""
    every = [(cc, _key(path, name)) for path in _modules() for name, _, cc in complexities(path.read_text())]
    return sorted(every, key=lambda x: (-x[0], x[1]))[:n]


if __name__ == "__main__":
    for cc, where in largest():
        print(f"{cc:4d}  {where}")
