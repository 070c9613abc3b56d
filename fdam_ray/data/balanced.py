"""Positive oversampling: client batches with a set share of positives (LibAUC's DualSampler, in its idea).

At 1-10 % positives a natural batch of 32 often holds no positive, and the AUC
objectives learn nothing from such a batch but the negatives' side. With
``positive_sampling: balanced`` every batch of B holds n+ = round(share x B)
positives and B - n+ negatives, each drawn from
its own stream of seeded shuffles of the client's positives (negatives), epoch
after epoch: the few positives repeat within an epoch of the negatives, which
is sampling them with replacement across batches. A share that rounds to no
positive (or no negative) in a batch of B, ``positive_share`` <= 0.5 / B or >=
1 - 0.5 / B, is refused (of ``batch_size`` and, with pre-training,
``pretrain_batch_size``): the sampler would hold one anyway and the
objective's p would not be the batches' share. A sample is positive when
any of its labels is 1 (multi-label), negative otherwise. Both streams'
positions are the sampler's state, saved in checkpoints, so a resumed run
draws the same batches. ``natural`` (the default) keeps the plain shuffles of
:class:`fdam_ray.data.base.IndexStream`.

The objective's p is then the batches' positive share, not the data's
positive ratio (unless ``positive_ratio`` sets it): p weighs each class by the
other's share of the samples F is averaged over (docs/algorithms.md s.1), and
with p = share the expectation over balanced batches is p(1-p) times the
class-balanced objective, E[(h-a)^2 | pos] + E[(h-b)^2 | neg] + 2 alpha (m +
E[h | neg] - E[h | pos]) - alpha^2 (LibAUC's AUCM "v2", the form it pairs with
its DualSampler). Keeping the data's p of 0.1 with half-positive batches
weighs the positives' pull nine times the negatives' and drives every score to
1 (a measured test AUC of 0.5 on digits-IH). For multi-label data the share is
that of samples with any positive label, so each task's p is an approximation.
CODA's closed-form stage-end alpha is taken over the clients' whole data with
the objective's p, so ``coda`` takes natural batches only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from fdam_ray.data.base import AnySplit, DatasetSplit, IndexStream, LoaderSampler, TensorSampler
from fdam_ray.settings.sections import FRACTION, Section, fail, setting, shared, warn_once

log = logging.getLogger(__name__)

POSITIVE_SAMPLING = ("natural", "balanced")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSection(Section):
    """The config fields of how a client draws its training batches."""

    name = "sampling"

    positive_sampling: str = setting("natural", "Client batches: natural (shuffles of the client's samples) or "
                                     "balanced (each batch holds positive_share positives, the few positives "
                                     "repeated; LibAUC's DualSampler).", choices=POSITIVE_SAMPLING)
    positive_share: float = setting(0.5, "Share of positives in each client batch with positive_sampling: "
                                    "balanced (also the objective's p, unless positive_ratio is set).",
                                    check=FRACTION)
    batch_size: int = shared()
    algorithm: str = shared()
    pretrain_iterations: int = shared()
    pretrain_batch_size: int | None = shared()

    def check(self) -> None:
        if self.positive_sampling != "balanced":
            if self.positive_share != 0.5:  # a sweep over positive_sampling may mean it; more often a slip
                warn_once(log, f"config field 'positive_share' = {self.positive_share:g} has no effect: "
                          f"positive_sampling = {self.positive_sampling} (only balanced batches take a share of "
                          "positives); set positive_sampling: balanced, or remove positive_share")
            return
        batches = [("batch_size", self.batch_size)]
        if self.pretrain_iterations and self.pretrain_batch_size is not None:  # stage 1 draws these batches
            batches.append(("pretrain_batch_size", self.pretrain_batch_size))
        for name, size in batches:
            if size < 2:
                raise fail(name, size, ">= 2 with positive_sampling: balanced (a batch holds a positive and a "
                           "negative)")
            self._check_share(name, size)
        if self.algorithm == "coda":
            raise fail("positive_sampling", self.positive_sampling, "natural with algorithm coda (its closed-form "
                       "alpha is taken over the clients' whole data)")

    def _check_share(self, name: str, size: int) -> None:
        """A batch of ``size`` holds round(positive_share x size) positives: it must be at least 1 and at most
        size - 1. Otherwise the sampler would hold 1 positive (1 negative) anyway, and the objective's p (the
        share, unless positive_ratio is set) would not be the share its batches hold."""
        positives = round(self.positive_share * size)
        if 1 <= positives <= size - 1:
            return
        raise fail("positive_share", self.positive_share, f"above {0.5 / size:.3g} and below "
                   f"{1 - 0.5 / size:.3g} with {name} = {size}: a balanced batch holds round(positive_share x "
                   f"{name}) = {positives} positives, which the sampler would make "
                   f"{'1' if positives < 1 else f'{size - 1} (1 negative)'}, and then the objective's p would "
                   "not be the batches' share; "
                   f"{'raise' if positives < 1 else 'lower'} positive_share, raise the batch size, or use natural "
                   "batches")


def objective_positive_ratio(config: Any) -> float | None:
    """The p a run's objective is given: ``positive_ratio`` when set, else the batches' positive share under
    balanced sampling, else None (the data's global ratio, from the clients' counts)."""
    if config.positive_ratio is not None or config.positive_sampling != "balanced":
        return config.positive_ratio
    return float(config.positive_share)


class BalancedIndexStream:
    """Batches of indices with ``positives_per_batch`` positives then the rest negatives (the module docstring).

    It has :class:`IndexStream`'s interface (``next``, ``get_state``, ``set_state``, ``batch_size``), so the
    in-memory and the DataLoader samplers take either.
    """

    def __init__(self, positive: torch.Tensor, batch_size: int, share: float, seed: int) -> None:
        self.batch_size = batch_size
        self.positives_per_batch = min(batch_size - 1, max(1, round(share * batch_size)))
        self.pos_index = positive.nonzero().reshape(-1)
        self.neg_index = (~positive).nonzero().reshape(-1)
        self.pos = IndexStream(len(self.pos_index), self.positives_per_batch, seed)
        self.neg = IndexStream(len(self.neg_index), batch_size - self.positives_per_batch, seed + 1)

    def next(self) -> torch.Tensor:
        return torch.cat([self.pos_index[self.pos.next()], self.neg_index[self.neg.next()]])

    def get_state(self) -> dict:
        return {"positives": self.pos.get_state(), "negatives": self.neg.get_state()}

    def set_state(self, state: dict) -> None:
        self.pos.set_state(state["positives"])
        self.neg.set_state(state["negatives"])


def index_stream(labels: torch.Tensor, batch_size: int, seed: int, *, positive_sampling: str = "natural",
                 positive_share: float = 0.5, who: str = "a client") -> IndexStream | BalancedIndexStream:
    """The stream of a client's batches: natural shuffles, or balanced when asked and the client has both
    positives and negatives (a client with one class alone draws naturally, with a warning)."""
    if positive_sampling == "natural" or batch_size == 0:
        return IndexStream(len(labels), batch_size, seed)
    if positive_sampling != "balanced":
        raise ValueError(f"positive_sampling {positive_sampling!r} is not one of {', '.join(POSITIVE_SAMPLING)}")
    positive = (labels.reshape(len(labels), -1).cpu() == 1).any(1)
    n_pos = int(positive.sum())
    if n_pos in (0, len(labels)):
        log.warning("%s has %s training samples: its batches are drawn naturally, not balanced", who,
                    "no positive" if n_pos == 0 else "only positive")
        return IndexStream(len(labels), batch_size, seed)
    return BalancedIndexStream(positive, batch_size, positive_share, seed)


def make_sampler(split: AnySplit, batch_size: int, *, seed: int, device: torch.device,
                 positive_sampling: str = "natural", positive_share: float = 0.5, who: str = "a client"):
    """The sampler that fits the split: tensors in memory, or a DataLoader over a dataset; its batches drawn
    naturally or with a set share of positives (:func:`index_stream`)."""
    stream = index_stream(split.y, batch_size, seed, positive_sampling=positive_sampling,
                          positive_share=positive_share, who=who)
    if isinstance(split, DatasetSplit):
        return LoaderSampler(split, batch_size, seed=seed, device=device, stream=stream)
    return TensorSampler(split, batch_size, seed=seed, stream=stream)
