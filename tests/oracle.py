"""An independent NumPy implementation of CODA+ / CODASCA for a linear scorer with full-batch gradients.

Written from docs/algorithms.md with hand-derived gradients (no autograd), float64.
h = sigmoid(X w + w0); v = (w, w0, a, b): the network's weights are (w, w0), the
first d + 1 entries of v, which is all that ``grad_clip`` clips (s.2).
"""

from __future__ import annotations

import numpy as np


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def objective_grads(v, alpha, X, y, p, objective, margin):
    """Full-batch gradients (g_v, g_alpha) of the mean of F over (X, y), single task.

    For ``bce`` v = (w, w0) has no a, b and there is no alpha (g_alpha = 0).
    """
    d = X.shape[1]
    if objective == "bce":
        dL_dz = sigmoid(X @ v[:d] + v[d]) - y  # d/dz of the binary cross-entropy of sigmoid(z)
        return np.r_[X.T @ dL_dz / len(y), dL_dz.mean()], 0.0
    w, w0, a, b = v[:d], v[d], v[d + 1], v[d + 2]
    h = sigmoid(X @ w + w0)
    P, N = (y == 1).astype(float), (y == 0).astype(float)
    coef = alpha if objective == "auc_margin" else 1.0 + alpha
    dF_dh = 2 * (1 - p) * (h - a) * P + 2 * p * (h - b) * N + 2 * coef * (p * N - (1 - p) * P)
    dF_dz = dF_dh * h * (1 - h)
    n = len(y)
    g = np.empty_like(v)
    g[:d] = X.T @ dF_dz / n
    g[d] = dF_dz.mean()
    g[d + 1] = np.mean(-2 * (1 - p) * (h - a) * P)
    g[d + 2] = np.mean(-2 * p * (h - b) * N)
    cross = p * h * N - (1 - p) * h * P
    if objective == "auc_margin":
        g_alpha = np.mean(2 * (p * (1 - p) * margin + cross)) - 2 * p * (1 - p) * alpha
    else:
        g_alpha = np.mean(2 * cross) - 2 * p * (1 - p) * alpha
    return g, g_alpha


def pooled_positive_ratio(clients) -> float:
    """All clients' positives over all clients' samples (not the mean of the clients' own ratios)."""
    return sum(float((y == 1).sum()) for _, y in clients) / sum(len(y) for _, y in clients)


def assert_matches(result, v, alpha, c_v=None, c_a=None) -> None:
    """A run's end point equals the oracle's (v, alpha; and the control variates when given) to float32
    precision."""
    np.testing.assert_allclose(result.state.v, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.alpha, [alpha] if result.alpha.size else [], rtol=1e-5, atol=1e-6)
    if c_v is not None:
        np.testing.assert_allclose(result.control_variates[0], c_v, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(result.control_variates[1], [c_a], rtol=1e-4, atol=1e-5)


def run_oracle(
    clients,
    v0,
    *,
    objective="auc_margin",
    margin=1.0,
    lr=0.1,
    local_steps=4,
    iterations=16,
    global_lr=1.0,
    prox_weight=0.0,
    weight_decay=0.0,
    control_variates=False,
    stage_length=10**9,
    lr_decay=3.0,
    reference_point="average",
    reset_control_variates=True,
    grad_clip=None,
    local_projection=True,
    clients_per_round=None,
    client_weighting="uniform",
    seed=0,
    proximal="stage",
    participants=None,
):
    """Returns (v, alpha, c_v, c_alpha) after ``iterations`` local steps (stagewise schedule).

    p is the pooled positive ratio of all clients (s.1): their positives over their samples.
    ``local_projection=False`` leaves out the projection of alpha after each local step (not a rule of
    docs/algorithms.md: a test uses it to show that a case exercises that projection).
    ``clients_per_round`` S and ``client_weighting`` follow s.3b: round r's clients are S draws without
    replacement from ``numpy.random.default_rng([seed, r])``; means take weights n_k (``samples``) or 1,
    renormalised over the round's clients; with a sample, c <- c + sum w_k (c^k_new - c^k_old) / sum_all w.
    ``proximal="round"`` (FedProx, FedProx-AUC) centres the proximal term on the round's starting point
    instead of the stage's reference point. ``v0`` holds (w, w0) only for ``bce``. ``participants`` (round ->
    clients) forces those rounds' sets under the partial rule (a replayed record).
    """
    K = len(clients)
    p = pooled_positive_ratio(clients)
    d = clients[0][0].shape[1]
    v, alpha = v0.astype(np.float64).copy(), 0.0
    ref = v.copy()
    c_v, c_a = np.zeros_like(v), 0.0
    ck_v = [np.zeros_like(v) for _ in range(K)]
    ck_a = [0.0] * K
    done, stage, eta = 0, 1, lr
    ref_sum, ref_n = np.zeros_like(v), 0
    weight = np.ones(K) if client_weighting == "uniform" else np.array([len(y) for _, y in clients], float)
    r = 0
    while done < iterations:
        r += 1
        steps = min(local_steps, iterations - done)
        full = clients_per_round is None or clients_per_round >= K
        chosen = range(K) if full else sorted(np.random.default_rng([seed, r]).choice(K, clients_per_round,
                                                                                     replace=False))
        if participants is not None and r in participants:  # a forced set (a replayed record): the partial rule
            chosen, full = participants[r], False
        c_change_v, c_change_a = np.zeros_like(v), 0.0
        vs, als, ws = [], [], []
        for k in chosen:
            X, y = clients[k]
            vk, ak = v.copy(), alpha
            for _ in range(steps):
                g, ga = objective_grads(vk, ak, X, y, p, objective, margin)
                if grad_clip is not None:
                    g[: d + 1] = np.clip(g[: d + 1], -grad_clip, grad_clip)
                centre = v if proximal == "round" else ref
                dv = g + prox_weight * (vk - centre) + weight_decay * vk
                if control_variates:
                    dv = dv - ck_v[k] + c_v
                    ga = ga - ck_a[k] + c_a
                vk = vk - eta * dv
                ak = ak + eta * ga
                if objective == "auc_margin" and local_projection:
                    ak = max(ak, 0.0)
            if control_variates:
                new_v = ck_v[k] - c_v + (v - vk) / (steps * eta)
                new_a = ck_a[k] - c_a + (ak - alpha) / (steps * eta)
                c_change_v += weight[k] * (new_v - ck_v[k])
                c_change_a += weight[k] * (new_a - ck_a[k])
                ck_v[k], ck_a[k] = new_v, new_a
            vs.append(vk)
            als.append(ak)
            ws.append(weight[k])
        ws = np.array(ws) / np.sum(ws)
        v = v + global_lr * (np.tensordot(ws, np.array(vs), 1) - v)
        alpha = alpha + global_lr * (float(np.dot(ws, als)) - alpha)
        if objective == "auc_margin":
            alpha = max(alpha, 0.0)
        if control_variates:
            if full:
                c_v = np.tensordot(weight / weight.sum(), np.array(ck_v), 1)
                c_a = float(np.dot(weight / weight.sum(), ck_a))
            else:
                c_v, c_a = c_v + c_change_v / weight.sum(), c_a + c_change_a / weight.sum()
        done += steps
        ref_sum += v
        ref_n += 1
        if done >= stage * stage_length and done < iterations:  # stage s ends at the first round end >= s T0
            stage += 1
            eta /= lr_decay
            ref = ref_sum / ref_n if reference_point == "average" else v.copy()
            ref_sum, ref_n = np.zeros_like(v), 0
            if reset_control_variates:
                c_v, c_a = np.zeros_like(v), 0.0
                ck_v = [np.zeros_like(v) for _ in range(K)]
                ck_a = [0.0] * K
    return v, alpha, c_v, c_a
