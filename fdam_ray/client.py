"""One federated client: its data shard, its model replica and its control variate.

The same class runs in the driver process (inline executor) and inside a Ray
actor; it imports no Ray. Everything it receives and returns is numpy buffers
or small dataclasses (:mod:`fdam_ray.state`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
import torch

from fdam_ray.algorithms import Algorithm, AlgorithmSection
from fdam_ray.data import AnySplit, DataSource, Split, iter_batches, make_sampler
from fdam_ray.flat import FlatModel
from fdam_ray.models import build_model
from fdam_ray.precision import Precision
from fdam_ray.state import ClientInfo, ClientUpdate, GlobalState, Moments, RoundPlan, Scores, StepStats

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ClientSection(AlgorithmSection):
    """What a client (and the driver's replica) needs of the config: the algorithm, the network, batches."""

    model: str
    model_width: int
    seed: int
    batch_size: int
    eval_batch_size: int
    deterministic: bool
    precision: str
    channels_last: bool | str


def use_deterministic_kernels() -> None:
    """Deterministic torch kernels for this process (cuBLAS needs its workspace setting before first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no value of ``tensors`` is NaN or infinite.

    A sum is finite only if every term is (NaN and infinity propagate), and it
    costs a twentieth of an element-wise test; only a non-finite sum, which may
    also come from large finite terms overflowing, takes the element-wise test.
    """
    if bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def check_features(split: AnySplit | None, client_id: int, what: str) -> None:
    """Refuse features holding NaN or infinity before training (they would only show later as a divergence).

    Tensors held in memory are checked whole; images read from disk are decoded into finite pixels.
    """
    if not isinstance(split, Split) or len(split) == 0 or all_finite([split.x]):
        return
    sample, column = (int(i) for i in (~torch.isfinite(split.x.reshape(len(split), -1))).nonzero()[0])
    raise ValueError(f"client {client_id}: its {what} features hold NaN or infinite values (first at sample "
                     f"{sample}, feature column {column}); clean or impute them before training")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first visible GPU if any, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no GPU is visible to this process")
    return torch.device(name)


class Replica:
    """A model replica in flat storage that can load a global state and score samples."""

    def __init__(self, config: ClientSection, source: DataSource, *, device: torch.device) -> None:
        self.config = config
        self.device = device
        if config.deterministic:
            use_deterministic_kernels()
        self.algorithm = Algorithm.from_section(config)
        self.objective = self.algorithm.objective(source.num_tasks)
        model = build_model(config.model, source.input_shape, source.num_tasks,
                            width=config.model_width, seed=config.seed)
        self.flat = FlatModel(model, aux_size=self.objective.aux_size, device=device,
                              precision=Precision.of(config, model, device))

    @torch.no_grad()
    def score(self, split: AnySplit) -> np.ndarray:
        """Sigmoid scores (n, T) of the current model on ``split`` (eval mode, then back to train mode)."""
        model = self.flat.model
        model.eval()
        try:
            t, batches = self.objective.num_tasks, iter_batches(split, self.config.eval_batch_size, self.device)
            out = [torch.sigmoid(self.flat.forward(x).reshape(-1, t)) for x, _ in batches]
        finally:
            model.train()
        return torch.cat(out).cpu().numpy()

    def scores_of(self, state: GlobalState, split: AnySplit, client_id: int = -1) -> Scores:
        self.flat.load(state)
        return Scores(client_id, self.score(split), split.y.cpu().numpy())


class Client(Replica):
    """A client: builds its own shard from the data source spec, then runs local rounds.

    Args:
        config: the client's section of the run's config.
        source: the data source spec; the client calls ``source.client_shard(client_id)``.
        client_id: k in 0..K-1.
        device: where its model and data live.
    """

    def __init__(self, config: ClientSection, source: DataSource, client_id: int, *, device: torch.device) -> None:
        super().__init__(config, source, device=device)
        self.client_id = client_id
        shard = source.client_shard(client_id)
        self.train = shard.train.to(device)
        self.test = None if shard.test is None else shard.test.to(device)
        check_features(self.train, client_id, "training")
        check_features(self.test, client_id, "test")
        if config.batch_size > len(self.train):
            log.warning("client %d has %d training samples, fewer than batch_size=%d: each of its batches repeats "
                        "samples", client_id, len(self.train), config.batch_size)
        self.sampler = make_sampler(self.train, config.batch_size, seed=config.seed * 1_000_003 + client_id,
                                    device=device)
        self.solver = self.algorithm.solver(self.flat, self.objective)

    def info(self) -> ClientInfo:
        positives, labelled = self.train.label_counts()
        return ClientInfo(self.client_id, len(self.train), 0 if self.test is None else len(self.test),
                          positives, labelled, self.flat.state_size)

    def configure(self, positive_ratio: np.ndarray) -> None:
        """Set the global p of the objective (the same on every client)."""
        self.objective.set_positive_ratio(positive_ratio, device=self.device)

    def begin_stage(self, reference: np.ndarray, reset_control_variate: bool) -> None:
        """Start a stage: new proximal centre v_ref and, by default, a zero control variate."""
        self.solver.set_reference(reference)
        if reset_control_variate:
            self.solver.reset_control_variate()

    def local_round(self, state: GlobalState, plan: RoundPlan, *, copy: bool = True) -> ClientUpdate:
        """Run ``plan.steps`` local steps from the global state and return the end point.

        ``copy=False`` returns views of the client's buffers (valid until its next call), for a caller
        that serialises the update at once (a Ray actor returning it): one copy of the state fewer.
        """
        self.solver.begin(state)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        samples = 0
        for _ in range(plan.steps):
            x, y = self.sampler.next()
            loss_sum += self.solver.step(x, y, plan.lr)
            samples += x.shape[0]
        loss = float(loss_sum) / plan.steps  # waits for the steps on a GPU
        compute_s = time.perf_counter() - start  # the steps alone: loading and exporting the state are transfer
        # a sampled round: the server needs c^k_new - c^k_old
        (self.solver.end_sampled if plan.partial else self.solver.end)(plan.steps, plan.lr)
        v, alpha, buffers, counters, c_v, c_alpha = self.solver.export(copy=copy)
        stats = StepStats(self.client_id, loss, plan.steps, samples, compute_s, finite=self._finite())
        return ClientUpdate(self.client_id, v, alpha, buffers, counters, c_v, c_alpha, stats)

    def _finite(self) -> bool:
        """Whether the round's end point and c^k hold no NaN or infinity (one check where they live)."""
        parts = [self.flat.v, self.flat.alpha, self.flat.buffers]
        if self.solver.control_variates:
            parts += [self.solver.c_v, self.solver.c_alpha]
        return all_finite(parts)

    def evaluate(self, state: GlobalState) -> Scores | None:
        """Scores of the global model on this client's own test split (None if it has none)."""
        return None if self.test is None else self.scores_of(state, self.test, self.client_id)

    @torch.no_grad()
    def score_moments(self, state: GlobalState) -> Moments:
        """Per-task sums of h over the training positives and negatives (for CODA's closed-form alpha)."""
        self.flat.load(state)
        h = self.score(self.train)
        y = self.train.y.cpu().numpy()
        pos, neg = y == 1, y == 0
        return Moments((h * pos).sum(0), pos.sum(0), (h * neg).sum(0), neg.sum(0), self.client_id)

    def set_control_variate(self, c_v: np.ndarray, c_alpha: np.ndarray) -> None:
        self.solver.set_control_variate(c_v, c_alpha)

    def get_state(self) -> dict:
        """What a checkpoint needs to continue this client exactly: c^k and the sampler's position."""
        cv = self.solver.control_variate()
        return {"client_id": self.client_id, "c_v": None if cv is None else cv[0],
                "c_alpha": None if cv is None else cv[1], "sampler": self.sampler.get_state(),
                "scaler": self.flat.precision.state_dict()}

    def set_state(self, state: dict) -> None:
        if state["client_id"] != self.client_id:
            raise ValueError(f"state of client {state['client_id']} given to client {self.client_id}")
        if state["c_v"] is not None:
            self.solver.set_control_variate(state["c_v"], state["c_alpha"])
        self.sampler.set_state(state["sampler"])
        self.flat.precision.load_state_dict(state.get("scaler"))
