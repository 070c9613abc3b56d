"""Rebuilt clients in a record (fdam_ray.executors.rebuilds): a replay rebuilds a recorded client at its round.

The oracle is the resume path, which rebuilds a client by another mechanism: a checkpoint whose client 1 is
marked ``rebuild`` starts that client afresh from its shard with the global c
(fdam_ray.loop.unplaced.rebuilt_states). A run that replays ``rebuilt = {5: [1]}`` from its start must end where
the run stopped after round 4 and resumed with client 1 rebuilt ends, bit for bit (inline).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sample_clients import gaussian_clients

import fdam_ray
from fdam_ray.checkpoint import ClientState, load_checkpoint, save_checkpoint
from fdam_ray.data.arrays import ArraysSource

# batches of 8 (the sampler's position matters), 3 rounds a stage, round 5 mid-stage (the global c is not zero)
CASE = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
            iterations=24, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6)


def _gap(a, b) -> float:
    return max(float(np.abs(x.astype(np.float64) - b.state.vectors()[n]).max())
               for n, x in a.state.vectors().items() if x is not None and x.size)


def _record(tmp_path, clients, test, rebuilt: dict) -> str:
    """A run folder of CASE whose checkpoint records ``rebuilt`` (and no participating set)."""
    run = fdam_ray.train_arrays(dict(CASE, out_dir=str(tmp_path / "recorded")), clients, test, save=True)
    path = run.run_dir / "checkpoint.pt"
    checkpoint = load_checkpoint(path)
    checkpoint.loop = dataclasses.replace(checkpoint.loop, rebuilt=rebuilt)
    save_checkpoint(path, checkpoint)
    return str(run.run_dir)


def test_a_replayed_rebuild_equals_the_resume_that_rebuilds_that_client(tmp_path):
    clients, test = gaussian_clients(num_clients=3, n=60)
    first = fdam_ray.train_arrays(dict(CASE, iterations=12, out_dir=str(tmp_path / "first")), clients, test,
                                  save=True)  # rounds 1-4
    path = first.run_dir / "checkpoint.pt"
    checkpoint = load_checkpoint(path)
    assert checkpoint.loop.state.round == 4 and checkpoint.loop.rebuilt == {}
    checkpoint.clients[1] = ClientState(1, rebuild=True)  # client 1 lost: rebuilt when the run goes on
    save_checkpoint(path, checkpoint)
    oracle = fdam_ray.resume(first.run_dir, {"iterations": 24}, source=ArraysSource(clients, test))

    replay = fdam_ray.train_arrays(dict(CASE, participation_record=_record(tmp_path, clients, test, {"5": [1]})),
                                   clients, test)
    plain = fdam_ray.train_arrays(CASE, clients, test)
    assert _gap(replay, oracle) == 0.0
    assert _gap(replay, plain) > 1e-4  # the rebuild changed the run


def test_a_record_with_rebuilt_clients_is_refused_where_it_cannot_be_replayed(tmp_path):
    clients, test = gaussian_clients(num_clients=3, n=60)
    where = _record(tmp_path, clients, test, {"5": [1]})
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"rebuilds client 1 at round 5 .*RayExecutor cannot replay: replay it "
                                         r"with executor=inline"):
        fdam_ray.train_arrays(dict(CASE, executor="ray", participation_record=where, out_dir=str(out)), clients,
                              test, save=True)
    assert not out.exists() or not any(out.iterdir())  # refused before a run folder or a Ray cluster

    for rebuilt, why in [({"9": [1]}, r"rebuilt clients of round 9, past round 8"),
                         ({"5": [3]}, r"round 5 rebuilds client 3, outside 0..2"),
                         ({"x": [1]}, r"round key 'x' is not a round number")]:
        where = _record(tmp_path / why[:12], clients, test, rebuilt)
        with pytest.raises(ValueError, match=r"participation_record.*cannot be replayed: " + why):
            fdam_ray.train_arrays(dict(CASE, participation_record=where), clients, test)
