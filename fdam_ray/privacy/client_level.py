"""Client-level differential privacy (``dp: client``) in the federation: clip, noise, server step, c, accountant.

The rule is docs/algorithms.md s.9 P1-P3. Per round r, with x = (v, alpha) the global state the
round starts from, C = ``dp_clip``, sigma the noise multiplier and S the planned participants:

    client k:  D_k = (v^k - v, alpha^k - alpha) as ONE float32 vector;  D~_k = D_k min(1, C / ||D_k||)
               (dp_noise_at: clients) D~_k += N(0, sigma^2 C^2 / S), generator (dp_noise_seed, r, site k)
    server:    Z = sum_k D~_k  (+ N(0, sigma^2 C^2 I) once, generator (dp_noise_seed, r), dp_noise_at: server)
               v_r = v + eta_g Z_v / S;  alpha_r = alpha + eta_g Z_alpha / S (projected to >= 0 for auc_margin)
               c_v     <- c_v     + (1/K) (-|S_r| c_v     - Z_v     / (I eta))
               c_alpha <- c_alpha + (1/K) (-|S_r| c_alpha + Z_alpha / (I eta))

Under adaptive clipping (:mod:`fdam_ray.privacy.adaptive`) C is the round's C_r, each client's stats carry its bit
1[||D_k|| <= C_r], the reducer releases the noised fraction within the clip (:attr:`PrivateReducer.fraction`) and
the update's noise multiplier is sigma_z (:attr:`ClientLevel.update_sigma`).

S is the planned number (the expected one), never the realised count, so the denominator leaks nothing. The
clients' control variates are not sent (their update carries zeros in their place); the server moves c by
post-processing of Z (the sign of the alpha part follows the client rule c^k_new - c^k = -c + (alpha^k - alpha)
/ (I eta), ascent). BatchNorm statistics are not in the clipped vector, so a model with buffers is refused
(:func:`check_model`): they would be released without noise.

Client side: :func:`private_update`, called by the client face (:class:`~fdam_ray.privacy.faces.ClientLevelFace`)
that the privacy plug puts into every executor's setup, so every executor clips where the clients run. Server
side: :class:`PrivateReducer` (:func:`private_finish`), the round's reducer as the plug builds it. The driver's
bookkeeping (sigma, the accountant, the budget stop, the metrics keys) is :mod:`fdam_ray.privacy.driver`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np

from fdam_ray.algorithms.server import RoundReducer
from fdam_ray.core.state import ClientUpdate, GlobalState, StateVectors
from fdam_ray.privacy.adaptive import (
    AdaptiveClip,
    count_generator,
    default_count_noise,
    noised_fraction,
    update_noise_multiplier,
)
from fdam_ray.privacy.mechanisms import clip_to_norm, gaussian_noise, noise_generator, noise_share_std, noise_std

if TYPE_CHECKING:
    from fdam_ray.privacy.section import PrivacySection

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ClientLevel:
    """The resolved settings of ``dp: client`` that clients and the server act by (sigma solved when a target was
    given)."""

    clip: float
    sigma: float
    noise_at: str  # server | clients
    seed: int | None
    sampled: int  # S, planned participants per round
    num_clients: int  # K
    adaptive: AdaptiveClip | None = None  # adaptive clipping (clip is then the round's C_r), None: a fixed clip

    @property
    def update_sigma(self) -> float:
        """The update noise's multiplier: sigma, or sigma_z under adaptive clipping (the count takes the rest,
        :mod:`fdam_ray.privacy.adaptive`)."""
        if self.adaptive is None:
            return self.sigma
        return update_noise_multiplier(self.sigma, self.adaptive.count_noise)


def client_level(section: PrivacySection, sigma: float) -> ClientLevel:
    """The settings clients and server act by under dp: client: ``section``'s C, noise placement, seed, S and K with
    the resolved ``sigma`` (the driver's, and a Flower site's from the sigma the driver put in its run config)."""
    adaptive = None
    if section.dp_clip_quantile is not None:
        count_noise = section.dp_clip_count_noise
        adaptive = AdaptiveClip(quantile=section.dp_clip_quantile, lr=section.dp_clip_lr,
                                count_noise=default_count_noise(section.sampled_clients) if count_noise is None
                                else float(count_noise))
        update_noise_multiplier(float(sigma), adaptive.count_noise)  # refuses sigma_b <= sigma / 2, one line
    return ClientLevel(clip=section.dp_clip, sigma=float(sigma), noise_at=section.dp_noise_at,
                       seed=section.dp_noise_seed, sampled=section.sampled_clients, num_clients=section.num_clients,
                       adaptive=adaptive)


def check_model(buffers: np.ndarray, counters: np.ndarray) -> None:
    """Refuse a model with buffers (BatchNorm): its running statistics would leave the sites unclipped and
    unnoised. One line."""
    if buffers.size or counters.size:
        raise ValueError(f"dp: client needs a model without BatchNorm buffers (this one has {buffers.size} float "
                         f"and {counters.size} integer buffer values, which would be released without noise); use "
                         "model: cnn_gn, mlp or linear")


def check_transport(transport: str, transfer_precision: str) -> None:
    """Refuse what the DP path does not run: the collective transport (the server step runs on the members) and
    16-bit transfers (the rounding would act on the noised sum's inputs). One line each."""
    if transport == "collective":
        raise ValueError("dp: client does not run with transport: collective (the server step runs on the members, "
                         "without the noise); use the default transport")
    if transfer_precision != "fp32":
        raise ValueError(f"dp: client needs transfer_precision: fp32 (not {transfer_precision}): the rounded "
                         "transfers are not part of the clipped change")


def private_update(update: ClientUpdate, start: StateVectors, dp: ClientLevel) -> ClientUpdate:
    """What client k sends under dp: client: its clipped change (v^k - v, alpha^k - alpha) as one vector, in v and
    alpha, with its noise share under dp_noise_at: clients; zeros in place of its control variate (not sent)."""
    check_model(update.buffers, update.counters)
    n = update.v.size
    change = np.concatenate([np.subtract(update.v, start.v, dtype=np.float32),
                             np.subtract(update.alpha, start.alpha, dtype=np.float32)])
    clipped, norm = clip_to_norm(change, dp.clip)
    if dp.noise_at == "clients":
        round_index = int(getattr(start, "round", 0)) + 1
        share = gaussian_noise(clipped.size, noise_share_std(dp.update_sigma, dp.clip, dp.sampled),
                               noise_generator(dp.seed, round_index, site=update.client_id))
        clipped = clipped + share
    stats = update.stats  # adaptive clipping: with the bit 1[||D_k|| <= C_r] the server counts
    if dp.adaptive is not None:
        stats = dataclasses.replace(stats, within_clip=norm <= dp.clip)
    control = {name: None if getattr(update, name) is None else np.zeros_like(getattr(update, name))
               for name in ("c_v", "c_alpha")}
    return ClientUpdate(v=np.array(clipped[:n]), alpha=np.array(clipped[n:]), buffers=update.buffers,
                        counters=update.counters, **control, client_id=update.client_id, stats=stats)


@dataclasses.dataclass
class ServerRound:
    """What the server's DP step of one round needs beyond the sums: the settings, the round, its eta and I."""

    dp: ClientLevel
    round: int
    lr: float


def private_finish(sums: StateVectors, count: int, prev: GlobalState, private: ServerRound, *, global_lr: float,
                   alpha_nonnegative: bool, steps: int) -> dict[str, np.ndarray | None]:
    """The new state's vectors from the sums of clipped changes (this module's docstring), float32 except c (formed
    in float64, stored in float32)."""
    dp = private.dp
    n = prev.v.size
    total = np.concatenate([np.asarray(sums.v, dtype=np.float32), np.asarray(sums.alpha, dtype=np.float32)])
    if dp.noise_at == "server":
        total = total + gaussian_noise(total.size, noise_std(dp.update_sigma, dp.clip),
                                       noise_generator(dp.seed, private.round))
    mean = total * np.float32(1.0 / dp.sampled)
    step = mean * np.float32(global_lr)
    v = prev.v + step[:n]
    alpha = prev.alpha + step[n:]
    if alpha_nonnegative:
        np.maximum(alpha, 0, out=alpha)
    out: dict[str, np.ndarray | None] = {"v": v, "alpha": alpha, "buffers": prev.buffers.copy(),
                                         "counters": prev.counters.copy(), "c_v": None, "c_alpha": None}
    if prev.c_v is not None and prev.c_alpha is not None:
        scale = 1.0 / (steps * private.lr)
        z = total.astype(np.float64)
        out["c_v"] = (prev.c_v + (-count * prev.c_v.astype(np.float64) - z[:n] * scale) / dp.num_clients
                      ).astype(np.float32)
        out["c_alpha"] = (prev.c_alpha + (-count * prev.c_alpha.astype(np.float64) + z[n:] * scale)
                          / dp.num_clients).astype(np.float32)
    return out


class PrivateReducer(RoundReducer):
    """dp: client's server face: the round's reducer (``inner``, before anything is folded) whose sums are the
    clipped changes; :meth:`finish` is :func:`private_finish` (noise at the server, the planned S as denominator,
    c by post-processing)."""

    def __init__(self, inner: RoundReducer, private: ServerRound) -> None:
        if inner.count:
            raise RuntimeError("a private reducer wraps a round's reducer before any update is folded")
        super().__init__(inner.previous, global_lr=inner.global_lr, alpha_nonnegative=inner.alpha_nonnegative,
                         control_variates=inner.control_variates, weights=inner.weights,
                         partial_total=inner.partial_total, sums=inner.sums)
        self.private = private
        self.fraction: float | None = None  # adaptive clipping: b_r, the released fraction within the clip

    def finish(self, *, steps: int) -> GlobalState:
        self._finishing(empty=self.private.dp.noise_at == "server")  # no client (a Poisson draw): the noise alone
        prev = self.previous
        adaptive = self.private.dp.adaptive
        if adaptive is not None:
            dp = self.private.dp
            self.fraction = noised_fraction([st.within_clip for st in self.stats], dp.sampled, adaptive.count_noise,
                                            count_generator(dp.seed, self.private.round))
        return GlobalState.from_vectors(
            private_finish(self.sums, self.sums.count, prev, self.private, global_lr=self.global_lr,
                           alpha_nonnegative=self.alpha_nonnegative, steps=steps),
            round=prev.round + 1, iteration=prev.iteration + steps)
