"""One assembly path: every entry point starts from the same initial weights and pre-training.

A Tune trial, ``fdam_ray.train`` and ``train_arrays`` all assemble their
federation through :func:`fdam_ray.assembly.recipe.federate`, so ``model_weights`` and
``pretrain_iterations`` mean the same thing everywhere; and the package has no
import cycle.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import raytest
import torch
import yaml

import fdam_ray
from fdam_ray.assembly.weights import head_keys
from fdam_ray.config import build_config
from fdam_ray.metrics import mean_auc, task_aucs
from fdam_ray.models import build_model
from fdam_ray.tuning import load_space, run_sweep

BASE = dict(algorithm="codasca", dataset="synthetic", heterogeneity=1.0, num_clients=2, samples_per_client=150,
            model="mlp", model_width=8, batch_size=32, iterations=20, eval_every=20, local_steps=5,
            executor="inline", threads_per_client=1, tensorboard=False)


@pytest.fixture(scope="module")
def ray_session():
    with raytest.ray_session(num_cpus=2):
        yield


def saved_weights(tmp_path: Path, seed: int = 11) -> tuple[Path, dict]:
    """A state_dict of the BASE network from another seed, saved the way users save one."""
    model = build_model("mlp", (20,), 1, width=8, seed=seed)
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)
    return path, model.state_dict()


def sweep(tmp_path: Path, base: dict) -> list[Path]:
    """A 2-trial grid over lr; returns each trial's run folder."""
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump({"base": {**BASE, **base}, "search": {"lr": {"grid": [0.05, 0.1]}},
                                          "tune": {"storage_path": str(tmp_path / "sweeps"), "name": "s",
                                                   "driver_cpus": 1}}))
    out = run_sweep(load_space(str(space_file))).path
    runs = sorted(p.parent for p in out.glob("trial_*/run/metrics.jsonl"))
    assert len(runs) == 2
    return runs


def first_auc(run_dir: Path) -> float:
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["iteration"] == 0
    return rec["test_auc"]


@pytest.mark.slow
def test_sweep_trials_start_from_model_weights(tmp_path, ray_session):
    path, _ = saved_weights(tmp_path)
    direct = fdam_ray.train(build_config(BASE, model_weights=str(path)), save=False).history[0]["test_auc"]
    seeded = fdam_ray.train(build_config(BASE), save=False).history[0]["test_auc"]
    assert direct != seeded  # the weights change the starting model, so the check below can fail
    for run in sweep(tmp_path, {"model_weights": str(path)}):
        assert first_auc(run) == direct


@pytest.mark.slow  # in CI's slow tier: a Tune sweep, 15 s
def test_sweep_trials_run_the_pretraining_stage(tmp_path, ray_session):
    base = {"pretrain_iterations": 10, "pretrain_lr": 0.5}
    direct = fdam_ray.train(build_config(BASE, **base), save=False)
    assert direct.pretrain is not None
    without = fdam_ray.train(build_config(BASE), save=False).history[0]["test_auc"]
    assert direct.history[0]["test_auc"] != without
    for run in sweep(tmp_path, base):
        stage1 = [json.loads(x) for x in (run.parent / "run-pretrain" / "metrics.jsonl").read_text().splitlines()]
        assert stage1[-1]["iteration"] == 10
        assert stage1[-1]["test_auc"] == direct.pretrain.history[-1]["test_auc"]
        assert first_auc(run) == direct.history[0]["test_auc"]


def arrays(seed: int = 0):
    rng = np.random.default_rng(seed)

    def part(n: int, shift: float):
        y = (rng.random(n) < 0.3).astype(np.float32)
        x = rng.normal(size=(n, 20)).astype(np.float32) + shift * y[:, None]
        return x, y

    return [part(120, 1.0), part(80, 0.6)], part(200, 0.8)


def auc_of(model: torch.nn.Module, test) -> float:
    with torch.no_grad():
        scores = torch.sigmoid(model(torch.from_numpy(test[0]))).numpy()
    return mean_auc(task_aucs(scores, test[1].reshape(-1, 1)))


def test_train_arrays_starts_from_model_weights(tmp_path):
    path, state = saved_weights(tmp_path)
    clients, test = arrays()
    cfg = {k: v for k, v in BASE.items() if k not in ("dataset", "samples_per_client", "heterogeneity")}
    result = fdam_ray.train_arrays(dict(cfg, model_weights=str(path)), clients, test)
    model = build_model("mlp", (20,), 1, width=8, seed=0)
    model.load_state_dict(state)
    assert result.history[0]["test_auc"] == pytest.approx(auc_of(model.eval(), test), abs=1e-6)
    seeded = fdam_ray.train_arrays(cfg, clients, test).history[0]["test_auc"]
    assert seeded != result.history[0]["test_auc"]


def test_train_arrays_pretrains_then_starts_from_the_body_with_a_fresh_head():
    clients, test = arrays(1)
    cfg = {k: v for k, v in BASE.items() if k not in ("dataset", "samples_per_client", "heterogeneity")}
    result = fdam_ray.train_arrays(dict(cfg, pretrain_iterations=15, pretrain_lr=0.5), clients, test)
    pre = result.pretrain
    assert pre is not None and pre.config.algorithm == "fedavg" and pre.state.iteration == 15
    model = build_model("mlp", (20,), 1, width=8, seed=0)  # the seeded head
    head = set(head_keys(model))
    model.load_state_dict({k: v for k, v in pre.model_state.items() if k not in head}, strict=False)
    assert result.history[0]["test_auc"] == pytest.approx(auc_of(model.eval(), test), abs=1e-6)
    assert result.history[0]["test_auc"] != pytest.approx(pre.history[-1]["test_auc"], abs=1e-9)


# -- no import cycle ---------------------------------------------------------------------------------------------
PACKAGE = Path(fdam_ray.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Modules of the package that ``module`` imports anywhere (functions included, TYPE_CHECKING blocks not)."""
    found: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = node.module or ""
            if node.level:
                root = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + ([root] if root else []))
            names = [root] + [f"{root}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "fdam_ray":
                found.add(name)
                parent = name.rpartition(".")[0]
                # importing a.b.c runs a.b's __init__ first, unless the importer lives inside a.b
                while parent and parent != "fdam_ray" and not module.startswith(parent + "."):
                    found.add(parent)
                    parent = parent.rpartition(".")[0]
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def test_the_package_has_no_import_cycle():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {m: _imports(ast.parse(p.read_text()), m, p.name == "__init__.py", modules) for m, p in files.items()}
    assert "fdam_ray.loop.federation" in graph["fdam_ray.assembly.cuts"]  # the walk sees imports at all
    assert "fdam_ray.assembly.recipe" in graph["fdam_ray.tuning.trial"]  # ... including those inside functions
    cycles, state = [], {}

    def dfs(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                dfs(n, [*path, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
