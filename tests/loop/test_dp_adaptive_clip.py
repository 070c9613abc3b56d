"""Adaptive clipping in the federation (inline executor): the clip the clients use each round is the driver's C_r,
and the C sequence equals a NumPy recomputation from the clients' unclipped norms (spied at the one client-side
hook) and the count noise's own generator; the clip moves; a resumed run continues the same sequence; a fixed clip
leaves the round's plan as it was; Ray actors clip to the same sequence; the Flower executor is refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
import fdam_ray.privacy.faces as faces
from fdam_ray.privacy.adaptive import count_generator, update_noise_multiplier

BASE = dict(model="linear", batch_size="full", eval_every=1, seed=0, lr=0.3, executor="inline",
            algorithm="coda_plus", local_steps=2, positive_ratio=0.5, dp="client", dp_clip=0.02, dp_noise_seed=7,
            dp_noise_multiplier=0.5)


def spy(monkeypatch):
    seen = []
    real = faces.private_update

    def record(update, start, dp):
        d = np.concatenate([update.v - start.v, update.alpha - start.alpha]).astype(np.float32)
        seen.append((start.round + 1, update.client_id, float(np.linalg.norm(d.astype(np.float64))), dp.clip))
        return real(update, start, dp)

    monkeypatch.setattr(faces, "private_update", record)
    return seen


def test_the_clip_sequence_equals_the_numpy_recomputation(monkeypatch):
    clients, test = gaussian_clients(4, seed=0)
    seen = spy(monkeypatch)
    gamma, eta, sigma_b = 0.5, 0.2, 0.6
    r = fdam_ray.train_arrays(dict(BASE, iterations=16, dp_clip_quantile=gamma, dp_clip_lr=eta,
                                   dp_clip_count_noise=sigma_b), clients, test)
    rounds = sorted({x[0] for x in seen})
    assert rounds == list(range(1, 9)) and len(seen) == 32
    clip, clips = 0.02, {}
    for rnd in rounds:
        mine = [x for x in seen if x[0] == rnd]
        assert all(x[3] == clip for x in mine)  # every client used the driver's C_r
        bits = sum(x[2] <= clip for x in mine)
        b = (bits - 2.0 + sigma_b * count_generator(7, rnd).standard_normal()) / 4 + 0.5
        clip = clip * math.exp(-eta * (b - gamma))
        clips[rnd] = clip
    recorded = {h["round"]: h["dp_clip"] for h in r.history if h["round"] > 0}
    assert recorded == {rnd: clips[rnd] for rnd in recorded} and len(recorded) == 8
    assert r.summary["dp_clip_final"] == clips[8] and abs(math.log(clips[8] / 0.02)) > 0.1  # the clip moved
    assert r.summary["dp_update_noise_multiplier"] == update_noise_multiplier(0.5, sigma_b)
    assert r.summary["dp_noise_multiplier"] == 0.5  # the accountant counts sigma


def test_a_fixed_clip_leaves_the_plan_and_the_records_as_they_were(monkeypatch):
    clients, test = gaussian_clients(4, seed=0)
    seen = spy(monkeypatch)
    r = fdam_ray.train_arrays(dict(BASE, iterations=4), clients, test)
    assert {x[3] for x in seen} == {0.02}
    assert "dp_clip" not in r.history[-1] and "dp_clip_final" not in r.summary


def test_a_resume_continues_the_clip_sequence(tmp_path):
    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.cli import main
    from fdam_ray.privacy.accountant import Accountant

    acc = Accountant.for_clients(noise_multiplier=2.0, delta=1e-5, num_clients=4, clients_per_round=None)
    eps = []
    for _ in range(10):
        acc.step(1)
        eps.append(acc.epsilon())
    args = ["dataset=synthetic", "num_clients=4", "model=linear", "executor=inline", "iterations=20",
            "eval_every=4", "local_steps=2", "dp=client", "dp_noise_multiplier=2", "dp_noise_seed=1",
            "positive_ratio=0.5", "algorithm=coda_plus", "dp_clip=0.05", "dp_clip_quantile=0.7",
            "dp_clip_count_noise=1.5", "--quiet", f"out_dir={tmp_path}"]
    assert main(["train", "run_name=whole", f"dp_max_epsilon={eps[-1] * 2}", *args]) == 0
    assert main(["train", "run_name=cut", f"dp_max_epsilon={(eps[4] + eps[5]) / 2}", *args]) == 0  # stops at 5
    cut = tmp_path / "cut"
    assert load_checkpoint(cut / "checkpoint.pt").loop.state.round == 5
    assert main(["train", "--resume", str(cut), f"dp_max_epsilon={eps[-1] * 2}", "--quiet"]) == 0

    def clips(run):
        return {rec["round"]: rec["dp_clip"] for rec in map(json.loads, (run / "metrics.jsonl").read_text()
                                                            .splitlines()) if "dp_clip" in rec}

    whole, resumed = clips(tmp_path / "whole"), clips(cut)
    assert len(set(whole.values())) > 2 and {k: resumed[k] for k in whole} == whole  # the cut one adds round 5
    summaries = [json.loads((run / "summary.json").read_text()) for run in (tmp_path / "whole", cut)]
    assert summaries[0]["dp_clip_final"] == summaries[1]["dp_clip_final"] == whole[10]


@pytest.mark.slow  # in CI's slow tier: a Ray session of its own, 10 s
def test_ray_actors_clip_to_the_drivers_clip_as_inline():
    # the round's plan travels to the actors with C_r; their clients' bits reach the driver in the partial sums'
    # stats: the same clip sequence as inline (bits are exact; the sums differ in float32 order only)
    clients, test = gaussian_clients(4, seed=2)
    cfg = dict(BASE, iterations=8, dp_clip_quantile=0.6, dp_clip_count_noise=0.6)
    inline = fdam_ray.train_arrays(cfg, clients, test)
    from raytest import ray_session

    with ray_session():
        ray = fdam_ray.train_arrays(dict(cfg, executor="ray", clients_per_actor=2, cpus_per_actor=0.5,
                                         threads_per_actor=1), clients, test)
    assert [h["dp_clip"] for h in ray.history] == [h["dp_clip"] for h in inline.history]
    assert len({h["dp_clip"] for h in inline.history}) > 2
    np.testing.assert_allclose(ray.state.v, inline.state.v, rtol=0, atol=1e-6)


def test_the_flower_executor_is_refused_in_one_line():
    import dataclasses

    from fdam_ray.config import build_config
    from fdam_ray.loop.plug import PlugStart
    from fdam_ray.privacy.driver import PrivacyPlug, RunFacts
    from fdam_ray.privacy.section import PrivacySection

    section = PrivacySection.of(build_config({"dp": "client", "dp_noise_multiplier": 1.0, "positive_ratio": 0.2,
                                              "algorithm": "coda_plus", "model": "linear",
                                              "dp_clip_quantile": 0.5, "dp_clip_count_noise": 1.0}))
    facts = RunFacts(planned_rounds=4, iterations=8, batch_size=0, transport="default", transfer_precision="fp32",
                     labels=("0", "1", "2", "3"), val_fraction=0.0, seed=0)

    @dataclasses.dataclass
    class Flat:
        def initial_state(self):
            e = np.empty(0, np.float32)
            return type("S", (), {"buffers": e, "counters": np.empty(0, np.int64)})()

    class Elsewhere:  # an executor whose clients are built from the run config (a Flower site)
        clients_from_setup = False

    with pytest.raises(ValueError) as caught:
        PrivacyPlug(section, facts).setup(None, PlugStart(Elsewhere(), None, Flat(), None))
    assert "\n" not in str(caught.value) and "dp_clip_quantile" in str(caught.value) and "flower" in str(caught.value)
