"""Splitting a labelled multi-class pool over K clients.

``ih_partition`` is the paper's imbalanced-heterogeneous construction
(docs/algorithms.md s.7): the positive classes and the negative classes are each
split into K class-disjoint groups of consecutive classes; client k owns group
k of each side; positives are dropped, class by class in proportion, so that
pos / (pos + neg) = imratio on every client (to within one sample). When a
client has too few positives for its negatives, negatives are dropped instead.

``dirichlet_partition`` first drops positives (class-stratified) to reach
imratio over the pool, then deals every class over the clients with
proportions drawn from Dirichlet(concentration * 1_K).
"""

from __future__ import annotations

import numpy as np


def _keep_stratified(
    indices_by_class: list[np.ndarray], total: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Keep ``total`` samples spread over classes in proportion to their sizes (largest remainder)."""
    sizes = np.array([len(ix) for ix in indices_by_class], dtype=np.float64)
    if total >= sizes.sum():
        return indices_by_class
    exact = sizes * total / sizes.sum()
    keep = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - keep), kind="stable")[: total - keep.sum()]:
        keep[i] += 1
    return [np.sort(rng.permutation(ix)[:k]) for ix, k in zip(indices_by_class, keep, strict=True)]


def ih_partition(
    classes: np.ndarray,
    positive_classes: tuple[int, ...],
    *,
    num_clients: int,
    imratio: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Indices of each client's samples (see module docstring).

    Raises:
        ValueError: when K exceeds the number of positive or negative classes, or a
            client would be left without positives.
    """
    all_classes = np.unique(classes)
    pos_classes = np.array(sorted(set(positive_classes) & set(all_classes.tolist())))
    neg_classes = np.array(sorted(set(all_classes.tolist()) - set(positive_classes)))
    for side, cls in (("positive", pos_classes), ("negative", neg_classes)):
        if num_clients > len(cls):
            raise ValueError(
                f"num_clients={num_clients} is more than the {len(cls)} {side} classes: the IH partition "
                f"gives every client its own {side} classes (use num_clients <= {len(cls)} or partition=dirichlet)"
            )
    ratio = imratio / (1 - imratio)
    out = []
    for k, (pos_group, neg_group) in enumerate(
        zip(np.array_split(pos_classes, num_clients), np.array_split(neg_classes, num_clients), strict=True)
    ):
        pos_ix = [np.flatnonzero(classes == c) for c in pos_group]
        neg_ix = [np.flatnonzero(classes == c) for c in neg_group]
        n_neg = sum(len(ix) for ix in neg_ix)
        available = sum(len(ix) for ix in pos_ix)
        n_pos = round(ratio * n_neg)
        if n_pos > available:
            n_neg = int(np.floor(available / ratio))
            neg_ix = _keep_stratified(neg_ix, n_neg, rng)
            n_pos = min(available, round(ratio * n_neg))
        if n_pos < 1:
            raise ValueError(
                f"client {k} is left with no positives (imratio={imratio}, {n_neg} negatives): "
                "raise imratio or use fewer clients"
            )
        pos_ix = _keep_stratified(pos_ix, n_pos, rng)
        out.append(np.sort(np.concatenate(pos_ix + neg_ix)))
    return out


def subsample_positives(
    classes: np.ndarray, positive_classes: tuple[int, ...], imratio: float, rng: np.random.Generator
) -> np.ndarray:
    """Indices of the pool after dropping positives (class-stratified) so the positive fraction is imratio."""
    is_pos = np.isin(classes, positive_classes)
    n_neg = int((~is_pos).sum())
    n_pos = min(int(is_pos.sum()), round(imratio / (1 - imratio) * n_neg))
    pos_ix = [np.flatnonzero(classes == c) for c in sorted(set(positive_classes))]
    kept = _keep_stratified([ix for ix in pos_ix if len(ix)], n_pos, rng)
    return np.sort(np.concatenate([np.flatnonzero(~is_pos), *kept]))


def dirichlet_partition(
    classes: np.ndarray,
    positive_classes: tuple[int, ...],
    *,
    num_clients: int,
    imratio: float,
    concentration: float,
    rng: np.random.Generator,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Indices of each client's samples: imratio over the pool, classes dealt by Dirichlet draws.

    Draws again (up to ``max_tries``) until every client has a positive and a negative.
    """
    pool = subsample_positives(classes, positive_classes, imratio, rng)
    is_pos = np.isin(classes, positive_classes)
    positives = int(is_pos[pool].sum())
    if num_clients > min(positives, len(pool) - positives):  # checked before K client lists are made
        raise ValueError(
            f"partition=dirichlet: num_clients={num_clients} is more than the {positives} positive and "
            f"{len(pool) - positives} negative samples kept (imratio={imratio}); every client needs one of each: "
            "use fewer clients or raise imratio")
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in np.unique(classes[pool]):
            ix = rng.permutation(pool[classes[pool] == c])
            q = rng.dirichlet(np.full(num_clients, concentration))
            cuts = np.round(np.cumsum(q)[:-1] * len(ix)).astype(int)
            for k, piece in enumerate(np.split(ix, cuts)):
                parts[k].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if all(is_pos[o].any() and (~is_pos[o]).any() for o in out):
            return out
    raise ValueError(
        f"partition=dirichlet: no draw in {max_tries} gave every one of {num_clients} clients a positive and a "
        f"negative (dirichlet_concentration={concentration}, imratio={imratio}); raise either or use fewer clients"
    )


def validation_rows(labels: np.ndarray, fraction: float, rng: np.random.Generator, *, client_id: int,
                    task_names: tuple[str, ...] | None = None, groups: np.ndarray | None = None) -> np.ndarray:
    """The rows of a client's training shard held out as its validation part (sorted), about ``fraction`` of them.

    ``groups`` (one id per row, e.g. the patient): whole groups are held out, so no group is on both sides;
    without it each row is a group of its own. Stratified: each group's stratum is its rarest positive task on
    this client (or "no positive"), and every stratum gives its share of rows (largest remainder), groups drawn
    in a seeded order; a task with positives in two or more groups keeps one of them in the validation part. The
    training part must keep a sample, and a positive of every task the client has positives of: otherwise one
    line naming the client (and the task) says to lower ``val_fraction``.
    """
    y = np.asarray(labels, dtype=np.float64).reshape(len(labels), -1)
    n = len(y)
    n_val = max(1, round(fraction * n))
    if n_val >= n:
        raise ValueError(f"client {client_id}: val_fraction={fraction} holds out {n_val} of its {n} training "
                         "samples, leaving none to train on; lower val_fraction")
    group_of = np.arange(n) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1].ravel()
    sizes = np.bincount(group_of)
    positive = y == 1
    counts = positive.sum(0)
    positives_of_group = np.zeros((len(sizes), y.shape[1]), dtype=np.int64)
    np.add.at(positives_of_group, group_of, positive)
    has = positives_of_group > 0
    stratum = np.where(has.any(1), np.where(has, counts[None, :], np.iinfo(np.int64).max).argmin(1), -1)
    held = np.zeros(len(sizes), dtype=bool)
    strata = np.unique(stratum)
    for s, quota in zip(strata, _largest_remainder([sizes[stratum == s].sum() for s in strata], n_val),
                        strict=True):
        taken = 0
        for g in rng.permutation(np.flatnonzero(stratum == s)):
            if taken >= quota or taken + sizes[g] - quota > quota - taken:  # overshoots more than it fills
                break
            held[g], taken = True, taken + sizes[g]
    if not held.any():  # groups larger than every quota: one of them
        held[rng.integers(len(sizes))] = True
    names = task_names if task_names is not None and len(task_names) == y.shape[1] else None
    for t in range(y.shape[1]):
        owners = np.flatnonzero(has[:, t])
        if len(owners) >= 2 and not held[owners].any():
            held[rng.choice(owners)] = True
        if len(owners) and held[owners].all():
            task = "" if y.shape[1] == 1 else f" of task '{names[t] if names else t}'"
            raise ValueError(f"client {client_id}: val_fraction={fraction} holds out all its {int(counts[t])} "
                             f"positive(s){task}, leaving its training part none; lower val_fraction")
    rows = held[group_of]
    if rows.all():
        raise ValueError(f"client {client_id}: val_fraction={fraction} holds out all its {n} training samples "
                         f"({len(sizes)} groups), leaving none to train on; lower val_fraction")
    return np.flatnonzero(rows)


def _largest_remainder(sizes: list[int], total: int) -> list[int]:
    """``total`` split over parts in proportion to ``sizes`` (integers, largest remainders rounded up)."""
    exact = np.asarray(sizes, dtype=np.float64) * total / max(1, sum(sizes))
    share = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - share), kind="stable")[: total - share.sum()]:
        share[i] += 1
    return share.tolist()
