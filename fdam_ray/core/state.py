"""What travels between the driver and the clients, as named fields of flat numpy buffers.

The model state moves as one float32 vector ``v`` = (trainable model parameters,
a, b), one float32 vector of float buffers (BatchNorm running statistics), one
int64 vector of integer buffers (num_batches_tracked) and the dual ``alpha``;
never as a dict of many small tensors (ARCHITECTURE.md, "One round, as data").
"""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Self, cast

import numpy as np


class Rule(enum.Enum):
    """How the server combines one state vector over the clients of a round (docs/algorithms.md s.3)."""

    EXTRAPOLATE = "extrapolate"  # weighted mean, then the server step eta_g (and the algorithm's projection)
    MEAN = "mean"  # weighted mean (BatchNorm running statistics: not optimised, no eta_g)
    MAX = "max"  # elementwise max (integer buffers such as num_batches_tracked)
    CONTROL = "control"  # a control variate: the mean over all clients (SCAFFOLD's rule under sampling)


def _meta(rule: Rule, doc: str, *, corrects: str | None = None) -> dict[str, Any]:
    """A state vector's declaration: how the server combines it, what it is, which vector it corrects."""
    return {"rule": rule, "doc": doc, "corrects": corrects}


@dataclasses.dataclass
class StateVectors:
    """The state vectors, declared once.

    Every record that carries model state (the global state, a client's
    update, a partial sum of updates) is a :class:`StateVectors` with fields of
    its own; the server's sums, the per-node reducers, byte counts and the
    checkpoint walk :func:`vector_fields`, so adding a vector here is the whole
    change. A vector an algorithm does not use is None (the control variates
    without drift correction).
    """

    v: np.ndarray = dataclasses.field(metadata=_meta(Rule.EXTRAPOLATE, "primal variables (w, a, b), float32"))
    alpha: np.ndarray = dataclasses.field(metadata=_meta(Rule.EXTRAPOLATE, "dual variable per task (empty for bce)"))
    buffers: np.ndarray = dataclasses.field(metadata=_meta(Rule.MEAN, "float model buffers (BatchNorm statistics)"))
    counters: np.ndarray = dataclasses.field(metadata=_meta(Rule.MAX, "integer model buffers (num_batches_tracked)"))
    c_v: np.ndarray | None = dataclasses.field(
        default=None, metadata=_meta(Rule.CONTROL, "control variate of v (c or c^k)", corrects="v"))
    c_alpha: np.ndarray | None = dataclasses.field(
        default=None, metadata=_meta(Rule.CONTROL, "control variate of alpha", corrects="alpha"))

    @property
    def nbytes(self) -> int:
        """Bytes of the vectors (what one transfer of this record moves)."""
        return int(sum(x.nbytes for x in self.vectors().values() if x is not None))

    def vectors(self) -> dict[str, np.ndarray | None]:
        """The state vectors by name (None where unused)."""
        return {f.name: getattr(self, f.name) for f in vector_fields()}

    @classmethod
    def from_vectors(cls, vectors: Mapping[str, np.ndarray | None], **fields: Any) -> Self:
        """A record from its state vectors by name (as code walking :func:`vector_fields` builds them, and as
        :meth:`vectors` gives them) and the fields of its own.

        The names are the declared fields, so the vectors are passed as keywords; which of them may be None is
        the declaration's business, checked here no further than by the constructor.
        """
        return cls(**cast(Mapping[str, Any], vectors), **fields)


def vector_fields(rule: Rule | None = None) -> tuple[dataclasses.Field, ...]:
    """The declared state vectors (those combined by ``rule``, when given), in declaration order."""
    return tuple(f for f in dataclasses.fields(StateVectors) if rule is None or f.metadata["rule"] is rule)


def vector_names(rule: Rule | None = None) -> tuple[str, ...]:
    return tuple(f.name for f in vector_fields(rule))


@dataclasses.dataclass(kw_only=True)
class GlobalState(StateVectors):
    """The server's state after a round (r = ``round``): the state vectors plus the round's position.

    ``nbytes`` is what one client receives per round.
    """

    round: int = 0
    iteration: int = 0


@dataclasses.dataclass
class RoundPlan:
    """What the driver asks of every client in one round.

    Attributes:
        round: index of this round (1-based).
        stage: index of the stage the round belongs to (1-based).
        steps: local steps I of this round.
        lr: local step size eta (eta_l) of this round.
        iteration: iterations done before this round.
        partial: only some clients take part (client sampling): each returns the change of its
            control variate, c^k_new - c^k_old, instead of c^k_new (docs/algorithms.md s.3b).
        clip: the round's clip bound C_r when a plug adapts it (adaptive clipping, set by ``Plug.round_plan``);
            0: none (the mechanism's own bound).
    """

    round: int
    stage: int
    steps: int
    lr: float
    iteration: int
    partial: bool = False
    clip: float = 0.0


@dataclasses.dataclass
class StepStats:
    """A client's summary of its round."""

    client_id: int
    loss: float
    steps: int
    samples: int
    compute_s: float  # seconds of the local steps (loading the state and exporting the update excluded)
    finite: bool = True  # every value of the update (v, alpha, buffers, c^k) is finite
    within_clip: bool = True  # dp: client: the change's norm was within the round's clip (adaptive clipping's bit)


@dataclasses.dataclass(kw_only=True)
class ClientUpdate(StateVectors):
    """A client's end point of a round and (with drift correction) its new control variate, or its change in a
    partial round (RoundPlan.partial). ``nbytes`` is what the client sends up."""

    client_id: int
    stats: StepStats


@dataclasses.dataclass
class ClientInfo:
    """What a client reports at start-up: sizes and label counts (for the global p)."""

    client_id: int
    num_train: int
    num_test: int
    positives: np.ndarray  # per task, training labels equal to 1
    labelled: np.ndarray  # per task, training labels that are not missing
    state_size: int  # length of v, checked against the driver's


@dataclasses.dataclass
class Scores:
    """Scores of the global model on some labelled samples (for AUC on the driver)."""

    client_id: int
    scores: np.ndarray  # (n, T) float32
    labels: np.ndarray  # (n, T) float32, NaN = missing


@dataclasses.dataclass
class ScoreHistogram:
    """What a client sends of its labelled samples under ``test_scores: histogram``, in place of :class:`Scores`:
    per task and class, how many of its samples scored in each of B fixed score intervals
    (:func:`fdam_ray.scores.histogram.score_histograms`), and its own AUC per task, computed at the client. No
    per-sample score or label is in it; the driver sums the counts of every client into the pooled AUC.

    ``nan_outputs``: samples whose output was NaN (then ``counts`` are zeros and ``task_auc`` NaN: the driver refuses
    the model, naming it, as it does with scores)."""

    client_id: int
    counts: np.ndarray  # (T, 2, B) int64: [t, 0] negatives, [t, 1] positives per score bin
    task_auc: np.ndarray  # (T,) float64, the client's own exact AUC per task (NaN: a task with one class)
    samples: int  # n, the samples scored (labelled for some task or not)
    nan_outputs: int = 0


@dataclasses.dataclass
class ScoreSums:
    """Per-task sums of scores over a client's positives and negatives (CODA's alpha round)."""

    sum_pos: np.ndarray
    num_pos: np.ndarray
    sum_neg: np.ndarray
    num_neg: np.ndarray
    client_id: int = -1


_CLIENT_KEYS = ("client_id", "sampler", "scaler", "moments", "transfer_residual", "rebuild")


@dataclasses.dataclass(eq=False)
class ClientState(Mapping[str, Any]):
    """A client's own state: what a checkpoint needs to continue it exactly (docs/algorithms.md s.8, R1).

    In files (checkpoints, a Flower site's state) it is the plain mapping :meth:`to_dict` gives, tensors and
    arrays in plain containers (read back with ``torch.load(weights_only=True)``): ``client_id``, each control
    variate by its declared name (:func:`vector_names` of :attr:`Rule.CONTROL`, None without drift correction),
    ``sampler``, ``scaler``, then ``moments`` and ``transfer_residual`` when set. :meth:`from_dict` reads that
    layout, as every fdam-ray wrote it. The record reads as that mapping too (``state["client_id"]``).

    Attributes:
        client_id: k.
        control: c^k, one array per declared control vector in declaration order; None without drift correction.
        sampler: the sampler's position; None for a client rebuilt on a new actor (it keeps its fresh sampler).
        scaler: the fp16 loss scaler's state (None under fp32 and bf16).
        moments: the local optimiser's buffers (momentum, Adam's moments and step); None for plain SGD.
        transfer_residual: with 16-bit transfers and error feedback, the upload residual of the host whose first
            client this is (R11); None otherwise.
        rebuild: a marker alone (no other field set): the client's actor could not be placed when the checkpoint
            was written; a resume rebuilds it as a replaced client.
    """

    client_id: int
    control: tuple[np.ndarray, ...] | None = None
    sampler: Any = None
    scaler: dict | None = None
    moments: list[np.ndarray] | None = None
    transfer_residual: dict[str, np.ndarray] | None = None
    rebuild: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The file's layout of this state (the values as they are, not copied)."""
        if self.rebuild:
            return {"client_id": self.client_id, "rebuild": True}
        names = vector_names(Rule.CONTROL)
        out: dict[str, Any] = {"client_id": self.client_id}
        out.update(zip(names, self.control if self.control is not None else (None,) * len(names), strict=True))
        out.update(sampler=self.sampler, scaler=self.scaler)
        if self.moments is not None:  # absent for plain SGD: a file as before
            out["moments"] = self.moments
        if self.transfer_residual is not None:
            out["transfer_residual"] = self.transfer_residual
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ClientState:
        """A state from the file's layout; a key the layout does not have is a ValueError naming it."""
        names = vector_names(Rule.CONTROL)
        unknown = sorted(str(k) for k in values if k not in _CLIENT_KEYS and k not in names)
        if unknown:
            raise ValueError(f"the state of client {values.get('client_id')} holds {', '.join(unknown)}, which a "
                             "client's state does not")
        if values.get("rebuild"):
            return cls(values["client_id"], rebuild=True)
        control = None if values[names[0]] is None else tuple(values[name] for name in names)
        return cls(values["client_id"], control, values["sampler"], values.get("scaler"), values.get("moments"),
                   values.get("transfer_residual"))

    @classmethod
    def of(cls, state: ClientState | Mapping[str, Any]) -> ClientState:
        """``state`` as a :class:`ClientState` (a mapping in the file's layout is read by :meth:`from_dict`)."""
        return state if isinstance(state, ClientState) else cls.from_dict(state)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


STORE_READERS: set[str] = set()  # the modules that called reads_store_arrays


def reads_store_arrays(module: str) -> None:
    """Silence torch's warning about wrapping a read-only NumPy array, for ``module`` alone.

    Arrays fetched from Ray's object store are read-only. A module that wraps them in tensors only to read
    them (copy sources, finiteness checks) has nothing to learn from that warning, which torch prints once a
    process, in every actor's log. Wrapping such an array in any other module still warns."""
    STORE_READERS.add(module)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                            module=re.escape(module) + "$")
