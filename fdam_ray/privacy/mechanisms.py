"""The Gaussian mechanism's two halves in NumPy: clip a vector to an L2 bound, draw the noise (docs/algorithms.md s.9).

A client's change D (or one sample's gradient) is clipped as one vector,
D * min(1, C / ||D||_2), so each contributes at most C to a sum whatever it
was; the sum then gets N(0, sigma^2 C^2 I), once (server) or as m shares of
variance sigma^2 C^2 / m (``dp_noise_at: clients``; independent shares add up
to the same variance). The norm is taken in float64, and a clipped float32
vector is shrunk by a last few ulps where rounding to float32 would leave it a
hair above C, so the bound the accountant assumes holds exactly. A vector
already within C is returned as it is (no arithmetic), so clipping that does
not bind changes nothing, bit for bit.

Noise is drawn in float64 and rounded once to float32. Its generator comes
from :func:`noise_generator`: a NumPy ``SeedSequence`` keyed by (noise seed,
round, site), in a stream of its own (a domain tag keeps it apart from the
client sampler's ``default_rng([seed, round])``), so a run with a fixed noise
seed replays its noise bit for bit. Whoever knows that seed can regenerate the
noise and subtract it: a replayable seed is for tests and audits; a private
run draws from fresh entropy (``dp_noise_seed: null``, seed None here).
"""

from __future__ import annotations

import math
import secrets

import numpy as np

# Domain tag of the privacy noise's seed sequences ("DP" in ASCII): keeps them apart from other seeded streams.
NOISE_DOMAIN = 0x4450
_SERVER = 0  # the site key of noise the server draws; site k draws under k + 1
_SHRINK_TRIES = 8


def clip_to_norm(vector: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """(vector * min(1, C / ||vector||_2), ||vector||_2): the vector with L2 norm at most ``clip`` and its norm
    before clipping (float64). A vector within the bound is returned unchanged (the same array, not a copy).
    Raises ValueError for a bound that is not > 0 or a vector that is not finite (a diverged client)."""
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip {clip!r} is not allowed (a finite number > 0)")
    values = np.asarray(vector)
    wide = values.astype(np.float64, copy=False)
    norm = float(np.linalg.norm(wide.ravel()))
    if not math.isfinite(norm):
        raise ValueError(f"cannot clip a vector of norm {norm} (it holds inf or nan)")
    if norm <= clip:
        return values, norm
    factor = clip / norm
    for _ in range(_SHRINK_TRIES):
        clipped = (wide * factor).astype(values.dtype)
        if float(np.linalg.norm(clipped.astype(np.float64).ravel())) <= clip:
            return clipped, norm
        factor *= 1.0 - 4.0 * float(np.finfo(values.dtype).eps)  # rounding left it above C: a few ulps less
    raise ValueError(f"could not clip a vector of norm {norm} to {clip} in {values.dtype}")  # pragma: no cover


def noise_generator(seed: int | None, round_index: int, site: int | None = None) -> np.random.Generator:
    """The generator of one round's noise: the server's (``site`` None) or site ``site``'s share. The same
    (seed, round, site) gives the same stream; ``seed`` None draws from fresh OS entropy (not replayable)."""
    if round_index < 0 or (site is not None and site < 0):
        raise ValueError(f"round {round_index} and site {site} must be >= 0")
    key = (NOISE_DOMAIN, round_index, _SERVER if site is None else site + 1)
    if seed is None:
        return np.random.default_rng(np.random.SeedSequence(spawn_key=key))
    if seed < 0:
        raise ValueError(f"noise seed {seed} must be >= 0")
    return np.random.default_rng(np.random.SeedSequence(entropy=seed, spawn_key=key))


def gaussian_noise(shape: int | tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """N(0, std^2) of ``shape``, drawn in float64 and rounded once to float32."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"noise std {std!r} is not allowed (a finite number >= 0)")
    return (rng.standard_normal(shape, dtype=np.float64) * std).astype(np.float32)


def noise_std(sigma: float, clip: float) -> float:
    """sigma * C: the std of the noise the server adds once to the sum of clipped vectors."""
    return sigma * clip


def noise_share_std(sigma: float, clip: float, reporting_sites: int) -> float:
    """sigma * C / sqrt(m): the std of each of m sites' shares, so that the m independent shares sum to
    N(0, sigma^2 C^2)."""
    if reporting_sites < 1:
        raise ValueError(f"reporting_sites {reporting_sites} must be >= 1")
    return sigma * clip / math.sqrt(reporting_sites)


def run_secret(kept: int | None, given: int | None) -> int:
    """A run's privacy secret: the one its checkpoint kept (a resume), else ``dp_noise_seed`` when given
    (replayable), else 128 bits of fresh OS entropy; never the public ``seed``."""
    if kept is not None:
        return int(kept)
    if given is not None:
        return int(given)
    return secrets.randbits(128)
