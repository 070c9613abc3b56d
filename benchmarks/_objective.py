"""The primal objective phi of the paper's convergence theorems, measured during a federated run.

phi(v) = min over (a, b), max over alpha of the AUC objective; its closed form
needs only the scores of the global model over the union of the clients'
training data. :class:`ObjectiveProbe` wraps any executor and computes it on
the driver at every evaluation; :func:`reference_objective` estimates phi*
with a central full-batch fit of the same model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fdam_ray.clients.client import Replica
from fdam_ray.data import Split
from fdam_ray.executors.base import Executor
from fdam_ray.models import build_model


def primal_objective(scores: np.ndarray, labels: np.ndarray, objective: str, margin: float = 1.0) -> float:
    """phi(w) = min over (a, b), max over alpha of the objective's mean over the samples, in closed form.

    With p the positive fraction of the samples, m+/m- and V+/V- the mean and
    (population) variance of the scores h over positives/negatives, the optimal
    a = m+, b = m-, and alpha = m- - m+ (auc_square) or max(0, m + m- - m+)
    (auc_margin) give

        auc_square: phi = p(1-p) (V+ + V- + (1 - m+ + m-)^2 - 1)
        auc_margin: phi = p(1-p) (V+ + V- + max(0, m - m+ + m-)^2)

    the primal objective the paper's convergence theorems bound (phi(v) - phi*).
    """
    h = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    pos, neg = h[y == 1], h[y == 0]
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError("the primal objective needs positives and negatives")
    p = len(pos) / (len(pos) + len(neg))
    gap = neg.mean() - pos.mean()
    if objective == "auc_square":
        tail = (1 + gap) ** 2 - 1
    elif objective == "auc_margin":
        tail = max(0.0, margin + gap) ** 2
    else:
        raise ValueError(f"the primal objective is defined for auc_square and auc_margin, not {objective!r}")
    return float(p * (1 - p) * (pos.var() + neg.var() + tail))


def union_train(source) -> tuple:
    """All clients' training samples as one (x, y) pair of tensors (in-memory sources only)."""
    shards = [source.client_shard(k).train for k in range(source.num_clients)]
    if not all(hasattr(s, "x") for s in shards):
        raise ValueError("the objective probe needs in-memory training splits (synthetic, arrays, digits, ...)")
    return torch.cat([s.x for s in shards]), torch.cat([s.y for s in shards])


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


class ObjectiveProbe(Executor):
    """Runs the clients on an inner executor (inline or Ray); at every evaluation also computes, on
    the driver, the primal objective phi of the global model over the union of the clients' training
    data (``last``)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.section = inner.section  # the inner executor reads its own section of the config
        self.last = math.nan

    def start(self, setup, source):
        infos = self.inner.start(setup, source)
        self.replica = Replica(setup.client, source, device=torch.device("cpu"))
        self.union = Split(*union_train(source))
        self.objective, self.margin = setup.algorithm.objective_name, setup.algorithm.margin
        return infos

    def evaluate(self, state, split="test", bins=None):
        scores = self.replica.scores_of(state, self.union)
        self.last = primal_objective(scores.scores, scores.labels, self.objective, self.margin)
        return self.inner.evaluate(state, split, bins)


# Everything else the driver asks of an executor goes to the inner one (whatever methods the interface has).
for _name, _member in vars(Executor).items():
    if _name.startswith("_") or _name in ("start", "evaluate"):
        continue
    if isinstance(_member, property):
        setattr(ObjectiveProbe, _name, property(lambda self, _n=_name: getattr(self.inner, _n)))
    elif callable(_member):
        setattr(ObjectiveProbe, _name, _delegate(_name))
ObjectiveProbe.__abstractmethods__ = frozenset()


def reference_objective(config, source, *, steps: int = 300) -> tuple[float, float]:
    """(phi at the seeded initial model, phi* estimate): the config's model fitted to phi on the union of
    the training data with full-batch L-BFGS on the driver (a central reference, no federation)."""
    x, y = union_train(source)
    y = y.reshape(-1)
    model = build_model(config.model, source.input_shape, 1, width=config.model_width, seed=config.seed)
    p = float((y == 1).float().mean())
    pos, neg = y == 1, y == 0

    def phi() -> torch.Tensor:
        h = torch.sigmoid(model(x).reshape(-1)).double()
        gap = h[neg].mean() - h[pos].mean()
        tail = (1 + gap) ** 2 - 1 if config.objective == "auc_square" else torch.clamp(config.margin + gap, min=0) ** 2
        return p * (1 - p) * (h[pos].var(unbiased=False) + h[neg].var(unbiased=False) + tail)

    with torch.no_grad():
        start = float(phi())
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=steps, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-10, tolerance_change=1e-14)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = phi()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return start, float(phi())
