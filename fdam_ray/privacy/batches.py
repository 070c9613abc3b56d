"""The batches of ``dp: sample``: each local step draws its own batch, the way the site's accountant counts it.

The per-site accountant (:meth:`fdam_ray.privacy.accountant.Accountant.for_site`)
gets its amplification by sampling from one of two events, and it holds only
when the batches are drawn that way (shuffled epochs, the project's
:class:`fdam_ray.data.base.IndexStream`, are neither: Chua et al. 2024, "How
Private are DP-SGD Implementations?", show the gap is real):

- ``dp_sampling: poisson``: each step takes every training sample of the site
  independently with probability q = B / n_k (B the planned ``batch_size``).
  The batch size varies, Binomial(n_k, q), mean B; it may be 0, and then the
  step is the noise alone. The step divides by the planned B whatever the draw
  (:func:`fdam_ray.privacy.dpsgd.private_gradient`), so the denominator tells
  nothing of who was drawn.
- ``dp_sampling: fixed``: each step takes B distinct samples uniformly at
  random, independently of every other step (no epochs: a sample may come
  back in the next step, or not for many).

``batch_size`` 0 ('full', q = 1) keeps the plain whole-set sampler: every step
takes every sample, which is what the accountant's full batch counts (allowed
with ``fixed`` only, :mod:`fdam_ray.privacy.section`).

Whose randomness. Amplification by sampling assumes the adversary does not
know which samples a step took, and the server is one of the adversaries. So
the draw is keyed like the step's noise, never by the run's ``seed`` (which
the server knows): by the site's :class:`~fdam_ray.privacy.dpsgd.SampleNoise`,
whose secret is ``dp_noise_seed`` when given (replayable: tests, audits;
whoever reads it knows the batches) or 128 bits of fresh OS entropy per
client otherwise. Step t of round r of site k draws from a CPU generator
seeded by SeedSequence(entropy=that secret, spawn_key=(0x4442 "DB", r, k + 1,
t)), a stream apart from the noise's (0x4453 "DS") and from every stream of
the run's seed. A fixed ``dp_noise_seed`` thus replays every batch bit for
bit, on any device, and a resumed run draws the same batches without any
sampler state in the checkpoint: the key is (round, step). ``torch.Generator``
is not a cryptographically secure source (see dpsgd's module docstring).

Samples read from disk (:class:`~fdam_ray.data.base.DatasetSplit`) are read in
this process, one step's batch at a time, without DataLoader workers: a worker
reading ahead would draw batches under the keys of later steps and rounds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fdam_ray.data.base import AnySplit, DatasetSplit, loader_errors
from fdam_ray.privacy.dpsgd import SampleNoise

log = logging.getLogger(__name__)

__all__ = ["SAMPLINGS", "PrivateBatches", "PrivateSampler", "private_sampler"]

SAMPLINGS = ("fixed", "poisson")


class PrivateBatches:
    """The indices each step of one site takes (this module's docstring), keyed by ``keys``.

    Args:
        num_samples: n_k >= 1, the site's training samples.
        batch_size: B, 1 <= B <= n_k, the planned batch size.
        sampling: ``poisson`` (each sample with probability B / n_k) or ``fixed`` (B distinct, uniform).
        keys: the site's secret randomness; its round is set by :meth:`SampleNoise.begin_round`.
    """

    def __init__(self, num_samples: int, batch_size: int, sampling: str, keys: SampleNoise) -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"dp_sampling {sampling!r} is not one of {', '.join(SAMPLINGS)}")
        if num_samples < 1:
            raise ValueError("a client has no training samples")
        if not 1 <= batch_size <= num_samples:
            raise ValueError(f"dp: sample draws batches of 1 to n_k = {num_samples} samples, not {batch_size}")
        self.num_samples, self.batch_size, self.sampling, self.keys = num_samples, batch_size, sampling, keys
        self.rate = batch_size / num_samples  # q

    def next(self) -> torch.Tensor:
        """The next step's indices (int64, on the CPU): increasing for ``poisson``, in draw order for ``fixed``."""
        generator = self.keys.next_batch_generator()
        if self.sampling == "poisson":  # float64 uniforms: each sample in with probability q to 2^-53
            take = torch.rand(self.num_samples, generator=generator, dtype=torch.float64) < self.rate
            return take.nonzero().reshape(-1)
        return torch.randperm(self.num_samples, generator=generator)[: self.batch_size]


class PrivateSampler:
    """A client's sampler under ``dp: sample``: :class:`PrivateBatches` read from its split (the
    :class:`~fdam_ray.data.base.TensorSampler` interface: ``next``, ``get_state``, ``set_state``)."""

    def __init__(self, split: AnySplit, batches: PrivateBatches, *, device: torch.device) -> None:
        self.split, self.batches, self.device = split, batches, device
        self._shapes: tuple[torch.Size, torch.Size] | None = None  # of one sample read from disk (empty draws)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.batches.next()
        if not isinstance(self.split, DatasetSplit):
            index = index.to(self.split.x.device)
            return self.split.x[index], self.split.y[index]
        return self._read(index.tolist())

    def _read(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        dataset = self.split.dataset  # type: ignore[union-attr]
        if not index:
            x_shape, y_shape = self._sample_shapes()
            x, y = torch.empty((0, *x_shape)), torch.empty((0, *y_shape))
        else:
            with loader_errors():
                items = [dataset[i] for i in index]
            x = torch.stack([torch.as_tensor(item[0]) for item in items])
            y = torch.stack([torch.as_tensor(item[1], dtype=torch.float32) for item in items])
            self._shapes = x.shape[1:], y.shape[1:]
        return x.to(self.device), y.to(self.device)

    def _sample_shapes(self) -> tuple[torch.Size, torch.Size]:
        """The shapes of one sample, read once (sample 0) with the augmentation generator's state kept, so an
        empty draw changes no later batch."""
        if self._shapes is None:
            augment = self._augment_generator()
            saved = None if augment is None else augment.get_state()
            x, y = self.split.dataset[0]  # type: ignore[union-attr]
            if augment is not None and saved is not None:
                augment.set_state(saved)
            self._shapes = torch.as_tensor(x).shape, torch.as_tensor(y).shape
        return self._shapes

    def _augment_generator(self) -> torch.Generator | None:
        # as LoaderSampler: a dataset that augments from its own generator exposes it as ``generator``
        return getattr(getattr(self.split, "dataset", None), "generator", None)

    def get_state(self) -> dict[str, Any]:
        """Nothing of the draws (their key is (round, step)); the augmentation generator of a dataset with one."""
        augment = self._augment_generator()
        return {"dp_sampling": self.batches.sampling, "augment": None if augment is None else augment.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        augment = self._augment_generator()
        if augment is not None and state.get("augment") is not None:
            augment.set_state(state["augment"])


def private_sampler(split: AnySplit, batch_size: int, sampling: str, keys: SampleNoise, *,
                    device: torch.device) -> PrivateSampler:
    """The sampler of a ``dp: sample`` client with a planned batch of ``batch_size`` >= 1 (``'full'`` keeps the
    plain whole-set sampler, see the module docstring)."""
    return PrivateSampler(split, PrivateBatches(len(split), batch_size, sampling, keys), device=device)
