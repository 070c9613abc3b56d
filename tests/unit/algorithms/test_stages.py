"""Stage transitions on the server state (algorithms/stages.py) against plain NumPy, and checkpoint timing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fdam_ray
from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.algorithms.stages import after_round, coda_alpha, end_stage, init_server_state
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import build_config
from fdam_ray.core.state import GlobalState, ScoreSums
from fdam_ray.outputs import Observer


def state(rng, n=7, t=2, cv=True, r=0) -> GlobalState:
    f = np.float32
    return GlobalState(rng.normal(size=n).astype(f), rng.normal(size=t).astype(f), rng.normal(size=3).astype(f),
                       np.array([r], np.int64), rng.normal(size=n).astype(f) if cv else None,
                       rng.normal(size=t).astype(f) if cv else None, round=r, iteration=5 * r)


@pytest.mark.parametrize("reference_point", ["average", "last"])
@pytest.mark.parametrize("reset", [True, False])
def test_a_stage_of_rounds_then_its_end_match_numpy(reference_point, reset):
    rng = np.random.default_rng(3)
    v0 = state(rng)
    server = init_server_state(v0)
    np.testing.assert_array_equal(server.reference, v0.v)  # stage 1's centre is v_0
    rounds = [state(rng, r=r) for r in (1, 2, 3)]
    for s in rounds:
        server = after_round(server, s, reference_point=reference_point)
    last = rounds[-1]
    want_c = (np.zeros_like(last.c_v), np.zeros_like(last.c_alpha)) if reset else (last.c_v.copy(), last.c_alpha.copy())
    algorithm = build_algorithm(AlgorithmSection.of(build_config(
        algorithm="codasca", reference_point=reference_point, reset_control_variates=reset)))
    server = algorithm.end_stage(server)  # the stage step, then the drift correction's reset
    want_ref = np.mean([s.v.astype(np.float64) for s in rounds], 0) if reference_point == "average" else last.v
    np.testing.assert_allclose(server.reference, want_ref, rtol=1e-6)
    assert server.reference.dtype == np.float32
    assert server.ref_count == 0 and not server.ref_sum.any()
    assert server.global_state is last  # the next stage starts from the last global iterate
    np.testing.assert_array_equal(server.global_state.c_v, want_c[0])
    np.testing.assert_array_equal(server.global_state.c_alpha, want_c[1])
    # the next stage's average covers only its own rounds
    nxt = state(rng, r=4)
    server = end_stage(after_round(server, nxt, reference_point=reference_point), reference_point=reference_point)
    np.testing.assert_allclose(server.reference, nxt.v, rtol=1e-6)


@pytest.mark.parametrize("objective", ["auc_square", "auc_margin"])
def test_coda_alpha_with_sample_weights_pools_client_sums(objective):
    rng = np.random.default_rng(0)
    h = [rng.random((n, 2)) for n in (30, 11, 50)]  # scores of three clients, two tasks
    y = [(rng.random((n, 2)) < 0.3).astype(float) for n in (30, 11, 50)]
    y[1][:, 1] = np.nan  # a task without labels on one client
    moments = [ScoreSums((hk * (yk == 1)).sum(0), (yk == 1).sum(0), (hk * (yk == 0)).sum(0), (yk == 0).sum(0))
               for hk, yk in zip(h, y, strict=True)]
    moments = [dataclasses.replace(m, client_id=k) for k, m in enumerate(moments)]
    H, Y = np.concatenate(h), np.concatenate(y)
    gap = np.array([H[Y[:, t] == 0, t].mean() - H[Y[:, t] == 1, t].mean() for t in range(2)])
    want = gap if objective == "auc_square" else np.maximum(0, 0.5 + gap)
    p = np.nanmean(Y, axis=0)  # the pooled positive ratio per task
    # with weights n_k and the pooled p, the maximiser of sum_k w_k f_k is E[h|neg] - E[h|pos] of the pooled data
    got = coda_alpha(moments, objective=objective, margin=0.5, positive_ratio=p, weights=np.array([30, 11, 50.0]))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_algorithm_init_zeroes_the_global_control_variate_only_with_drift_correction():
    rng = np.random.default_rng(1)
    for name, has_c in (("codasca", True), ("coda_plus", False), ("scaffold", True)):
        algorithm = build_algorithm(AlgorithmSection.of(build_config(algorithm=name)))
        server = algorithm.init(state(rng, cv=False))
        assert (server.global_state.c_v is not None) == has_c
        if has_c:
            assert not server.global_state.c_v.any() and not server.global_state.c_alpha.any()


class Recorder(Observer):
    def __init__(self):
        self.calls = []

    def start(self, run):
        self.calls.append(("start", run.resumed, run.round))

    def record(self, record, snapshot):
        self.calls.append(("record", record["round"]))

    def round_end(self, plan, record, snapshot):
        self.calls.append(("round_end", plan.round, record is not None))

    def event(self, message, *args, level=0):
        self.calls.append(("event", message % args))

    def finish(self, summary, model, snapshot):
        self.calls.append(("finish", summary["rounds"], sorted(model)))

    def close(self, error):
        self.calls.append(("close", error))


def test_observer_hooks_come_in_order_and_the_run_folder_checkpoints_on_time(tmp_path, monkeypatch):
    from fdam_ray.assembly import recipe

    rec = Recorder()
    saved = []
    original = recipe.RunFolder._checkpoint

    def spy(self, snapshot, round_):
        saved.append(round_)
        original(self, snapshot, round_)

    monkeypatch.setattr(recipe.RunFolder, "_checkpoint", spy)
    cfg = build_config(executor="inline", model="linear", iterations=14, local_steps=2, eval_every=6,
                       stage_length=8, checkpoint_every=3, out_dir=str(tmp_path), run_name="r", tensorboard=False)
    result = recipe.federate(cfg, observers=[rec])
    assert rec.calls[0] == ("start", False, 0) and rec.calls[1] == ("record", 0)
    assert rec.calls[-1] == ("close", None)
    assert rec.calls[-2] == ("finish", 7, ["a", "alpha", "b", "model", "network", "task_names"])
    assert [c[1] for c in rec.calls if c[0] == "round_end"] == list(range(1, 8))
    assert [c[1] for c in rec.calls if c[0] == "record"] == [0, 3, 6, 7]  # iterations 0, 6, 12, 14
    assert ("event", "stage 2 began at iteration 8 (round 5)") in rec.calls
    assert saved == [0, 3, 6, 7]  # round 0, every 3 rounds, the end
    assert result.run_dir == tmp_path / "r" and result.summary["run_dir"] == str(tmp_path / "r")
    ck = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert build_config(ck.config) == cfg and ck.loop.state.round == 7


def test_a_failed_run_closes_every_observer_with_the_error(tmp_path):
    rec = Recorder()

    class Boom(Observer):
        def round_end(self, plan, record, snapshot):
            if plan.round == 2:
                raise RuntimeError("stop here")

    cfg = build_config(executor="inline", model="linear", iterations=10, local_steps=2, out_dir=str(tmp_path),
                       run_name="r", tensorboard=False)
    from fdam_ray.assembly import recipe

    with pytest.raises(RuntimeError, match="stop here"):
        recipe.federate(cfg, observers=[rec, Boom()])
    assert isinstance(rec.calls[-1][1], RuntimeError)
    assert "run stopped: stop here" in (tmp_path / "r" / "train.log").read_text()
    assert fdam_ray.resume(tmp_path / "r", {"iterations": 10}).state.iteration == 10
