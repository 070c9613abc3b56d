"""Run folders: outputs, checkpoints, resume, divergence, plots, progress, and what crosses to the driver."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sample_clients import arrays_in

import fdam_ray
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from fdam_ray.cli import main
from fdam_ray.config import build_config
from fdam_ray.executors.inline import InlineExecutor

TIMING = {"wall_s", "samples_per_s"}
# written by fdam-ray before checkpoints were typed (schema 1); see tests/unit/loop/test_checkpoint.py
OLD_CHECKPOINT = Path(__file__).parents[1] / "fixtures" / "checkpoint_v1.pt"


def cfg(tmp_path, **kw):
    base = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=120,
                batch_size=16, algorithm="codasca", local_steps=3, iterations=60, stage_length=20, eval_every=9,
                checkpoint_every=4, out_dir=str(tmp_path), run_name="run", executor="inline", tensorboard=False)
    base.update(kw)
    return build_config(base)


def without_timing(history):
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_run_folder_holds_every_output(tmp_path):
    r = run(cfg(tmp_path, tensorboard=True))
    files = {p.name for p in r.run_dir.iterdir()}
    assert files >= {"config.yaml", "metrics.jsonl", "metrics.csv", "train.log", "checkpoint.pt", "model.pt",
                     "summary.json", "events"}
    assert any((r.run_dir / "events").iterdir())
    lines = (r.run_dir / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("iteration,round,stage,lr,train_loss,test_auc") and "client_auc.2" in lines[0]
    assert len(lines) == 1 + len(r.history)
    log = (r.run_dir / "train.log").read_text()
    assert log.count("test_auc") == len(r.history) and "stage 2 began at iteration 21" in log
    saved = torch.load(r.run_dir / "model.pt", weights_only=True)
    model = fdam_ray.models.build_model("mlp", (20,), 1, width=16)
    model.load_state_dict(saved["model"])
    summary = json.loads((r.run_dir / "summary.json").read_text())
    assert summary["final_test_auc"] == r.history[-1]["test_auc"]
    assert {"best_test_auc", "rounds", "bytes_up", "bytes_down", "wall_s", "samples_per_s"} <= set(summary)


def test_a_tensorboard_that_fails_to_import_is_silent_with_auto_and_one_line_with_true(tmp_path, monkeypatch,
                                                                                       caplog):
    import builtins

    real_import = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    r = run(cfg(tmp_path, tensorboard="auto", iterations=6))
    assert "tensorboard" not in caplog.text.lower() and not (r.run_dir / "events").exists()
    with pytest.raises(ValueError, match="'tensorboard': true, but TensorBoard cannot be imported"):
        run(cfg(tmp_path / "true", tensorboard=True, iterations=6))


def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, monkeypatch):
    # Uninterrupted reference, with stage switches, control variates and minibatch sampling in play.
    full = run(cfg(tmp_path / "a"))
    original = InlineExecutor.run_round
    calls = {"n": 0}

    def crash_in_round_11(self, state, plan, fold):
        calls["n"] += 1
        if plan.round == 11:
            raise KeyboardInterrupt
        return original(self, state, plan, fold)

    monkeypatch.setattr(InlineExecutor, "run_round", crash_in_round_11)
    with pytest.raises(KeyboardInterrupt):
        run(cfg(tmp_path / "b"))
    assert load_checkpoint(tmp_path / "b" / "run" / "checkpoint.pt").loop.state.round == 8
    monkeypatch.setattr(InlineExecutor, "run_round", original)
    resumed = resume(tmp_path / "b" / "run")
    for name in ("v", "alpha", "buffers", "counters", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(resumed.state, name), getattr(full.state, name), err_msg=name)
    assert without_timing(resumed.history) == without_timing(full.history)
    lines = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert without_timing(lines) == without_timing(full.history)  # no duplicate or lost records
    assert resumed.summary["bytes_up"] == full.summary["bytes_up"]


def test_resume_with_a_longer_run_continues(tmp_path):
    run(cfg(tmp_path, iterations=30))
    longer = resume(tmp_path / "run", {"iterations": 45})
    assert longer.state.iteration == 45 and longer.history[-1]["iteration"] == 45


def test_resume_refuses_a_different_config_and_damages_nothing(tmp_path, capsys):
    run(cfg(tmp_path, iterations=12))
    before = snapshot(tmp_path / "run")
    assert main(["train", "--resume", str(tmp_path / "run"), "lr=0.5", "local_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "lr: 0.1 -> 0.5" in err and "local_steps: 3 -> 4" in err
    assert snapshot(tmp_path / "run") == before


def test_truncated_checkpoint_is_reported_and_left_alone(tmp_path, capsys):
    run(cfg(tmp_path, iterations=12))
    ck = tmp_path / "run" / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])
    before = snapshot(tmp_path / "run")
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert "cannot be read (damaged, truncated" in capsys.readouterr().err
    assert snapshot(tmp_path / "run") == before


def test_checkpoints_never_unpickle_arbitrary_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("this must not run",))

    torch.save({"format": "fdam-ray-checkpoint/1", "payload": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(tmp_path / "evil.pt")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ck = load_checkpoint(OLD_CHECKPOINT)
    save_checkpoint(path, ck)
    assert load_checkpoint(path).loop.history == ck.loop.history
    np.testing.assert_array_equal(load_checkpoint(path).loop.state.v, ck.loop.state.v)

    def dies_mid_write(obj, fh, *a, **k):
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_mid_write)
    later = dataclasses.replace(ck, loop=dataclasses.replace(ck.loop, history=[]))
    with pytest.raises(OSError):
        save_checkpoint(path, later)
    assert load_checkpoint(path).loop.history == ck.loop.history  # previous one intact
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left


def test_divergence_names_round_and_client_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    from fdam_ray.clients.client import Client

    original = Client.local_round

    def poisoned(self, state, plan, **kw):
        if plan.round == 6 and self.client_id == 1:
            self.solver.prox_ref[0] = np.nan  # its next step turns v into NaN
        return original(self, state, plan, **kw)

    monkeypatch.setattr(Client, "local_round", poisoned)
    with pytest.raises(fdam_ray.DivergenceError, match="round 6: client 1 sent a NaN"):
        run(cfg(tmp_path))
    ck = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert ck.loop.state.round == 4 and np.isfinite(ck.loop.state.v).all()
    assert "run stopped: round 6: client 1" in (tmp_path / "run" / "train.log").read_text()


def test_progress_bar_shows_round_stage_lr_and_auc(tmp_path, capsys):
    run(cfg(tmp_path, iterations=12), progress=True)
    err = capsys.readouterr().err
    assert "12/12" in err and "auc=" in err and "stage=" in err and "lr=" in err


def test_plot_draws_the_papers_figures(tmp_path, capsys):
    dirs = []
    for alg in ("coda_plus", "codasca"):
        for i in (1, 4):
            r = run(cfg(tmp_path, algorithm=alg, local_steps=i, iterations=12, run_name=f"{alg}-{i}"))
            dirs.append(str(r.run_dir))
    assert main(["plot", *dirs, "--out", str(tmp_path / "fig")]) == 0
    names = {p.name for p in (tmp_path / "fig").iterdir()}
    assert names == {"auc_vs_iterations.png", "auc_vs_bytes.png", "auc_vs_local_steps.png"}
    for p in (tmp_path / "fig").iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_plot_draws_task_bars_for_multilabel_runs(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((90, 4)).astype(np.float32)
    Y = np.stack([X[:, 0] > 0, X[:, 1] > 0.5], 1).astype(np.float32)
    r = fdam_ray.train_arrays(dict(model="linear", iterations=6, local_steps=2, out_dir=str(tmp_path),
                                   run_name="ml", executor="inline", tensorboard=False),
                              [(X[:30], Y[:30]), (X[30:60], Y[30:60])], (X[60:], Y[60:]), save=True)
    from fdam_ray.plots import plot_runs

    assert "task_auc.png" in {p.name for p in plot_runs([r.run_dir], tmp_path / "f")}


def test_no_training_sample_crosses_to_the_driver(tmp_path, monkeypatch):
    """Everything a client returns is counts, state-sized buffers, or scores of test data."""
    from fdam_ray.clients.client import Client

    returned = []
    for name in ("info", "local_round", "evaluate", "score_sums", "get_state"):
        original = getattr(Client, name)

        def spy(self, *a, _orig=original, **k):
            out = _orig(self, *a, **k)
            returned.append((self, out))
            return out

        monkeypatch.setattr(Client, name, spy)
    run(cfg(tmp_path, algorithm="coda", iterations=24))

    assert len(returned) > 20
    for client, out in returned:
        train_bytes = client.train.x.numpy().tobytes()
        # model-state buffers, or scores/labels of the client's own test split; never a feature array
        limit = max(client.flat.state_size, len(client.test) * client.test.y.shape[1])
        for arr in arrays_in(out):
            if arr.dtype.kind == "f":
                assert arr.size <= limit
                if arr.size >= 20:
                    assert arr.tobytes() not in train_bytes


def test_resume_with_more_iterations_makes_the_stage_switch_the_shorter_run_left_out(tmp_path):
    # 24 iterations end exactly where stage 2 would end; resumed to 36 the switch must still happen.
    longer = run(cfg(tmp_path / "a", iterations=36, stage_length=12, algorithm="coda"))
    run(cfg(tmp_path / "b", iterations=24, stage_length=12, algorithm="coda"))
    resumed = resume(tmp_path / "b" / "run", {"iterations": 36})
    for name in ("v", "alpha", "buffers", "counters"):
        np.testing.assert_array_equal(getattr(resumed.state, name), getattr(longer.state, name), err_msg=name)
    # the shorter run also evaluated at its end (iteration 24); every record of the longer run is there too
    by_iteration = {h["iteration"]: h for h in resumed.history}
    for h in longer.history:
        assert by_iteration[h["iteration"]]["test_auc"] == h["test_auc"]
        assert by_iteration[h["iteration"]]["bytes_down"] == h["bytes_down"]
    assert "stage 3 began at iteration 24" in (tmp_path / "b" / "run" / "train.log").read_text()


def test_a_run_stopped_before_its_first_periodic_checkpoint_can_be_resumed(tmp_path, monkeypatch):
    original = InlineExecutor.run_round

    def crash(self, state, plan, fold):
        if plan.round == 2:
            raise KeyboardInterrupt
        return original(self, state, plan, fold)

    monkeypatch.setattr(InlineExecutor, "run_round", crash)
    with pytest.raises(KeyboardInterrupt):
        run(cfg(tmp_path, checkpoint_every=100))
    monkeypatch.setattr(InlineExecutor, "run_round", original)
    assert resume(tmp_path / "run").state.iteration == 60
