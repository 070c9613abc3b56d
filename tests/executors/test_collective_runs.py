"""Runs of rounds (``transport: collective``, ``collective_rounds``): the actors run several rounds back to back and
the driver receives the state only where it needs it.

The federation's side (which rounds form a run, the bookkeeping of a run's rounds, the stage's running sum) is
pinned with an in-process executor that runs a run one round after another with the driver's own reducer: it must
equal the round-at-a-time run bit for bit. The Ray side: a run equals ``collective_rounds: 1`` and classic
``fold_order: client``; a non-finite update or state inside a run stops it with the same error; a client that dies
inside a run undoes the run, which is then recovered as a failure in its first round.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from raytest import OneClientWrapped, ray_session
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.assembly.recipe import run
from fdam_ray.checkpoint import load_checkpoint
from fdam_ray.config import ConfigError, build_config
from fdam_ray.data import DataSource
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import RoundsRun, RunsOfRounds
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.executors.ray.executor import RayExecutor

TIMING = {"wall_s", "samples_per_s"}
FIELDS = ("v", "alpha", "buffers", "counters", "c_v", "c_alpha")


class InlineRuns(InlineExecutor, RunsOfRounds):
    """Runs of at most ``ahead`` rounds, done in process one round after another with the driver's reducer, the
    sum of v kept in float64 as the actors keep it."""

    def __init__(self, ahead: int) -> None:
        super().__init__()
        self.ahead = ahead
        self.runs: list[list[int]] = []
        self.reads: list[bool] = []  # each run's read: whether the driver reads the state after it

    def start(self, setup, source):
        infos = super().start(setup, source)
        self.algorithm = setup.algorithm  # the federation's own
        self.weights = self.algorithm.weights([i.num_train for i in infos])
        return infos

    def rounds_ahead(self) -> int:
        return self.ahead

    def run_rounds(self, state, plans, average, *, read=True):
        self.runs.append([plan.round for plan, _ in plans])
        self.reads.append(read)
        out = RoundsRun(stats=[], counts=[], bytes_up=[], state=None,
                        ref_sum=np.zeros(state.v.shape) if average else None)
        for plan, clients in plans:
            total = None if clients is None else float(
                len(self.clients) if self.weights is None else self.weights.sum())
            reducer = self.algorithm.reducer(state, weights=self.weights, partial_total=total)
            self.run_round(state, plan, reducer.fold, clients)
            state = reducer.finish(steps=plan.steps)
            out.stats.append(list(reducer.stats))
            out.counts.append(reducer.count)
            out.bytes_up.append(reducer.bytes_up)
            if average:
                out.ref_sum += state.v
        out.state = state
        return out


def inline_cfg(tmp_path, name, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=120,
                batch_size=16, algorithm="codasca", local_steps=3, iterations=60, stage_length=20, eval_every=9,
                checkpoint_every=4, out_dir=str(tmp_path), run_name=name, executor="inline", tensorboard=False)
    return build_config(dict(base, **kw))


def assert_same_states(got, want):
    for name in FIELDS:
        a, b = getattr(got.state, name), getattr(want.state, name)
        if b is None:
            assert a is None, name
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


# -- the federation's side, in process -----------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, dict(clients_per_round=2, client_weighting="samples",
                                            reference_point="last")], ids=["every-client", "sampled-last"])
def test_runs_end_where_the_driver_needs_the_state_and_equal_the_round_at_a_time_run(tmp_path, extra):
    plain = run(inline_cfg(tmp_path, "plain", **extra), executor=InlineExecutor())
    executor = InlineRuns(ahead=3)
    got = run(inline_cfg(tmp_path, "runs", **extra), executor=executor)
    # 20 rounds of 3 iterations: evaluations end rounds 3, 6, 9, 12, 15, 18, 20; checkpoints 4, 8, 12, 16, 20;
    # stages begin at rounds 8 and 15; at most 3 rounds a run. Rounds alone (4, 7, 8, 9, 15, 16) run one at a time
    assert executor.runs == [[1, 2, 3], [5, 6], [10, 11, 12], [13, 14], [17, 18], [19, 20]]
    assert executor.reads == [True] * 6  # each ends at an evaluation, a checkpoint, a stage's end (14), the end
    assert_same_states(got, plain)
    strip = lambda h: [{k: v for k, v in r.items() if k not in TIMING} for r in h]
    assert strip(got.history) == strip(plain.history)
    for key in ("bytes_up", "bytes_down", "rounds", "final_test_auc"):
        assert got.summary[key] == plain.summary[key], key
    # the checkpoints hold the same loop: the stage's running sum of v included
    want, have = (load_checkpoint(tmp_path / n / "checkpoint.pt").loop for n in ("plain", "runs"))
    assert have.server.ref_count == want.server.ref_count
    np.testing.assert_array_equal(have.server.ref_sum, want.server.ref_sum)
    if not extra:
        assert want.server.ref_count == 6 and np.abs(want.server.ref_sum).max() > 0  # rounds 15-20 summed


def test_a_run_is_capped_and_a_round_at_a_time_executor_never_runs_one(tmp_path):
    executor = InlineRuns(ahead=2)
    run(inline_cfg(tmp_path, "capped", eval_every=60, checkpoint_every=0, stage_length=60), executor=executor)
    assert executor.runs == [[r, r + 1] for r in range(1, 20, 2)]
    assert executor.reads == [False] * 9 + [True]  # capped runs: nothing reads their state but the end's
    assert not isinstance(InlineExecutor(), RunsOfRounds)  # the federation runs it a round at a time
    assert isinstance(RayExecutor(), RunsOfRounds)


def test_collective_rounds_is_checked_and_documented():
    assert build_config(dict(transport="collective")).collective_rounds == 16
    with pytest.raises(ConfigError, match=r"config field 'collective_rounds': 0 is not allowed \(>= 1\)"):
        build_config(dict(transport="collective", collective_rounds=0))
    from fdam_ray.cli import main

    assert main(["fields", "collective_rounds"]) == 0


# -- on Ray -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_module():
    with ray_session():
        yield


RAY = dict(model="mlp", model_width=8, batch_size="full", seed=2, lr=0.2, local_steps=2, cpus_per_actor=0.5,
           executor="ray", eval_every=8, iterations=24, stage_length=5)


def arrays_run(cfg: dict, clients, test, executor=None, source=None):
    config = build_config(dict(cfg, dataset="arrays", num_clients=len(clients)))
    return run(config, source=source or ArraysSource(clients, test), executor=executor, save=False)


@pytest.mark.parametrize("extra", [
    pytest.param(dict(algorithm="codasca", global_lr=1.1), marks=pytest.mark.slow),  # 17 s; test_collective's
    # collective-equals-classic run stays in the default run
    pytest.param(dict(algorithm="codasca", clients_per_round=3, client_weighting="samples", clients_per_actor=2),
                 marks=pytest.mark.slow),  # three Ray runs, 20 s
], ids=["codasca", "sampled-hosted"])
def test_runs_of_collective_rounds_equal_one_call_per_round_and_classic(ray_module, extra):
    clients, test = gaussian_clients(num_clients=4)
    cfg = dict(RAY, **extra)
    classic = arrays_run(dict(cfg, transport="classic", fold_order="client"), clients, test)
    one = arrays_run(dict(cfg, transport="collective", collective_rounds=1), clients, test)
    executor = RayExecutor()
    got = arrays_run(dict(cfg, transport="collective"), clients, test, executor=executor)
    # rounds of 2 iterations, evaluations every 8, stages of 5 iterations (they begin at rounds 4 and 6)
    assert executor.transport.runs == [[1, 2, 3], [6, 7, 8], [9, 10], [11, 12]]
    assert executor.transport.builds == 1
    for name in FIELDS:
        a, b, c = (getattr(r.state, name) for r in (got, one, classic))
        if c is None:
            assert a is None and b is None, name
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-6, err_msg=name)
    assert [h["iteration"] for h in got.history] == [h["iteration"] for h in classic.history] == [0, 8, 16, 24]
    assert [h["test_auc"] for h in got.history] == pytest.approx([h["test_auc"] for h in classic.history], abs=1e-4)
    for key in ("bytes_up", "bytes_down"):
        assert got.summary[key] == classic.summary[key], key


class PoisonedDataset(torch.utils.data.Dataset):
    """A client's samples; from read ``bad`` on they are NaN (``nan``), or the process ends there, once
    (``die``: the marker file says it happened, so the replacement lives)."""

    def __init__(self, x, y, bad: int, how: str, marker: str) -> None:
        self.x, self.y, self.bad, self.how, self.marker, self.reads = x, y, bad, how, marker, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.reads += 1
        x = self.x[i]
        if self.reads >= self.bad:
            if self.how == "nan":
                x = np.full_like(x, np.nan)
            elif not os.path.exists(self.marker):
                Path(self.marker).touch()
                os._exit(1)
        return torch.from_numpy(x), torch.from_numpy(self.y[i])


class PoisonedSource(OneClientWrapped):
    """Client ``victim`` of ``inner`` reads through a :class:`PoisonedDataset`."""

    def __init__(self, inner: DataSource, victim: int, bad: int, how: str, marker: str) -> None:
        super().__init__(inner, victim)
        self.bad, self.how, self.marker = bad, how, marker

    def dataset(self, x, y) -> torch.utils.data.Dataset:
        return PoisonedDataset(x, y, self.bad, self.how, self.marker)


# batches of 4 of 40 samples, 2 steps a round: 8 reads a round, so read 8 (r - 1) + 3 falls in round r
POISON = dict(RAY, batch_size=4, eval_every=12, stage_length=100, algorithm="codasca")


@pytest.mark.slow  # in CI's slow tier: 10 s; tests/loop/test_runs.py stops a diverged run in the default run
def test_a_nan_update_inside_a_run_stops_it_with_the_round_at_a_time_error(ray_module, tmp_path):
    clients, test = gaussian_clients(num_clients=3)
    source = lambda: PoisonedSource(ArraysSource(clients, test), 1, 8 * 4 + 3, "nan", "")
    for rounds in (1, 16):
        executor = RayExecutor()
        with pytest.raises(fdam_ray.DivergenceError, match=r"^round 5: client 1 sent a NaN or infinite update"):
            arrays_run(dict(POISON, transport="collective", collective_rounds=rounds), clients, test,
                       executor=executor, source=source())
        assert executor.transport.runs == ([] if rounds == 1 else [[1, 2, 3, 4, 5, 6]])


@pytest.mark.slow  # 10 s; the NaN case above is the default run's
def test_a_state_that_overflows_inside_a_run_stops_it_with_the_round_at_a_time_error(ray_module):
    clients, test = gaussian_clients(num_clients=3)
    for rounds in (1, 16):
        with pytest.raises(fdam_ray.DivergenceError, match=r"^round 1: the global state became NaN or infinite"):
            arrays_run(dict(POISON, transport="collective", collective_rounds=rounds, global_lr=1e39), clients,
                       test)


@pytest.mark.fault  # three Ray runs, two with a replacement, 30 s (benchmarks/fault_tests.py)
def test_a_client_that_dies_inside_a_run_undoes_it_and_the_run_recovers_as_from_its_first_round(ray_module,
                                                                                                tmp_path):
    clients, test = gaussian_clients(num_clients=3)
    cfg = dict(POISON, transport="collective", iterations=24, positive_ratio=0.3)
    dies = PoisonedSource(ArraysSource(clients, test), 1, 8 * 10 + 3, "die", str(tmp_path / "died"))
    executor = RayExecutor()
    got = arrays_run(cfg, clients, test, executor=executor, source=dies)
    assert (tmp_path / "died").exists()
    # it died in round 11 of the run of rounds 7-12: that run was undone and ran again one round at a time, the
    # replacement from round 7 (from the global c)
    assert [(e["client"], e["round"]) for e in executor.events] == [(1, 7)]
    assert executor.events[0]["outcome"].startswith("replaced")
    assert executor.transport.runs == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    # the same as a run of one round a call whose client 1 dies in round 7 (the others keep their round 7 sums)
    in_round_7 = PoisonedSource(ArraysSource(clients, test), 1, 8 * 6 + 3, "die", str(tmp_path / "died-in-7"))
    want = arrays_run(dict(cfg, collective_rounds=1), clients, test, source=in_round_7)
    assert (tmp_path / "died-in-7").exists()
    plain = arrays_run(dict(cfg, collective_rounds=1), clients, test)
    for name in ("v", "alpha", "c_v", "c_alpha"):
        np.testing.assert_allclose(getattr(got.state, name), getattr(want.state, name), rtol=0, atol=1e-7,
                                   err_msg=name)
    assert np.abs(got.state.c_v - plain.state.c_v).max() > 1e-4  # the replacement did change the run
    assert got.state.round == 12
