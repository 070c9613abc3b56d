"""Which clients take part in a round, and how much each one weighs (docs/algorithms.md s.3b, s.8b).

Client sampling: round r draws S of the K clients uniformly without
replacement (fixed size), or, under ``dp: client`` with ``dp_sampling:
poisson``, each client k joins round r on its own iff u_{k,r} < q = S / K, with
u_{k,r} uniform on [0, 1) (Poisson: the realised set has S clients on average,
and may be empty). With S = K (the default) every client takes part and nothing
is drawn. Whose randomness draws them is a :class:`ClientSampler`'s key:

- without differential privacy, the run's ``seed``: the generator
  ``default_rng([seed, r])``, so a resumed run draws the same sets and anyone
  with the config can replay them;
- under any ``dp`` mode, the privacy secret (``dp_noise_seed`` when given,
  else 128 bits of fresh entropy kept in the driver's checkpoint): the
  generator ``SeedSequence(entropy=secret, spawn_key=(0x4353 "CS", r))``, a
  stream apart from the privacy noise's and from every stream of ``seed``;
  the Poisson draw's u_{k,r} come from ``spawn_key=(0x4350 "CP", r)``, one
  uniform per client in client order. A Poisson draw is only ever keyed by
  the secret (it exists for the accountant's Poisson-subsampled Gaussian).
  The accountant's amplification by sampling assumes that whoever reads the
  released model does not know which clients a round drew; ``seed`` is in
  config.yaml and known to every party, so a draw from it would leave those
  parties the un-amplified bound over the rounds a site joined.

Client weights: ``uniform`` (the paper: f = (1/K) sum_k f_k) or ``samples``
(w_k = n_k, so f is the objective of the pooled data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Domain tag of the secret client draw's seed sequences ("CS" in ASCII): apart from the noise's (0x4450, 0x4453)
# and the batches' (0x4442) streams of the same secret.
CLIENT_DRAW_DOMAIN = 0x4353
# Domain tag of the secret Poisson draw ("CP"): apart from the fixed-size draw's and the streams above.
CLIENT_POISSON_DOMAIN = 0x4350


def sample_clients(seed: int, round_: int, num_clients: int, clients_per_round: int | None) -> list[int] | None:
    """S_r drawn from the public ``seed``, in increasing order, or None when every client takes part."""
    if clients_per_round is None or clients_per_round >= num_clients:
        return None
    return _draw(np.random.default_rng([seed, round_]), num_clients, clients_per_round)


def secret_sample_clients(secret: int, round_: int, num_clients: int,
                          clients_per_round: int | None) -> list[int] | None:
    """S_r drawn from the privacy ``secret`` (this module's docstring), in increasing order, or None when every
    client takes part."""
    if clients_per_round is None or clients_per_round >= num_clients:
        return None
    if secret < 0 or round_ < 0:
        raise ValueError(f"secret and round {round_} must be >= 0")
    rng = np.random.default_rng(np.random.SeedSequence(entropy=secret, spawn_key=(CLIENT_DRAW_DOMAIN, round_)))
    return _draw(rng, num_clients, clients_per_round)


def poisson_sample_clients(secret: int, round_: int, num_clients: int,
                           clients_per_round: int | None) -> list[int] | None:
    """S_r of the Poisson draw keyed by the privacy ``secret`` (this module's docstring): the clients k with
    u_{k,r} < S / K, in increasing order, possibly none; None when every client takes part (S >= K)."""
    if clients_per_round is None or clients_per_round >= num_clients:
        return None
    if secret < 0 or round_ < 0 or clients_per_round < 1:
        raise ValueError(f"secret and round {round_} must be >= 0, clients_per_round {clients_per_round} >= 1")
    rng = np.random.default_rng(np.random.SeedSequence(entropy=secret, spawn_key=(CLIENT_POISSON_DOMAIN, round_)))
    u = rng.random(num_clients)
    return [int(k) for k in np.flatnonzero(u < clients_per_round / num_clients)]


def _draw(rng: np.random.Generator, num_clients: int, clients_per_round: int) -> list[int]:
    return sorted(int(k) for k in rng.choice(num_clients, size=clients_per_round, replace=False))


@dataclasses.dataclass(frozen=True)
class ClientSampler:
    """Round r's clients (:meth:`draw`): S of K, keyed by the public ``seed`` or, with ``secret`` set, by the
    privacy secret (never shown in a repr); with ``poisson`` (secret only) each client joins with probability
    S / K."""

    num_clients: int
    clients_per_round: int | None
    seed: int = dataclasses.field(repr=False)
    secret: bool = False
    poisson: bool = False

    def __post_init__(self) -> None:
        if self.poisson and not self.secret:
            raise ValueError("a Poisson client draw is keyed by the privacy secret (secret=True), never the seed")

    def draw(self, round_: int) -> list[int] | None:
        """S_r in increasing order (a Poisson draw's may be empty), or None when every client takes part."""
        if self.poisson:
            return poisson_sample_clients(self.seed, round_, self.num_clients, self.clients_per_round)
        if self.secret:
            return secret_sample_clients(self.seed, round_, self.num_clients, self.clients_per_round)
        return sample_clients(self.seed, round_, self.num_clients, self.clients_per_round)


def client_weights(weighting: str, num_train: Sequence[int]) -> np.ndarray | None:
    """w_k by client id: None for ``uniform`` (plain means), the training-set sizes n_k for ``samples``."""
    if weighting == "uniform":
        return None
    if weighting == "samples":
        return np.asarray(num_train, dtype=np.float64)
    raise ValueError(f"client_weighting {weighting!r} is not known (uniform, samples)")
