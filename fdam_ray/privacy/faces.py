"""The client faces of differential privacy (:class:`~fdam_ray.clients.face.ClientFace`): what a client does
differently under each ``dp`` mode, in one object that travels to every client.

- :class:`ClientLevelFace` (``dp: client``): each client's change of a round is clipped as one vector and, with
  ``dp_noise_at: clients``, gets its noise share (:func:`~fdam_ray.privacy.client_level.private_update`); its
  control variate is not sent. The server's half is the private reducer (:mod:`fdam_ray.privacy.driver`). Under
  adaptive clipping (:mod:`fdam_ray.privacy.adaptive`) the round's clip C_r arrives in the round's plan and the
  client adds its bit 1[||D_k|| <= C_r] to its stats.
- :class:`SampleLevelFace` (``dp: sample``): each local step is DP-SGD (per-sample gradients clipped, the batch
  sum noised, :func:`~fdam_ray.privacy.dpsgd.private_gradient`), each step's batch drawn the way the site's
  accountant counts it (:mod:`fdam_ray.privacy.batches`), both keyed by the site's own secret
  (:class:`~fdam_ray.privacy.dpsgd.SampleNoise`).

The faces carry the resolved settings (sigma solved by the driver when a target epsilon was given), typed, from
the driver (or a Flower site's run config) to the mechanism; no executor reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fdam_ray.clients.face import ClientFace, ClientGuard
from fdam_ray.core.state import ClientUpdate, GlobalState, RoundPlan
from fdam_ray.privacy.batches import private_sampler
from fdam_ray.privacy.client_level import ClientLevel, private_update
from fdam_ray.privacy.dpsgd import (
    SampleNoise,
    check_private_batch,
    check_private_replica,
    per_sample_loss,
    private_gradient,
)


@dataclasses.dataclass(frozen=True)
class ClientLevelFace(ClientFace):
    """``dp: client`` on the clients: the clip (and noise share) of each client's change."""

    settings: ClientLevel
    sends_changes = True  # a class attribute (not a field): the update is the clipped change, c^k not sent

    def guard(self, client_id: int, device: torch.device) -> ClientGuard:
        return _ClippedChange(self.settings)


class _ClippedChange(ClientGuard):
    """One client's clip; under adaptive clipping the round's C_r comes in the round's plan (the driver's, a
    function of released values only)."""

    def __init__(self, settings: ClientLevel) -> None:
        self.settings = settings
        self.round_settings = settings

    def begin_round(self, round_index: int, plan: RoundPlan | None = None) -> None:
        if self.settings.adaptive is None:
            return
        if plan is None or not plan.clip > 0:
            raise RuntimeError(f"round {round_index}: adaptive clipping needs the round's clip in its plan (the "
                               "executor did not pass the plan the driver set)")
        self.round_settings = dataclasses.replace(self.settings, clip=float(plan.clip))

    def update(self, update: ClientUpdate, start: GlobalState) -> ClientUpdate:
        return private_update(update, start, self.round_settings)


@dataclasses.dataclass(frozen=True)
class SampleLevelFace(ClientFace):
    """``dp: sample`` on the clients: DP-SGD steps on secretly drawn batches.

    Attributes:
        clip: C, the L2 bound of one sample's gradient (v and alpha as one vector).
        sigma: the noise multiplier (the batch sum gets N(0, sigma^2 C^2)).
        seed: the noise's secret (``dp_noise_seed``), or None for fresh entropy at each site.
        sampling: ``poisson`` or ``fixed``: how each step draws its batch.
        batch_size: B, the planned batch (0: the full batch).
        positive_sampling: the run's batch composition (only ``natural`` keeps the accountant's rate).
    """

    clip: float
    sigma: float
    seed: int | None
    sampling: str
    batch_size: int
    positive_sampling: str

    def check_replica(self, replica: Any) -> None:
        check_private_replica(replica.flat.model, replica.precision, positive_sampling=self.positive_sampling,
                              noise_multiplier=self.sigma)

    def check_client(self, num_train: int, label: str) -> None:
        check_private_batch(self.batch_size, num_train, f"client {label}")

    def guard(self, client_id: int, device: torch.device) -> ClientGuard:
        return _PrivateSteps(self, SampleNoise(self.seed, client_id, device=device), device)


class _PrivateSteps(ClientGuard):
    """One site's DP-SGD: its noise and batch keys (round, step), its batches, its steps."""

    def __init__(self, face: SampleLevelFace, noise: SampleNoise, device: torch.device) -> None:
        self.face, self.noise, self.device = face, noise, device
        self._losses: dict[int, Any] = {}  # the per-sample loss of each replica's objective

    def begin_round(self, round_index: int, plan: RoundPlan | None = None) -> None:
        self.noise.begin_round(round_index)

    def sampler(self, split: Any, default: Callable[[], Any]) -> Any:
        if self.face.batch_size <= 0:  # the full batch: every step takes every sample (accounted so)
            return default()
        return private_sampler(split, self.face.batch_size, self.face.sampling, self.noise, device=self.device)

    def step(self, replica: Any, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor | None:
        loss = self._losses.get(id(replica.objective))
        if loss is None:
            loss = self._losses[id(replica.objective)] = per_sample_loss(replica.objective)
        flat, face = replica.flat, self.face
        private = private_gradient(flat.model, flat.a, flat.b, flat.alpha, x, y, loss, clip=face.clip,
                                   noise_multiplier=face.sigma, batch_size=face.batch_size or x.shape[0],
                                   generator=self.noise.next_generator(), precision=replica.precision)
        with torch.no_grad():
            flat.grad.copy_(private.v)
            flat.alpha_grad.copy_(private.alpha)
        replica.solver.apply(lr)
        return private.loss
