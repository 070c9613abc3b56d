"""Sample-level DP-SGD for one client's local step (docs/algorithms.md s.9, ``dp: sample``).

What it protects: one training sample of a site. Each local step the site
takes on its own data is a Gaussian mechanism whose sensitivity to one sample
is bounded by clipping; the site's accountant composes its steps.

The step's gradient over the whole optimised vector u = (w, a, b, alpha)
(network weights, the AUC objective's extra primal a, b and its dual alpha):

    g_i      = grad_u l(u; z_i)                       per sample i of the batch (l: :func:`per_sample_loss`)
    g~_i     = g_i * min(1, C / ||g_i||_2)            clipped as ONE vector over (w, a, b, alpha)
    g        = (sum_i g~_i + N(0, sigma^2 C^2 I)) / B  B: the planned batch size, not the realised one
    g_v, g_alpha = the (w, a, b) and alpha parts of g

and the solver's step of s.2 then uses them unchanged:

    v      <- v - eta (g_v + gamma (v - v_ref) + wd v - c_v^k + c_v)     (momentum, element-wise clip: on top)
    alpha  <- alpha + eta (g_alpha - c_alpha^k + c_alpha),  then max(alpha, 0) for auc_margin

g_v is a gradient (the step descends), g_alpha is the gradient of the same
loss in alpha (the step ascends: it is added). The terms beyond g are not
privatised because they do not read this step's data: the proximal pull and
weight decay are functions of the current iterate and of v_ref (the
server's released state); the control variates c (released by the server)
and c^k (computed by the client from its own earlier iterates, themselves
built from noised gradients) and the momentum buffer are post-processing of
earlier releases; the element-wise clip of g_w is post-processing of g.
Dividing by the planned B rather than the number of samples drawn keeps the
denominator from revealing whether a sample took part (under Poisson
sampling the realised size varies).

Why torch.func and not Opacus: torch.func (``functional_call`` + ``vmap(grad)``)
is part of torch, so no dependency is added; it takes the parameters as
arguments, so it works with :class:`fdam_ray.core.flat.FlatModel`, whose
parameters are views of one flat vector (Opacus wraps the module, hooks its
layers and keeps its own ``grad_sample`` per parameter, which the flat
binding and our own update do not use); and a, b and alpha, which are not
module parameters, enter as arguments of the same per-sample function, so the
alpha part is clipped together with (w, a, b) in one vector, as s.9 P4 says,
where Opacus clips only what its optimizer holds.

BatchNorm is refused (:func:`check_private_model`): in train mode it
normalises each sample by statistics of the whole batch, so one sample's
gradient depends on the others and clipping it no longer bounds one sample's
effect; its running statistics would also be released without noise. Frozen
(eval-mode) statistics would make ``cnn`` another network (the normalisation
of a fresh model is the identity). The built-in ``linear`` and ``mlp`` have no
BatchNorm, nor has ``cnn_gn`` (``cnn`` with GroupNorm); ``cnn``, ``resnet20``, ``densenet121`` and
``densenet161`` do.

Multi-label: the per-sample loss is (1/T) sum over the sample's labelled tasks
of F_t. With every label present its batch mean is the objective's batch value;
with missing labels the objective divides task t by n_t, the batch's number of
labels of task t, which depends on the other samples, so a per-sample loss
cannot; tasks are then weighted by their labelled share n_t / B. For every task
the stationary a, b and alpha are the objective's.

The noise comes from a ``torch.Generator``, which is not a cryptographically
secure source; the accounting assumes exact Gaussian noise. Each step's
generator is seeded afresh by :class:`SampleNoise` from a NumPy ``SeedSequence``
keyed by (noise seed, round, site, step), so a fixed ``dp_noise_seed`` replays
every step's noise bit for bit without checkpointing a generator, and without one
each site draws 128 bits of OS entropy that never leave it. The run's ``seed`` is
never used: the server knows it, and whoever knows the seed can subtract the noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F_nn
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fdam_ray.features.precision import Precision
from fdam_ray.objectives import Objective, number_argument, whole_argument

__all__ = ["SAMPLE_BATCH_DOMAIN", "SAMPLE_NOISE_DOMAIN", "PerSampleLoss", "PrivateGradient", "SampleNoise",
           "check_private_batch", "check_private_model", "check_private_replica", "noise_std",
           "per_sample_loss", "private_gradient"]

# Domain tag of the per-step noise's seed sequences ("DS" in ASCII): apart from the client-level noise's
# (fdam_ray.privacy.mechanisms.NOISE_DOMAIN) and from every stream seeded by the run's seed.
SAMPLE_NOISE_DOMAIN = 0x4453
# Domain tag of the per-step batch draws' seed sequences ("DB"): the batch a step takes is keyed like its noise
# (same secret entropy, same round, site and step) but from its own stream (fdam_ray/privacy/batches.py).
SAMPLE_BATCH_DOMAIN = 0x4442

# l(logits (T,), labels (T,) with NaN for missing, a (T,), b (T,), alpha (T,)) -> the sample's loss (a scalar)
PerSampleLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_loss(objective: Objective) -> PerSampleLoss:
    """The loss of one sample under ``objective`` (p and margin read when it is called), written for ``vmap``:
    no branch on values. For a sample labelled on every task it is F of the objective averaged over the tasks;
    a missing label adds zero to the sum over the T tasks (see the module docstring)."""

    def auc(logits: torch.Tensor, labels: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            alpha: torch.Tensor) -> torch.Tensor:
        p = objective.p
        if p is None:
            raise RuntimeError("set_positive_ratio() must be called before the AUC objective is used")
        h = torch.sigmoid(logits)
        valid = (~torch.isnan(labels)).to(h.dtype)
        pos = (labels == 1).to(h.dtype)
        neg = (labels == 0).to(h.dtype)
        q = p * (1 - p)
        per = (1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg
        cross = p * h * neg - (1 - p) * h * pos
        if objective.name == "auc_square":
            per = per + 2 * (1 + alpha) * cross
        else:
            per = per + 2 * alpha * (q * objective.margin * valid + cross)
        per = per - q * alpha**2 * valid
        return per.sum() / logits.shape[-1]

    def bce(logits: torch.Tensor, labels: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            alpha: torch.Tensor) -> torch.Tensor:
        valid = (~torch.isnan(labels)).to(logits.dtype)
        per = F_nn.binary_cross_entropy_with_logits(logits, torch.nan_to_num(labels, nan=0.0), reduction="none")
        return (per * valid).sum() / logits.shape[-1]

    return bce if objective.name == "bce" else auc


def check_private_model(model: nn.Module) -> None:
    """Refuse a network whose samples interact in the forward pass (BatchNorm), naming the first such layer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            kind = type(module).__name__
            raise ValueError(
                f"dp: sample: layer {name or '(the model)'!r} is a {kind}, which normalises each sample by the "
                "statistics of its whole batch, so a per-sample gradient is not one sample's alone (and its running "
                "statistics would be released without noise); use a network without BatchNorm (model=cnn_gn, the cnn "
                "with GroupNorm; model=linear or model=mlp) or your own factory with GroupNorm or LayerNorm in its "
                f"place (e.g. nn.GroupNorm(min(32, c), c) for nn.{kind}(c))")


@dataclasses.dataclass(frozen=True)
class PrivateGradient:
    """The noised mean gradient of one step.

    Attributes:
        v: (num_weights + 2T,) the (w, a, b) part, in :class:`FlatModel`'s layout (its ``grad`` vector): descend.
        alpha: (T,) the alpha part: ascend.
        loss: the sum of the per-sample losses over the planned B (the batch mean when B samples were drawn;
            under Poisson sampling an unbiased estimate of the site's mean loss, 0 for an empty draw), NOT
            privatised: for the site's own logs, never to release.
    """

    v: torch.Tensor
    alpha: torch.Tensor
    loss: torch.Tensor


def private_gradient(
    model: nn.Module,
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: PerSampleLoss,
    *,
    clip: float,
    noise_multiplier: float,
    batch_size: int,
    generator: torch.Generator,
    precision: Precision | None = None,
) -> PrivateGradient:
    """The clipped, noised mean gradient of the module docstring at the model's current weights and (a, b, alpha).

    Args:
        model: the network (train mode as it is; no BatchNorm). Its parameters are read, not changed.
        a, b, alpha: (T,) tensors (empty for ``bce``); read, not changed.
        x, y: the batch, (n, ...) and (n, T) or (n,); n may differ from ``batch_size`` (Poisson sampling) and
            may be 0 (the gradient is then the noise over B).
        loss_fn: the per-sample loss (:func:`per_sample_loss`).
        clip: C > 0, the bound on each sample's gradient norm over (w, a, b, alpha).
        noise_multiplier: sigma >= 0; the noise's standard deviation is sigma * C per coordinate of the sum.
        batch_size: B >= 1, the planned batch size the sum is divided by.
        generator: the source of the noise (drawn on its own device, moved to the gradient's).
        precision: the forward pass's arithmetic (fp32 or bf16 autocast; fp16 is refused, its gradients would
            need loss scaling per sample).
    """
    clip = float(number_argument("dp_clip", clip, lambda v: v > 0, "a finite number > 0"))
    sigma = float(number_argument("dp_noise_multiplier", noise_multiplier, lambda v: v >= 0, "a finite number >= 0"))
    batch = whole_argument("batch_size", batch_size, lambda v: v >= 1, "a whole number >= 1")
    if precision is not None and precision.scaler is not None:
        raise ValueError(f"dp: sample takes precision fp32 or bf16, not {precision.name} (per-sample gradients are "
                         "formed without loss scaling, and fp16 ones underflow)")
    check_private_model(model)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one(params_: dict[str, torch.Tensor], a_: torch.Tensor, b_: torch.Tensor, alpha_: torch.Tensor,
            xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        if precision is None or precision.dtype is None:
            out = functional_call(model, params_, (xi.unsqueeze(0),))
        else:
            with precision.autocast():
                out = functional_call(model, params_, (xi.unsqueeze(0),))
        return loss_fn(out.float().reshape(-1), yi, a_, b_, alpha_)

    n = x.shape[0]
    if n == 0:  # a Poisson draw may take no sample: the step is the noise alone (over the planned B)
        size = sum(p.numel() for p in params.values()) + a.numel() + b.numel() + alpha.numel()
        total = torch.zeros(size, device=x.device, dtype=torch.float32)
        losses = torch.zeros(0, device=x.device, dtype=torch.float32)
    else:
        labels = y.reshape(n, -1)
        per_sample = vmap(grad_and_value(one, argnums=(0, 1, 2, 3)), in_dims=(None, None, None, None, 0, 0),
                          randomness="different")
        (g_w, g_a, g_b, g_alpha), losses = per_sample(params, a.detach(), b.detach(), alpha.detach(), x, labels)
        parts = [*(g_w[name] for name in params), g_a, g_b, g_alpha]
        squares = torch.zeros(n, device=x.device, dtype=torch.float32)
        for g in parts:
            squares += g.reshape(n, -1).float().pow(2).sum(1)
        scale = (clip / squares.sqrt()).clamp(max=1.0)  # a zero gradient gives inf, clamped to 1
        total = torch.cat([torch.einsum("i,ij->j", scale, g.reshape(n, -1).float()) for g in parts])
    if sigma > 0:
        noise = torch.randn(total.numel(), generator=generator, device=generator.device, dtype=torch.float32)
        total += noise.to(total.device) * (sigma * clip)
    total /= batch
    split = total.numel() - alpha.numel()
    return PrivateGradient(v=total[:split], alpha=total[split:], loss=losses.detach().float().sum() / batch)


def noise_std(clip: float, noise_multiplier: float, batch_size: int) -> float:
    """The standard deviation sigma C / B of each coordinate of the noise in the returned mean gradient."""
    return noise_multiplier * clip / batch_size


class SampleNoise:
    """One site's secret randomness of DP-SGD: step t of round r draws its noise from a generator seeded by
    SeedSequence(entropy=noise seed, spawn_key=(SAMPLE_NOISE_DOMAIN, r, site + 1, t)), and its batch
    (:mod:`fdam_ray.privacy.batches`) from one seeded with the key (SAMPLE_BATCH_DOMAIN, r, site + 1, t).

    ``seed`` None takes 128 bits of fresh OS entropy, private to this object (never sent, never logged);
    an int replays (tests, audits). :meth:`begin_round` starts round r at step 0; without it the steps are
    counted on from the last round started (round 0 until one is), which keeps every key distinct within
    the object's life but replays after a resume only when the rounds are named. The noise and the batch
    draws count their steps apart, so drawing a batch never shifts a noise key, nor the reverse.
    """

    def __init__(self, seed: int | None, site: int, *, device: torch.device) -> None:
        if seed is not None and seed < 0:
            raise ValueError(f"dp_noise_seed {seed} must be >= 0")
        if site < 0:
            raise ValueError(f"site {site} must be >= 0")
        self._entropy = np.random.SeedSequence().entropy if seed is None else seed
        self.site = site
        self.round = 0
        self.step = 0
        self.batch_step = 0
        self._generator = torch.Generator(device=device)
        self._batch_generator = torch.Generator()  # index draws on the CPU: the same batches on any device

    def __repr__(self) -> str:  # the entropy is the secret: never shown
        return f"SampleNoise(site={self.site}, round={self.round}, step={self.step})"

    def begin_round(self, round_index: int) -> None:
        """Key the next steps by round ``round_index`` (>= 0), from step 0."""
        if round_index < 0:
            raise ValueError(f"round {round_index} must be >= 0")
        self.round, self.step, self.batch_step = round_index, 0, 0

    def _seed(self, domain: int, step: int) -> int:
        key = (domain, self.round, self.site + 1, step)
        return int(np.random.SeedSequence(entropy=self._entropy, spawn_key=key).generate_state(1, np.uint64)[0])

    def next_generator(self) -> torch.Generator:
        """The generator of the next step's noise (seeded for its key; the step counter moves on)."""
        seed = self._seed(SAMPLE_NOISE_DOMAIN, self.step)
        self.step += 1
        return self._generator.manual_seed(seed)

    def next_batch_generator(self) -> torch.Generator:
        """The CPU generator of the next step's batch draw (seeded for its key; the batch counter moves on)."""
        seed = self._seed(SAMPLE_BATCH_DOMAIN, self.batch_step)
        self.batch_step += 1
        return self._batch_generator.manual_seed(seed)


def check_private_replica(model: nn.Module, precision: Precision, *, positive_sampling: str,
                          noise_multiplier: float | None) -> None:
    """Refuse, in one line, what breaks the per-site guarantee of ``dp: sample`` before any step: BatchNorm
    (samples interact), fp16 (loss scaling), batches not drawn uniformly (the accountant's rate B / n_k assumes
    every sample equally likely), and a noise multiplier that was never resolved."""
    check_private_model(model)
    if precision.scaler is not None:
        raise ValueError(f"dp: sample takes precision fp32 or bf16, not {precision.name} (per-sample gradients "
                         "are formed without loss scaling, and fp16 ones underflow)")
    if positive_sampling != "natural":
        raise ValueError(f"dp: sample needs positive_sampling=natural, not {positive_sampling!r}: batches with a "
                         "set share of positives draw positives more often than negatives, and the accountant's "
                         "sampling rate B / n_k holds only for batches drawn uniformly")
    if noise_multiplier is None:
        raise ValueError("dp: sample: the client got no dp_noise_multiplier (sigma); give it, or let the driver "
                         "solve it from dp_epsilon before the clients start")


def check_private_batch(batch_size: int, num_samples: int, who: str) -> None:
    """Refuse a planned batch larger than the site's training set: its batches would repeat a sample, whose
    contribution to one sum could then reach 2C or more, past the sensitivity C the accountant assumes."""
    if batch_size > num_samples:
        raise ValueError(f"dp: sample: {who} has {num_samples} training samples, fewer than batch_size="
                         f"{batch_size}, so its batches would repeat samples (sensitivity above dp_clip); set "
                         f"batch_size <= {num_samples} or 'full'")
