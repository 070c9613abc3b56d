"""Training for partial AUC: the KL-DRO objectives and their global normaliser from score histograms (s.1b).

One-way pAUC (FPR <= beta) weights the negatives by how hard they are: the KL-regularised distributionally robust
mean over the negatives (the SOPA-s form of Zhu et al. 2022, with a negative's score as its risk),

    max_q  E_q[h]  -  lambda KL(q || uniform over negatives)    =>    q_j = exp(h_j / lambda) / Z,
    Z = (1 / N) sum_j exp(h_j / lambda),

so a negative scored high (a false positive at a low threshold) counts exp(1 / lambda) times as much as one scored
0, and lambda -> infinity gives back AUC-M. Two-way pAUC (TPR >= alpha, FPR <= beta) weights the positives the same
way by exp(-h_i / lambda) / Z_+ (a positive scored low is a missed case at a high threshold). The objective is AUC-M
(:func:`fdam_ray.objectives.auc_objective`) with each class's sample means taken under these weights:

    F = (1-p) w_i (h-a)^2 P + p w_j (h-b)^2 N + 2 alpha (p(1-p) m + p w_j h N - (1-p) w_i h P) - p(1-p) alpha^2

with w_j = exp(h_j / lambda - log Z) on negatives, w_i = exp(-h_i / lambda - log Z_+) on positives (two-way; 1
one-way); the weights are constants of the step (no gradient flows through them, as in LibAUC's SOPA-s).

Z is a mean over the negatives of every site. No score leaves a site for it: at the start of every round the
driver asks each site for the per-class counts of its training scores on the fixed bin layout of
:mod:`fdam_ray.scores.histogram` (B bins, the counts a ``test_scores: histogram`` evaluation sends; under Flower
with secure aggregation only their sum reaches the server), sums them, and sends every site

    log Z~ = log( sum_c n_c exp(s_c / lambda) / sum_c n_c )

(n_c the pooled negatives of bin c, s_c its centre), and log Z~_+ the same with the positives and -s_c. A score in
bin c is within half the bin's width of s_c, so every term is off by a factor in exp([-d, d]) with d = (largest
half-width of an occupied bin) / lambda: |log Z~ - log Z| <= d (:func:`normaliser_bound`). The fixed layout's bins
are at most 2 / B wide, so d <= 1 / (B lambda): 2.4e-3 at B = 4096 and lambda = 0.1, a weight off by 0.24 % at
most. Within the round Z is held fixed (the model moves; the next round's pass catches up).
"""

from __future__ import annotations

import numpy as np
import torch

PAUC_OBJECTIVES = ("pauc_one_way", "pauc_two_way")
REFRESH_BINS = 2**12  # B of the training-score pass (the histograms' default; imported where used: the losses
# import this module and must stay light)


def log_normalisers(counts: np.ndarray, temperature: float) -> np.ndarray:
    """``(T, 2)`` float64: per task ``[log Z~ of the negatives, log Z~_+ of the positives]`` from pooled counts
    ``(T, 2, B)`` on the fixed layout (NaN for a class without a sample)."""
    from fdam_ray.scores.histogram import bin_centres

    counts = np.asarray(counts, dtype=np.float64)
    centres = bin_centres(counts.shape[2])
    out = np.full((counts.shape[0], 2), np.nan)
    for t in range(counts.shape[0]):
        for k, sign in ((0, 1.0), (1, -1.0)):
            n = counts[t, k]
            if n.sum() > 0:
                e = sign * centres[n > 0] / temperature + np.log(n[n > 0])
                top = e.max()
                out[t, k] = top + np.log(np.exp(e - top).sum()) - np.log(n.sum())
    return out


def exact_log_normalisers(scores: np.ndarray, labels: np.ndarray, temperature: float) -> np.ndarray:
    """The same from the scores themselves (what the histogram approximates; for tests and benchmarks)."""
    scores = np.asarray(scores, np.float64).reshape(len(scores), -1)
    labels = np.asarray(labels, np.float64).reshape(len(scores), -1)
    out = np.full((scores.shape[1], 2), np.nan)
    for t in range(scores.shape[1]):
        for k, sign in ((0, 1.0), (1, -1.0)):
            e = sign * scores[labels[:, t] == k, t] / temperature
            if e.size:
                out[t, k] = e.max() + np.log(np.mean(np.exp(e - e.max())))
    return out


def normaliser_bound(counts: np.ndarray, temperature: float) -> np.ndarray:
    """``(T, 2)``: the most :func:`log_normalisers` can differ from the exact log Z: the largest half-width of a
    bin holding a sample of that class, over lambda."""
    from fdam_ray.scores.histogram import bin_edges

    counts = np.asarray(counts)
    edges = np.concatenate(([0.0], bin_edges(counts.shape[2]), [1.0]))
    half = np.diff(edges) / 2
    return np.array([[half[counts[t, k] > 0].max(initial=0.0) / temperature for k in (0, 1)]
                     for t in range(counts.shape[0])])


def task_mean(per: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean over the tasks with a labelled sample of each task's mean of ``per`` (B, T) over its ``count`` (the
    last step of every objective, fdam_ray.objectives' too)."""
    has = count > 0
    if not bool(has.any()):  # no labelled sample in this batch: nothing to learn from it
        return (per * 0).sum()
    task_means = per.sum(0)[has] / count[has]
    return task_means.mean()


def pauc_objective(name: str, h: torch.Tensor, labels: torch.Tensor, p: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, alpha: torch.Tensor, *, margin: float, temperature: float,
                   log_norms: torch.Tensor | None) -> torch.Tensor:
    """The module docstring's F on (B, T) scores and labels (0, 1, NaN), as the mean over tasks of each task's
    sample mean. ``log_norms`` ``(T, 2)``: the global log Z~ of the last pass; None weights by the batch's own
    normaliser (a model trained on its own data, :mod:`fdam_ray.losses`)."""
    if name not in PAUC_OBJECTIVES:
        raise ValueError(f"pAUC objective {name!r} is not one of {', '.join(PAUC_OBJECTIVES)}")
    valid = ~torch.isnan(labels)
    pos = (labels == 1).to(h.dtype)
    neg = (labels == 0).to(h.dtype)
    w_neg = tilted(h, neg, 1.0, temperature, None if log_norms is None else log_norms[:, 0])
    w_pos = (tilted(h, pos, -1.0, temperature, None if log_norms is None else log_norms[:, 1])
             if name == "pauc_two_way" else pos)
    q = p * (1 - p)
    per = (1 - p) * w_pos * (h - a) ** 2 + p * w_neg * (h - b) ** 2
    per = per + 2 * alpha * (q * margin * valid + p * w_neg * h - (1 - p) * w_pos * h)
    per = per - q * alpha**2 * valid
    return task_mean(per, valid.sum(0).to(h.dtype))


@torch.no_grad()
def tilted(h: torch.Tensor, member: torch.Tensor, sign: float, temperature: float,
           log_norm: torch.Tensor | None) -> torch.Tensor:
    """``member`` (0/1, (B, T)) times exp(sign h / lambda - log Z) (detached); with ``log_norm`` None, Z is the
    batch's own mean over the members, per task (logsumexp; a task without a member in the batch weighs none)."""
    e = sign * h.detach() / temperature
    if log_norm is None:
        masked = torch.where(member > 0, e, torch.full_like(e, -torch.inf))
        count = member.sum(0)
        top = masked.max(0).values
        top = torch.where(count > 0, top, torch.zeros_like(top))
        total = (torch.exp(masked - top) * member).sum(0).clamp_min(1e-30)
        log_norm = top + torch.log(total) - torch.log(count.clamp_min(1))
    return member * torch.exp(torch.where(member > 0, e - log_norm.to(h.dtype), torch.zeros_like(e)))


def configure_vector(positive_ratio: np.ndarray, log_norms: np.ndarray) -> np.ndarray:
    """What the sites are configured with under a pAUC objective: p (T), then log Z~ (T) and log Z~_+ (T)."""
    p = np.asarray(positive_ratio, np.float64).reshape(-1)
    return np.concatenate([p, log_norms[:, 0], log_norms[:, 1]])


def refresh(executor, state, positive_ratio: np.ndarray, objective: str, temperature: float) -> tuple[int, int]:
    """One training-score count pass: every site's counts of ``state``'s scores on its training shard (``split=
    "train"``, :meth:`fdam_ray.clients.client.Client.score_histogram`) summed, log Z~ computed and sent to every
    site with p (``executor.configure``). Returns (bytes down, bytes up) of the pass. A class missing from every
    site's shard is refused in one line naming the objective."""
    from fdam_ray.scores.histogram import Binning, sum_histograms

    binning = Binning(REFRESH_BINS)
    parts = [h for h in executor.evaluate(state, "train", binning) if h is not None]
    if not parts:
        raise ValueError(f"objective {objective}: no site sent the counts of its training scores (its global "
                         "normaliser needs them)")
    total = sum_histograms([h.counts for h in parts])
    norms = log_normalisers(total, temperature)
    if np.isnan(norms[:, 0]).any() or (objective == "pauc_two_way" and np.isnan(norms[:, 1]).any()):
        side = "negative" if np.isnan(norms[:, 0]).any() else "positive"
        raise ValueError(f"objective {objective}: a task has no {side} training sample at any site (not allowed: "
                         "its partial AUC is not defined)")
    executor.configure(configure_vector(positive_ratio, np.nan_to_num(norms)))
    return executor.active_clients * state.nbytes, sum(h.counts.nbytes for h in parts)
