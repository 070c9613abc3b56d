"""The dp: client rule (fdam_ray/privacy/client_level.py) and the driver's accounting (fdam_ray/privacy/driver.py)
against independent NumPy recomputations of docs/algorithms.md s.9: the clipped change a client sends, the server
step with a fixed denominator, c by post-processing in a sampled round, and the per-site accountants of dp: sample.
"""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray.config import build_config
from fdam_ray.core.state import ClientUpdate, GlobalState, StepStats
from fdam_ray.privacy.accountant import Accountant, shares_noise_multiplier
from fdam_ray.privacy.client_level import (
    ClientLevel,
    ServerRound,
    check_model,
    check_transport,
    private_finish,
    private_update,
)
from fdam_ray.privacy.driver import ClientLevelRun, SampleLevelRun
from fdam_ray.privacy.section import PrivacySection

E = np.empty(0, dtype=np.float32)
CNT = np.empty(0, dtype=np.int64)


def state(rng, n=7, m=2, round_=4, c=True):
    f = lambda k: rng.standard_normal(k).astype(np.float32)
    return GlobalState(v=f(n), alpha=np.abs(f(m)), buffers=E, counters=CNT, c_v=f(n) if c else None,
                       c_alpha=f(m) if c else None, round=round_, iteration=10)


def update(rng, start, k, scale):
    return ClientUpdate(v=start.v + scale * rng.standard_normal(start.v.size).astype(np.float32),
                        alpha=start.alpha + scale * rng.standard_normal(start.alpha.size).astype(np.float32),
                        buffers=E, counters=CNT, c_v=rng.standard_normal(start.v.size).astype(np.float32),
                        c_alpha=rng.standard_normal(start.alpha.size).astype(np.float32), client_id=k,
                        stats=StepStats(k, 0.0, 3, 9, 0.0))


def clip64(d, c):
    norm = np.linalg.norm(d)
    return d * min(1.0, c / norm)


@pytest.mark.parametrize("noise_at", ["server", "clients"])
def test_a_client_sends_its_clipped_change_and_no_control_variate(noise_at):
    rng = np.random.default_rng(0)
    x = state(rng)
    dp = ClientLevel(clip=0.5, sigma=0.8, noise_at=noise_at, seed=11, sampled=3, num_clients=5)
    u = update(rng, x, 2, 3.0)
    out = private_update(u, x, dp)
    d = np.concatenate([u.v.astype(np.float64) - x.v, u.alpha.astype(np.float64) - x.alpha])
    want = clip64(d, 0.5)
    if noise_at == "clients":  # share N(0, sigma^2 C^2 / S), keyed (seed, round r = start.round + 1, site k)
        g = np.random.default_rng(np.random.SeedSequence(entropy=11, spawn_key=(0x4450, 5, 3)))
        want = want + (g.standard_normal(d.size) * (0.8 * 0.5 / np.sqrt(3))).astype(np.float32)
    else:
        assert np.linalg.norm(np.concatenate([out.v, out.alpha]).astype(np.float64)) <= 0.5
    np.testing.assert_allclose(np.concatenate([out.v, out.alpha]), want, rtol=0, atol=2e-7)
    assert not out.c_v.any() and not out.c_alpha.any()  # the control variate is not released
    assert out.client_id == 2 and out.stats is u.stats
    assert u.c_v.any()  # the client's own update (its c^k) is not changed in place


def test_a_small_change_is_sent_unclipped():
    rng = np.random.default_rng(1)
    x = state(rng)
    u = update(rng, x, 0, 1e-3)
    out = private_update(u, x, ClientLevel(clip=10.0, sigma=0.0, noise_at="server", seed=0, sampled=2,
                                           num_clients=2))
    np.testing.assert_array_equal(out.v, np.subtract(u.v, x.v, dtype=np.float32))


def test_server_step_uses_the_planned_s_and_moves_c_by_post_processing():
    rng = np.random.default_rng(2)
    x = state(rng)
    dp = ClientLevel(clip=0.3, sigma=1.3, noise_at="server", seed=5, sampled=4, num_clients=9)
    sent = [private_update(update(rng, x, k, 2.0), x, dp) for k in (1, 4, 6)]  # 3 of the planned 4 reported
    sums = ClientUpdate(v=sum(u.v for u in sent), alpha=sum(u.alpha for u in sent), buffers=E, counters=CNT,
                        client_id=-1, stats=sent[0].stats)
    out = private_finish(sums, 3, x, ServerRound(dp, 5, lr=0.2), global_lr=1.5, alpha_nonnegative=True, steps=3)
    n = x.v.size
    z = np.concatenate([sums.v, sums.alpha]).astype(np.float64)
    g = np.random.default_rng(np.random.SeedSequence(entropy=5, spawn_key=(0x4450, 5, 0)))
    z += (g.standard_normal(z.size) * (1.3 * 0.3)).astype(np.float32)
    step = 1.5 * z / 4  # fixed denominator S = 4, not the 3 that reported
    np.testing.assert_allclose(out["v"], x.v + step[:n], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["alpha"], np.maximum(x.alpha + step[n:], 0), rtol=0, atol=1e-6)
    # c <- c + (1/K)(-|S_r| c - Z_v/(I eta)); alpha's sign from the ascent rule
    np.testing.assert_allclose(out["c_v"], x.c_v + (-3 * x.c_v - z[:n] / (3 * 0.2)) / 9, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["c_alpha"], x.c_alpha + (-3 * x.c_alpha + z[n:] / (3 * 0.2)) / 9, rtol=0,
                               atol=1e-5)


def test_full_participation_c_is_the_scaffold_mean_of_the_released_changes():
    # c_new = -Z/(S I eta) when all K take part: what the clients' mean c^k would be if c were their mean before
    rng = np.random.default_rng(3)
    x = state(rng)
    dp = ClientLevel(clip=1e9, sigma=0.0, noise_at="server", seed=1, sampled=3, num_clients=3)
    ups = [update(rng, x, k, 0.5) for k in range(3)]
    sent = [private_update(u, x, dp) for u in ups]
    sums = ClientUpdate(v=sum(u.v for u in sent), alpha=sum(u.alpha for u in sent), buffers=E, counters=CNT,
                        client_id=-1, stats=sent[0].stats)
    out = private_finish(sums, 3, x, ServerRound(dp, 5, lr=0.1), global_lr=1.0, alpha_nonnegative=False, steps=2)
    mean_dv = np.mean([u.v.astype(np.float64) - x.v for u in ups], axis=0)
    np.testing.assert_allclose(out["c_v"], -mean_dv / (2 * 0.1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["v"], x.v + mean_dv, rtol=0, atol=1e-6)


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="without BatchNorm") as info:
        check_model(np.zeros(3, np.float32), CNT)
    assert "\n" not in str(info.value)
    cfg = build_config(dict(dp="client", dp_noise_multiplier=1.0, model="linear", algorithm="coda_plus",
                            transfer_precision="bf16"))
    with pytest.raises(ValueError, match="transfer_precision: fp32"):
        check_transport(cfg.transport, cfg.transfer_precision)


def section(**kw):
    return PrivacySection.of(build_config(dict(model="linear", algorithm="coda_plus", **kw)))


def test_client_level_accounting_counts_shares_of_the_sites_that_reported():
    run = ClientLevelRun(section(dp="client", dp_noise_multiplier=2.0, dp_noise_at="clients", num_clients=4),
                         rounds=10)
    run.step(3, None, 4)
    run.step(3, None, 3)  # one share missing: sigma sqrt(3/4)
    want = Accountant.for_clients(noise_multiplier=2.0, delta=1e-5, num_clients=4, clients_per_round=None)
    want.step(1)
    want.step(1, noise_multiplier=shares_noise_multiplier(2.0, 4, 3))
    assert run.epsilon() == want.epsilon()
    assert shares_noise_multiplier(2.0, 4, 3) == pytest.approx(2.0 * np.sqrt(3 / 4))
    restored = ClientLevelRun(run.section, rounds=99, state=run.state())
    assert restored.epsilon() == run.epsilon() and restored.sigma == 2.0
    assert restored.draw_secret == run.draw_secret  # the client draw's key comes back with the checkpoint


def test_client_level_sigma_is_solved_for_the_planned_rounds():
    run = ClientLevelRun(section(dp="client", dp_epsilon=8.0, num_clients=4), rounds=20)
    for _ in range(20):
        run.step(1, None, 4)
    assert run.epsilon() <= 8.0 and run.epsilon() > 7.9
    assert run.over_budget(21, 1, None) is None  # no dp_max_epsilon


def test_sample_level_accounting_is_per_site_and_the_run_reports_the_largest():
    run = SampleLevelRun(section(dp="sample", dp_noise_multiplier=1.1, num_clients=3), iterations=100,
                         batch_size=8, num_train=None, labels=["a", "b", "c"])
    run.sites_known([40, 80, 160])
    run.step(5, [0, 2], 2)  # a sampled round: site b did not run
    run.step(5, None, 3)
    rec = run.record()
    for k, (label, n, steps) in enumerate(zip("abc", (40, 80, 160), (10, 5, 10), strict=True)):
        want = Accountant.for_site(noise_multiplier=1.1, delta=1e-5, num_samples=n, batch_size=8, local_steps=1,
                                   sampling="poisson")  # dp_sampling null: poisson batches under dp: sample
        want.step(1, compositions=steps)
        assert rec[f"dp_epsilon.{label}"] == want.epsilon(), k
    assert run.section.sampling == "poisson" and run.summary()["dp_relation"] == "add_or_remove_one"
    assert rec["dp_epsilon"] == max(rec[f"dp_epsilon.{x}"] for x in "abc") == rec["dp_epsilon.a"]
    with pytest.raises(ValueError, match="data changed"):
        SampleLevelRun(run.section, iterations=100, batch_size=8, num_train=None, labels=list("abc"),
                       state=run.state()).sites_known([40, 81, 160])


def test_the_budget_stops_before_the_round_that_would_pass_it():
    acc = Accountant.for_clients(noise_multiplier=3.0, delta=1e-5, num_clients=5, clients_per_round=None)
    eps = []
    for _ in range(4):
        acc.step(1)
        eps.append(acc.epsilon())
    run = ClientLevelRun(section(dp="client", dp_noise_multiplier=3.0, num_clients=5,
                                 dp_max_epsilon=(eps[2] + eps[3]) / 2), rounds=10)
    lines = []
    for r in range(1, 6):
        line = run.over_budget(r, 1, None)
        if line:
            lines.append(line)
            break
        run.step(1, None, 5)
    assert len(lines) == 1 and "before round 4" in lines[0] and f"{eps[2]:.4g}" in lines[0]
    assert run.epsilon() == eps[2]


def test_collective_transport_is_refused_in_one_line():
    cfg = build_config(dict(dp="client", dp_noise_multiplier=1.0, model="linear", algorithm="coda_plus",
                            transport="collective"))
    with pytest.raises(ValueError, match="transport: collective") as info:
        check_transport(cfg.transport, cfg.transfer_precision)
    assert "\n" not in str(info.value)


def test_an_executor_that_builds_clients_from_the_plain_config_receives_the_resolved_sigma_in_it():
    """dp: client with a dp_epsilon target for an executor whose clients are built from the run config (a Flower
    site): the solved sigma reaches the config (target null, so it validates), and the client face a site builds
    from that config is the driver's own (same C, sigma, S, K, seed, placement)."""
    import torch.nn as nn

    from fdam_ray.assembly.plugs import run_plug, site_face
    from fdam_ray.clients.face import NO_FACE
    from fdam_ray.core.flat import FlatModel
    from fdam_ray.executors.base import ExecutorSetup
    from fdam_ray.loop.plug import Plug, PlugStart
    from fdam_ray.privacy.faces import ClientLevelFace
    from fdam_ray.privacy.section import PrivacySection

    class Elsewhere:  # like the Flower bridge: its clients are built from the plain config at each site
        clients_from_setup = False

    cfg = build_config(dict(dp="client", dp_epsilon=5.0, dp_noise_seed=4, dp_noise_at="clients", dp_clip=0.5,
                            model="linear", algorithm="coda_plus", num_clients=4, clients_per_round=3,
                            iterations=12, local_steps=3))
    setup = ExecutorSetup.for_config(cfg)
    assert setup.face is NO_FACE
    flat = FlatModel(nn.Linear(3, 1), aux_size=3)
    plug = run_plug(cfg)
    out = plug.setup(setup, PlugStart(Elsewhere(), None, flat, None))  # type: ignore[arg-type]
    sigma = plug.run.sigma
    assert 0 < sigma < float("inf")
    assert out.run_config["dp_noise_multiplier"] == sigma and out.run_config["dp_epsilon"] is None
    assert setup.run_config["dp_epsilon"] == 5.0  # the federation's own setup is not changed in place
    at_site = site_face(build_config(dict(out.run_config)))
    assert isinstance(at_site, ClientLevelFace) and at_site == out.face and at_site.sends_changes
    dp = at_site.settings
    assert dp.sigma == sigma and (dp.sampled, dp.num_clients) == (3, 4)
    assert (dp.clip, dp.seed, dp.noise_at) == (0.5, 4, "clients")
    with pytest.raises(ValueError, match="no resolved dp_noise_multiplier"):  # the plain config: never unnoised
        site_face(cfg)
    same = run_plug(cfg).setup(setup, PlugStart(type("Here", (), {"clients_from_setup": True})(), None, flat,
                                                None))  # type: ignore[arg-type]
    assert same.run_config is setup.run_config and same.face == out.face  # inline/Ray: the config unchanged
    off = build_config(dict(model="linear"))
    assert type(run_plug(off)) is Plug and run_plug(off).setup(setup, None) is setup  # type: ignore[arg-type]
    assert site_face(off) is NO_FACE and PrivacySection.of(off).enabled is False


def test_a_checkpoint_without_dp_is_written_and_read_as_before():
    from fdam_ray.algorithms.stages import init_server_state
    from fdam_ray.checkpoint import LoopState, _loop_from, _loop_payload

    loop = LoopState(server=init_server_state(state(np.random.default_rng(0), c=False)))
    payload = _loop_payload(loop)
    assert "privacy" not in payload  # dp off: the file's layout is unchanged
    assert _loop_from(payload, "x").privacy is None  # and a file without the key reads as no DP
    loop.privacy = {"client": {"rounds": 3}}
    assert _loop_from(_loop_payload(loop), "x").privacy == {"client": {"rounds": 3}}
