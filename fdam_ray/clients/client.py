"""Federated clients: a client's own state kept apart from the model replica that runs it.

A :class:`Client` is cheap: its data shard, its sampler position and its
control variate c^k. A :class:`TrainingReplica` is expensive (the network, its
flat storage, the objective and the local solver, and on a GPU its CUDA
context): one per process serves every client hosted there, one after
another. The same classes run in the driver process (inline executor) and
inside a Ray actor; they import no Ray. Everything they receive and return is
numpy buffers or small dataclasses (:mod:`fdam_ray.core.state`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fdam_ray.algorithms import LocalSolver, build_algorithm
from fdam_ray.algorithms.drift import ClientVariate
from fdam_ray.algorithms.sampling import client_weights
from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.face import NO_FACE, ClientFace
from fdam_ray.clients.inputs import all_finite, check_features, features_refused
from fdam_ray.clients.late import StepClock
from fdam_ray.core.flat import FlatModel
from fdam_ray.core.state import (
    ClientInfo,
    ClientState,
    ClientUpdate,
    GlobalState,
    RoundPlan,
    ScoreHistogram,
    Scores,
    ScoreSums,
    StepStats,
    reads_store_arrays,
)
from fdam_ray.data import AnySplit, DataSource, iter_batches, make_sampler
from fdam_ray.data.base import hold_out_validation
from fdam_ray.features.precision import Precision, PrecisionSection
from fdam_ray.features.sites import client_label
from fdam_ray.models import build_model
from fdam_ray.scores.histogram import Binning
from fdam_ray.settings.sections import AT_LEAST_ONE, Section, setting, shared

reads_store_arrays(__name__)  # control variates and moments from the object store are only copied in

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSection(Section):
    """What a client (and the driver's replica) reads of the config: the algorithm's local side, the network,
    batches and arithmetic. It is all a Ray actor receives: no server, executor or Ray field."""

    name = "client"

    batch_size: int = setting(32, "B, local minibatch size; 0 or 'full' = full-batch gradients.", kind="batch",
                              allowed=">= 0 or 'full'", aliases=("batchsize",))
    eval_batch_size: int = setting(256, "Samples scored at once when evaluating (lower it for large images).",
                                   check=AT_LEAST_ONE, resume=True)
    algorithm: str = shared()
    objective: str | None = shared()
    margin: float = shared()
    pauc_temperature: float = shared()
    prox_weight: float = shared()
    weight_decay: float = shared()
    grad_clip: float | None = shared()
    client_weighting: str = shared()
    model: str = shared()
    model_width: int = shared()
    seed: int = shared()
    deterministic: bool = shared()
    precision: str = shared()
    channels_last: bool | str = shared()
    client_names: tuple[str, ...] | None = shared()
    val_fraction: float = shared()
    momentum: float = shared()
    local_optimizer: str = shared()
    positive_sampling: str = shared()
    positive_share: float = shared()
    clinical: str = shared()  # the driver's Evaluator reads these four off its replica's config
    pauc_max_fpr: float = shared()
    pauc_min_tpr: float | None = shared()
    operating_points: tuple[float, ...] = shared()


def use_deterministic_kernels() -> None:
    """Deterministic torch kernels for this process (cuBLAS needs its workspace setting before first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


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
        self.algorithm = build_algorithm(config)  # the client's fields only: its server fields keep defaults
        self.objective = self.algorithm.objective(source.num_tasks)
        model = build_model(config.model, source.input_shape, source.num_tasks,
                            width=config.model_width, seed=config.seed)
        self.flat = FlatModel(model, aux_size=self.objective.aux_size, device=device,
                              precision=Precision.of(PrecisionSection.of(config), model, device))

    @torch.no_grad()
    def score(self, split: AnySplit, what: str = "the samples scored") -> np.ndarray:
        """Sigmoid scores (n, T) of the current model on ``split`` (eval mode, then back to train mode).

        ``what`` names the split in the error of features the model cannot take."""
        model = self.flat.model
        model.eval()
        x, out = None, []
        try:
            t, batches = self.objective.num_tasks, iter_batches(split, self.config.eval_batch_size, self.device)
            for x, _ in batches:
                out.append(torch.sigmoid(self.flat.forward(x).reshape(-1, t)))
        except RuntimeError as exc:
            refused = features_refused(exc, x, self.config.model, what)
            if refused is None:
                raise
            raise refused from None
        finally:
            model.train()
        return torch.cat(out).cpu().numpy()

    def scores_of(self, state: GlobalState, split: AnySplit, client_id: int = -1, part: str = "test split") -> Scores:
        self.flat.load(state)
        who = client_label(client_id, self.config.client_names)
        what = "the test set" if client_id < 0 else f"client {who}'s {part}"
        return Scores(client_id, self.score(split, what), split.y.cpu().numpy())


class TrainingReplica(Replica):
    """The expensive part of running clients: model, flat storage, objective and local solver (one per process).

    One training replica serves every client hosted in its process (the inline
    executor's driver, or one Ray actor), one client at a time: a client's own
    state (:class:`Client`: shard, sampler position, control variate) is bound to
    it for the client's round. The objective's p and the stage's proximal centre
    are the same on every client, so the replica holds them once. Mixed precision
    and loss scaling wrap the solver here (:meth:`train_step`); the solver holds
    the algorithm's math only.
    """

    def __init__(self, config: ClientSection, source: DataSource, *, device: torch.device,
                 face: ClientFace = NO_FACE) -> None:
        super().__init__(config, source, device=device)
        self.solver = self.algorithm.solver(self.flat, self.objective)
        self.solver.set_local_step(config.local_optimizer, config.momentum)
        self.precision = self.flat.precision
        self.precision.note_training()
        self.bound: Client | None = None
        self.face = face  # a plug's client face (fdam_ray/clients/face.py): what a mechanism does here
        face.check_replica(self)

    def new_control_variate(self) -> ClientVariate:
        """The client's own drift-correction state for a client hosted here (None without drift correction)."""
        return self.solver.new_variate()

    def bind(self, client: Client) -> None:
        """Make the solver step with ``client``'s control variate (its own buffers: no copy)."""
        if self.bound is not client:
            self.solver.bind(client.cv)
            self.solver.bind_moments(client.moments)
        self.bound = client

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One local step of the bound client under the run's precision; returns the minibatch objective (a
        detached tensor, no device sync). With fp16 the loss is scaled for the backward pass and the step is
        skipped when a gradient overflowed. The bound client's guard may take the step instead (``dp: sample``:
        DP-SGD, :mod:`fdam_ray.privacy.faces`)."""
        if self.bound is not None:
            taken = self.bound.guard.step(self, x, y, lr)
            if taken is not None:
                return taken
        solver = self.solver
        loss = solver.loss(x, y)
        self.precision.backward(loss)
        self.precision.step(lambda: solver.apply(lr), solver.scaled_params)
        return loss.detach()

    def configure(self, positive_ratio: np.ndarray) -> None:
        """Set the global p of the objective (the same on every client); under a pAUC objective also its global
        normalisers (:func:`fdam_ray.pauc.configure_vector`)."""
        self.objective.configure(positive_ratio, device=self.device)

    def set_reference(self, reference: np.ndarray) -> None:
        """Set the stage's proximal centre v_ref (the same on every client)."""
        self.solver.set_reference(reference)


class Client:
    """A client's own state: its shard, its sampler position and its control variate c^k.

    The model that runs it is a :class:`TrainingReplica` that may serve many
    clients (``replica``); without one the client builds its own. What a client
    holds beyond its shard is one state-sized c^k (with drift correction), so a
    process can host hundreds of them.

    Args:
        config: the client's section of the run's config.
        source: the data source spec; the client calls ``source.client_shard(client_id)``.
        client_id: k in 0..K-1.
        device: where its data live (the replica's device).
        replica: the training replica that runs this client (None: a replica of its own).
        face: a plug's client face, for a replica of its own (a given replica brings its own).
    """

    def __init__(self, config: ClientSection, source: DataSource, client_id: int, *, device: torch.device,
                 replica: TrainingReplica | None = None, face: ClientFace = NO_FACE) -> None:
        self.replica = replica if replica is not None else TrainingReplica(config, source, device=device, face=face)
        self.config = config
        self.device = device
        self.client_id = client_id
        shard = hold_out_validation(source.client_shard(client_id), config.val_fraction, seed=config.seed,
                                    client_id=client_id, task_names=tuple(source.task_names))
        self.train = shard.train.to(device)
        self.test = None if shard.test is None else shard.test.to(device)
        self.val = None if shard.val is None else shard.val.to(device)  # with val_fraction > 0
        check_features(self.train, self.label, "training")
        check_features(self.test, self.label, "test")
        check_features(self.val, self.label, "validation")
        face = self.replica.face
        face.check_client(len(self.train), self.label)
        self.guard = face.guard(client_id, device)  # this client's part of a plug's mechanism
        if config.batch_size > len(self.train):
            log.warning("client %s has %d training samples, fewer than batch_size=%d: each of its batches repeats "
                        "samples", self.label, len(self.train), config.batch_size)
        self.sampler: Any = self.guard.sampler(self.train, lambda: make_sampler(
            self.train, config.batch_size, seed=config.seed * 1_000_003 + client_id, device=device,
            positive_sampling=config.positive_sampling, positive_share=config.positive_share,
            who=f"client {self.label}"))
        self.cv = self.replica.new_control_variate()  # (c_v^k, c_alpha^k) tensors, or None
        self.moments = self.replica.solver.new_moments()  # the local step's momentum / Adam moments, or None
        self.clock = StepClock()  # its step times under the collective's round_deadline (fdam_ray/clients/late.py)
        weights = client_weights(config.client_weighting, [len(self.train)])
        self.weight: float | None = None if weights is None else float(weights[0])  # w_k of the server's means

    @property
    def label(self) -> str:
        """How this client is shown in messages: its name (``client_names``), else its index."""
        return client_label(self.client_id, self.config.client_names)

    @property
    def flat(self) -> FlatModel:
        return self.replica.flat

    @property
    def solver(self) -> LocalSolver:
        """The replica's solver, stepping with this client's control variate."""
        self.replica.bind(self)
        return self.replica.solver

    def info(self) -> ClientInfo:
        positives, labelled = self.train.label_counts()
        return ClientInfo(self.client_id, len(self.train), 0 if self.test is None else len(self.test),
                          positives, labelled, self.flat.state_size)

    def configure(self, positive_ratio: np.ndarray) -> None:
        """Set the global p of the objective (the same on every client)."""
        self.replica.configure(positive_ratio)

    def begin_stage(self, reference: np.ndarray, reset_control_variate: bool) -> None:
        """Start a stage: new proximal centre v_ref (the replica's) and, by default, a zero control variate."""
        self.replica.set_reference(reference)
        if reset_control_variate:
            self.reset_control_variate()

    def reset_control_variate(self) -> None:
        if self.cv is not None:
            for t in self.cv:
                t.zero_()

    def local_round(self, state: GlobalState, plan: RoundPlan, *, copy: bool = True,
                    until: float | None = None) -> ClientUpdate:
        """Run ``plan.steps`` local steps from the global state and return the end point.

        ``copy=False`` returns views of the replica's and the client's buffers (valid until the replica's
        next call), for a caller that folds or serialises the update at once: one copy of the state fewer.
        ``until`` (a ``time.monotonic()`` time): a step that would start after it, or that with the steps left
        would end after it at the client's fastest pace, raises :class:`~fdam_ray.clients.late.LateSteps`
        instead (the client's state is then mid-round: its host puts it back).
        """
        solver, replica = self.solver, self.replica
        self.guard.begin_round(plan.round, plan)
        solver.begin(state)  # client init
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        samples = 0
        x = None
        self.clock.begin(until)
        try:
            for i in range(plan.steps):  # client steps
                self.clock.before_step(plan.steps - i, self.label)
                x, y = self.sampler.next()
                loss_sum += replica.train_step(x, y, plan.lr)
                samples += x.shape[0]
        except RuntimeError as exc:
            refused = features_refused(exc, x, self.config.model, f"client {self.label}")
            if refused is None:
                raise
            raise refused from None
        loss = float(loss_sum) / plan.steps  # waits for the steps on a GPU
        self.clock.end()
        compute_s = time.perf_counter() - start  # the steps alone: loading and exporting the state are transfer
        solver.end(plan.steps, plan.lr, partial=plan.partial)  # client final (a sampled round sends the change)
        stats = StepStats(self.client_id, loss, plan.steps, samples, compute_s, finite=self._finite())
        update = ClientUpdate.from_vectors(solver.export(copy=copy), client_id=self.client_id, stats=stats)
        return self.guard.update(update, state)  # a plug's mechanism acts on what the client sends

    def _finite(self) -> bool:
        """Whether the round's end point and c^k hold no NaN or infinity (one check where they live)."""
        flat = self.flat
        parts = [flat.v, flat.alpha, flat.buffers]
        if self.cv is not None:
            parts += list(self.cv)
        if self.moments is not None:
            parts += list(self.moments)
        return all_finite(parts)

    def evaluate(self, state: GlobalState, split: str = "test") -> Scores | None:
        """Scores of the global model on this client's own test split, or with ``split="val"`` its validation
        part, with ``split="train"`` its training part (a pAUC objective's count pass; None if it has none)."""
        part = {"val": self.val, "train": self.train}.get(split, self.test)
        what = {"val": "validation part", "train": "training part"}.get(split, "test split")
        return None if part is None else self.replica.scores_of(state, part, self.client_id, what)

    def score_histogram(self, state: GlobalState, split: str, bins: int | Binning) -> ScoreHistogram | None:
        """``test_scores: histogram``: what this client sends of the part :meth:`evaluate` scores instead of its
        scores: per task and class the counts of its scores in the intervals of ``bins`` (B: the fixed layout of
        B bins; a :class:`~fdam_ray.scores.histogram.Binning`: the driver's pass-2 layout, from summed counts
        only), and its own exact AUC per task (None if it has no such part). The part is scored afresh on each
        call. Scores with NaN outputs send no counts, only how many there were."""
        from fdam_ray.metrics import task_aucs
        from fdam_ray.scores.histogram import binning_of, score_histograms

        binning = binning_of(bins)
        found = self.evaluate(state, split)
        if found is None:
            return None
        scores, labels = found.scores.reshape(len(found.scores), -1), found.labels.reshape(len(found.labels), -1)
        nan = int(np.isnan(scores).any(axis=1).sum())
        if nan:
            tasks = scores.shape[1]
            return ScoreHistogram(self.client_id, np.zeros((tasks, 2, binning.bins), np.int64),
                                  np.full(tasks, np.nan), len(scores), nan)
        return ScoreHistogram(self.client_id, score_histograms(scores, labels, binning), task_aucs(scores, labels),
                              len(scores))

    @torch.no_grad()
    def score_sums(self, state: GlobalState) -> ScoreSums:
        """Per-task sums of h over the training positives and negatives (for CODA's closed-form alpha)."""
        self.flat.load(state)
        h = self.replica.score(self.train, f"client {self.label}")
        y = self.train.y.cpu().numpy()
        pos, neg = y == 1, y == 0
        return ScoreSums((h * pos).sum(0), pos.sum(0), (h * neg).sum(0), neg.sum(0), self.client_id)

    def set_control_variate(self, *control: np.ndarray) -> None:
        """c^k <- ``control`` (one array per control vector, in declaration order: (c_v^k, c_alpha^k))."""
        if self.cv is not None:
            with torch.no_grad():
                for t, x in zip(self.cv, control, strict=True):
                    t.copy_(torch.from_numpy(np.asarray(x, dtype=np.float32)))

    def control_variate(self) -> tuple[np.ndarray, np.ndarray] | None:
        """c^k as numpy copies (None without drift correction)."""
        if self.cv is None:
            return None
        return self.cv[0].detach().cpu().numpy().copy(), self.cv[1].detach().cpu().numpy().copy()

    def get_state(self) -> ClientState:
        """What a checkpoint needs to continue this client exactly: c^k, the sampler's position, the loss scale
        and the local step's moments."""
        moments = None if self.moments is None else [t.detach().cpu().numpy().copy() for t in self.moments]
        return ClientState(self.client_id, self.control_variate(), self.sampler.get_state(),
                           self.flat.precision.state_dict(), moments)

    def set_state(self, state: ClientState | Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :class:`ClientState`, or a mapping in its file layout)."""
        state = ClientState.of(state)
        if state.client_id != self.client_id:
            raise ValueError(f"state of client {state.client_id} given to client {self.client_id}")
        if state.control is not None:
            self.set_control_variate(*state.control)
        if state.sampler is not None:  # None: a client rebuilt on resume keeps its fresh sampler
            self.sampler.set_state(state.sampler)
        self.flat.precision.load_state_dict(state.scaler)
        moments = state.moments
        if moments is not None and self.moments is not None:  # None: a rebuilt client starts from zero moments
            with torch.no_grad():
                for t, x in zip(self.moments, moments, strict=True):
                    t.copy_(torch.from_numpy(np.asarray(x, dtype=np.float32)))


def host_clients(config: ClientSection, source: DataSource, client_ids: Sequence[int], *,
                 device: torch.device, face: ClientFace = NO_FACE) -> list[Client]:
    """Clients ``client_ids`` hosted by one training replica (built once, shared by all of them, with a plug's
    client ``face``)."""
    replica = TrainingReplica(config, source, device=device, face=face)
    return [Client(config, source, k, device=device, replica=replica) for k in client_ids]


def begin_stage_hosted(clients: Sequence[Client], reference: np.ndarray, reset_control_variates: bool) -> None:
    """Start a stage on clients that share one replica: the proximal centre set once, each c^k zeroed."""
    if clients:
        clients[0].replica.set_reference(reference)
    if reset_control_variates:
        for client in clients:
            client.reset_control_variate()


def run_hosted(clients: Sequence[Client], state: GlobalState, plan: RoundPlan,
               into: PartialSum | None = None, until: float | None = None) -> PartialSum:
    """Run the round of ``clients`` one after another and fold their updates, weighted, into ``into`` (an
    empty partial sum when None).

    Each update is folded as soon as it is made (views of the replica's buffers: no copy), so a host
    holds one partial sum whatever the number of its clients.
    """
    if into is None:
        into = PartialSum.zeros(state, control_variates=state.c_v is not None and clients[0].cv is not None)
    for client in clients:
        into.fold(client.local_round(state, plan, copy=False, until=until), client.weight)
    return into
