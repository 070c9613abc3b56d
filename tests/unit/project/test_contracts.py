"""The executor interface is the whole contract (docs/architecture.md, "The executor contract"): every member the
loop and the deadlines use is declared on :class:`Executor` (or :class:`RunsOfRounds`), and no package code probes
the executor or the config for a member by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import fdam_ray
from fdam_ray.executors.base import Executor, ExecutorSetup, RunsOfRounds
from fdam_ray.executors.inline import InlineExecutor

PACKAGE = Path(fdam_ray.__file__).resolve().parent
USERS = [PACKAGE / "loop" / "federation.py", PACKAGE / "executors" / "deadlines.py", PACKAGE / "loop" / "evaluation.py",
         PACKAGE / "assembly" / "cuts.py"]
PROBED = ("config", "cfg", "executor", "whole")  # names of objects that are typed, never probed
SECTION_CUT = (PACKAGE / "settings" / "sections.py", "of")  # the one typed projection of declared fields


def _executor_members(path: Path) -> set[str]:
    """Attributes the module reads off ``self.executor``, ``executor`` or ``runs`` (the RunsOfRounds view)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Attribute) and base.attr == "executor") or (
                    isinstance(base, ast.Name) and base.id in ("executor", "runs")):
                out.add(node.attr)
    return out


def test_every_member_the_loop_uses_is_declared_on_the_interface():
    declared = {name for cls in (Executor, RunsOfRounds) for name, _ in inspect.getmembers(cls)}
    used = set().union(*(_executor_members(p) for p in USERS))
    assert {"run_round", "broadcast_nbytes", "transfer_state", "placement_lines", "round_changes",
            "rounds_ahead", "section"} <= used
    assert sorted(used - declared) == []


def test_the_optional_members_have_defaults_an_executor_inherits():
    ex = InlineExecutor()
    assert ex.placement_lines() == [] and ex.transfer_state() is None
    ex.restore_transfer_state(None)
    assert not isinstance(ex, RunsOfRounds)
    try:
        ex.round_changes(3)
    except NotImplementedError as exc:
        assert "round_deadline needs executor=ray" in str(exc)
    else:
        raise AssertionError("an executor without deadlines has no round changes to give")
    assert set(inspect.signature(Executor.start).parameters) == {"self", "setup", "source"}
    assert {f for f in ExecutorSetup.__dataclass_fields__} >= {"algorithm", "executor", "client"}


def test_no_package_code_probes_the_config_or_the_executor_by_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if (path, fn.name) == SECTION_CUT:
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and node.args):
                    target = ast.unparse(node.args[0])
                    if any(target.split(".")[-1].startswith(word) for word in PROBED):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert found == []
