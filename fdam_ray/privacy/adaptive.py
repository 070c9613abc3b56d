"""Adaptive clipping of ``dp: client`` (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially private learning
with adaptive clipping", geometric update; docs/algorithms.md s.9 P8).

Each round r every participant k sends, beside its clipped change, one bit 1[||D_k|| <= C_r]. The server releases
the noised fraction of clients within the clip, counted on the centred bits (sensitivity 1/2):

    b_r = (sum_k (1[||D_k|| <= C_r] - 1/2) + N(0, sigma_b^2)) / S + 1/2
    C_{r+1} = C_r exp(-eta_C (b_r - gamma))

for the target quantile gamma (``dp_clip_quantile``), eta_C = ``dp_clip_lr``, sigma_b = ``dp_clip_count_noise``
(default S / 20, the paper's) and S the planned participants (a fixed denominator). C_r is a function of released
values only, so the clients may act by it. The count is a release: the update's noise multiplier becomes

    sigma_z = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)

so that the pair (the update's Gaussian of multiplier sigma_z, the count's of multiplier 2 sigma_b over sensitivity
1/2) composes to one Gaussian of multiplier sigma per round (the RDP and the PLD of Gaussians compose by adding the
inverse squared multipliers); the accountant counts sigma as before. It needs 2 sigma_b > sigma.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fdam_ray.privacy.client_level import ClientLevel

# Domain tag of the count noise's seed sequences ("CQ" in ASCII), apart from the update noise's "DP".
COUNT_DOMAIN = 0x4351


@dataclasses.dataclass(frozen=True)
class AdaptiveClip:
    """The settings of adaptive clipping: gamma, eta_C and sigma_b (count units)."""

    quantile: float
    lr: float
    count_noise: float


def default_count_noise(sampled: int) -> float:
    """sigma_b's default: S / 20 (Andrew et al. 2021: the fraction's noise has std 0.05)."""
    return sampled / 20.0


def update_noise_multiplier(sigma: float, count_noise: float) -> float:
    """sigma_z = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), the update's multiplier that, with the count's, composes to
    sigma (0 when sigma is 0: no noise to share). Raises ValueError in one line naming the fields when
    sigma^-2 - (2 sigma_b)^-2 <= 0, i.e. sigma_b <= sigma / 2."""
    if sigma == 0:
        return 0.0
    rest = sigma**-2 - (2.0 * count_noise) ** -2 if count_noise > 0 else -math.inf
    if not rest > 0:
        raise ValueError(f"dp_clip_count_noise {count_noise:g} must be > dp_noise_multiplier / 2 = {sigma / 2:g} "
                         "(the count's noise takes part of sigma's budget: sigma^-2 - (2 sigma_b)^-2 must be > 0); "
                         "raise dp_clip_count_noise or lower dp_noise_multiplier")
    return rest**-0.5


def composed_multiplier(update_sigma: float, count_noise: float) -> float:
    """The one Gaussian's multiplier the pair composes to: (sigma_z^-2 + (2 sigma_b)^-2)^(-1/2)."""
    return (update_sigma**-2 + (2.0 * count_noise) ** -2) ** -0.5


def count_generator(seed: int | None, round_index: int) -> np.random.Generator:
    """The generator of round ``round_index``'s count noise (the server's, its own stream); ``seed`` None draws
    from fresh OS entropy."""
    key = (COUNT_DOMAIN, round_index)
    if seed is None:
        return np.random.default_rng(np.random.SeedSequence(spawn_key=key))
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=key))


def noised_fraction(bits: list[bool], sampled: int, count_noise: float, rng: np.random.Generator) -> float:
    """b_r: the released fraction of the ``bits`` (clients within the clip) over the planned S, counted on the
    centred bits with N(0, sigma_b^2) added (this module's docstring)."""
    centred = sum(1.0 if b else 0.0 for b in bits) - 0.5 * len(bits)
    noise = float(rng.standard_normal()) * count_noise
    return (centred + noise) / sampled + 0.5


def next_clip(clip: float, fraction: float, settings: AdaptiveClip) -> float:
    """C_{r+1} = C_r exp(-eta_C (b_r - gamma)): the geometric update."""
    return float(clip * math.exp(-settings.lr * (fraction - settings.quantile)))


class AdaptiveClipState:
    """The driver's C_r (the next round's clip) and the last released fraction: kept in the privacy plug's
    checkpoint entry (a resumed run continues the clip sequence), recorded as ``dp_clip`` at each evaluation and
    as ``dp_clip_final`` in the summary. Under a fixed clip it stays ``dp_clip`` and adds nothing."""

    def __init__(self, initial: float, state: dict | None = None) -> None:
        self.value = float(initial)
        self.fraction: float | None = None
        if state is not None and "clip" in state:
            self.value = float(state["clip"])
            self.fraction = state.get("clip_fraction")

    def update(self, fraction: float, settings: AdaptiveClip) -> None:
        """Move C by round r's released fraction b_r."""
        self.fraction = float(fraction)
        self.value = next_clip(self.value, fraction, settings)

    def state(self) -> dict:
        return {"clip": self.value, "clip_fraction": self.fraction} if self.fraction is not None else {}

    def record(self, adaptive: bool) -> dict[str, float]:
        return {"dp_clip": self.value} if adaptive else {}

    def summary(self, settings: ClientLevel) -> dict:
        adaptive = settings.adaptive
        if adaptive is None:
            return {}
        return {"dp_clip_final": self.value, "dp_clip_quantile": adaptive.quantile,
                "dp_clip_count_noise": adaptive.count_noise,
                "dp_update_noise_multiplier": update_noise_multiplier(settings.sigma, adaptive.count_noise)}
