"""A run's life: what a resume may change, finished runs, the two-stage recipe stopped and resumed, a run that
fails before it trains, a full disk, the inline executor's threads and the fields it ignores, own Datasets'
run folders, and plots of runs whose AUC is NaN. All inline: no Ray."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from own_fixtures import PairDataset, client_arrays

import fdam_ray
from fdam_ray import checkpoint as checkpoint_module
from fdam_ray.assembly.recipe import resume, run
from fdam_ray.checkpoint import DiskFullError, load_checkpoint
from fdam_ray.cli import main
from fdam_ray.config import FIELDS, RESUME_MAY_CHANGE, build_config
from fdam_ray.executors.inline import InlineExecutor
from fdam_ray.loop.evaluation import Evaluator
from fdam_ray.outputs import RunStopped, clear_stop_request, request_stop
from fdam_ray.plots import plot_runs

SMALL = dict(dataset="synthetic", model="mlp", model_width=16, num_clients=3, samples_per_client=120,
             batch_size=16, algorithm="codasca", local_steps=3, iterations=30, stage_length=12, eval_every=9,
             checkpoint_every=2, executor="inline", tensorboard=False)


@pytest.fixture(autouse=True)
def _no_stop_left_behind():
    yield
    clear_stop_request()


def cfg(out: Path, **kw):
    return build_config({**SMALL, "out_dir": str(out), "run_name": "run", **kw})


def args(out: Path, **kw) -> list[str]:
    return [f"{k}={v}" for k, v in {**SMALL, "out_dir": str(out), **kw}.items()]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


# -- bug 7: a resume never makes a run's record lie ------------------------------------------------------------

def test_a_resume_that_would_shorten_a_run_is_refused_in_one_line_and_rewrites_nothing(tmp_path, capsys):
    run(cfg(tmp_path))
    before = files_of(tmp_path / "run")
    assert main(["train", "--resume", str(tmp_path / "run"), "iterations=15"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "iterations=15" in line and "the run's iterations is 30" in line and "Traceback" not in line
    assert "give iterations >= 30" in line
    assert files_of(tmp_path / "run") == before


def test_an_unfinished_run_may_end_earlier_than_planned_but_not_before_where_it_is(tmp_path, monkeypatch, capsys):
    stop_in_round(monkeypatch, 5)  # iteration 15 of 30
    with pytest.raises(RunStopped):
        run(cfg(tmp_path))
    clear_stop_request()
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "run"), "iterations=12"]) == 2
    assert "iterations=12" in one_line(capsys.readouterr().err)
    shorter = resume(tmp_path / "run", {"iterations": 21})
    assert shorter.state.iteration == 21 and shorter.history[-1]["iteration"] == 21
    assert "iterations: 21" in (tmp_path / "run" / "config.yaml").read_text()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["iteration"] == 21


def test_resuming_a_finished_run_says_it_is_finished_and_rewrites_nothing(tmp_path, capsys, caplog):
    first = run(cfg(tmp_path))
    before = files_of(tmp_path / "run")
    for extra in ([], ["eval_every=5"]):  # a change of how it runs has nothing to run: the record stays as it was
        caplog.clear()
        assert main(["train", "--resume", str(tmp_path / "run"), *extra]) == 0
        captured = capsys.readouterr()
        assert "already finished (iteration 30 of iterations=30)" in caplog.text
        assert f"final test AUC {first.summary['final_test_auc']:.4f}" in captured.out
        assert files_of(tmp_path / "run") == before
    again = resume(tmp_path / "run")
    assert again.history == first.history and again.summary == json.loads((tmp_path / "run" / "summary.json")
                                                                           .read_text())
    for key, value in first.model_state.items():
        assert torch.equal(again.model_state[key], value), key


def test_config_yaml_repeats_the_run_a_resume_that_fails_before_its_first_checkpoint_leaves_it(tmp_path, monkeypatch):
    run(cfg(tmp_path))
    config_before = (tmp_path / "run" / "config.yaml").read_text()

    def fail(self, state, plan, fold, clients=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(InlineExecutor, "run_round", fail)
    with pytest.raises(KeyboardInterrupt):
        resume(tmp_path / "run", {"iterations": 45})
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before  # still the 30-iteration run
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").config["iterations"] == 30
    monkeypatch.undo()
    longer = resume(tmp_path / "run", {"iterations": 45})
    assert longer.state.iteration == 45
    assert "iterations: 45" in (tmp_path / "run" / "config.yaml").read_text()


# -- bug 10: the printed resume command of a stopped pre-training continues the whole recipe --------------------

RECIPE = dict(pretrain_iterations=12, iterations=12, eval_every=6, checkpoint_every=100, run_name="rec")


def stop_in_round(monkeypatch, round_: int, nth: int = 1) -> None:
    """SIGTERM's effect (a stop asked for) during the ``nth`` run's round ``round_``."""
    original = InlineExecutor.run_round
    seen = {"n": 0}

    def run_round(self, state, plan, fold, clients=None):
        if plan.round == round_:
            seen["n"] += 1
            if seen["n"] == nth:
                request_stop("received SIGTERM")
        return original(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", run_round)


def final_model(folder: Path) -> dict:
    return torch.load(folder / "model.pt", weights_only=True)


def assert_same_model(a: dict, b: dict) -> None:
    for key in ("model", "a", "b", "alpha"):
        got, want = a[key], b[key]
        if isinstance(got, dict):
            for name in want:
                assert torch.equal(got[name], want[name]), name
        else:
            assert torch.equal(got, want), key


def test_a_recipe_stopped_in_pretraining_resumes_into_stage_2_bit_identical(tmp_path, monkeypatch, capsys):
    assert main(["train", *args(tmp_path / "whole", **RECIPE), "--quiet"]) == 0
    whole = tmp_path / "whole"
    assert json.loads((whole / "rec" / "summary.json").read_text())["algorithm"] == "codasca"

    cut = tmp_path / "cut"
    stop_in_round(monkeypatch, 2)  # round 2 of 4 of stage 1 (fedavg, bce)
    assert main(["train", *args(cut, **RECIPE), "--quiet"]) == 143
    err = capsys.readouterr().err
    assert f"continue with: fdam train --resume {cut / 'rec-pretrain'}" in err
    assert not (cut / "rec").exists() and not (cut / "rec-pretrain" / "model.pt").exists()
    monkeypatch.undo()

    # the original command again: refused, naming the command that continues the run
    assert main(["train", *args(cut, **RECIPE), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "already exists" in line and f"fdam train --resume {cut / 'rec-pretrain'}" in line

    assert main(["train", "--resume", str(cut / "rec-pretrain"), "--quiet"]) == 0
    summary = json.loads((cut / "rec" / "summary.json").read_text())
    assert summary["algorithm"] == "codasca" and summary["iterations"] == 12
    assert_same_model(final_model(cut / "rec-pretrain"), final_model(whole / "rec-pretrain"))
    assert_same_model(final_model(cut / "rec"), final_model(whole / "rec"))  # stage 2 as if never stopped
    assert (cut / "rec" / "metrics.jsonl").read_text().count("\n") == (whole / "rec" / "metrics.jsonl"
                                                                      ).read_text().count("\n")


def test_resuming_stage_1_after_stage_2_was_stopped_continues_stage_2(tmp_path, monkeypatch, capsys):
    assert main(["train", *args(tmp_path / "whole", **RECIPE), "--quiet"]) == 0
    cut = tmp_path / "cut"
    stop_in_round(monkeypatch, 2, nth=2)  # round 2 of stage 2
    assert main(["train", *args(cut, **RECIPE), "--quiet"]) == 143
    assert f"fdam train --resume {cut / 'rec'}" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["train", "--resume", str(cut / "rec-pretrain"), "--quiet"]) == 0  # the older printed command
    assert_same_model(final_model(cut / "rec"), final_model(tmp_path / "whole" / "rec"))


def test_a_recipe_whose_stage_2_failed_to_start_reruns_stage_2_from_stage_1s_folder(tmp_path, monkeypatch):
    assert main(["train", *args(tmp_path / "whole", **RECIPE), "--quiet"]) == 0
    cut = tmp_path / "cut"
    original = Evaluator.__call__
    calls = {"n": 0}

    def fail_first_stage_2_evaluation(self, state):
        calls["n"] += 1
        if calls["n"] == 4:  # stage 1 evaluates at 0, 6 and 12; then stage 2's initial evaluation
            raise ValueError("the test set cannot be read")
        return original(self, state)

    monkeypatch.setattr(Evaluator, "__call__", fail_first_stage_2_evaluation)
    assert main(["train", *args(cut, **RECIPE), "--quiet"]) == 2
    assert not (cut / "rec").exists()  # stage 2 never trained: its folder is gone
    monkeypatch.undo()
    assert main(["train", "--resume", str(cut / "rec-pretrain"), "--quiet"]) == 0
    assert_same_model(final_model(cut / "rec"), final_model(tmp_path / "whole" / "rec"))


@pytest.mark.slow  # in CI's slow tier: an fdam process signalled, 11 s
def test_sigterm_to_fdam_train_in_pretraining_prints_a_resume_that_runs_stage_2(tmp_path):
    import signal

    from test_faults import SMALL as FAULT_SMALL
    from test_faults import records, start_fdam, stop, wait_for

    recipe = ["executor=inline", "pretrain_iterations=2000", "iterations=40", "checkpoint_every=100000",
              *FAULT_SMALL]
    assert main(["train", f"out_dir={tmp_path / 'whole'}", "run_name=rec", *recipe, "--quiet"]) == 0
    stage1 = tmp_path / "cut" / "rec-pretrain"
    proc = start_fdam(["train", f"out_dir={tmp_path / 'cut'}", "run_name=rec", *recipe], tmp_path,
                      tmp_path / "cut.log")
    try:
        wait_for(lambda: len(records(stage1)) >= 2, proc, tmp_path / "cut.log", timeout_s=180)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        stop(proc)
    output = (tmp_path / "cut.log").read_text()
    assert rc == 143 and f"continue with: fdam train --resume {stage1}" in output, output[-3000:]
    assert not (tmp_path / "cut" / "rec").exists()
    assert main(["train", "--resume", str(stage1), "--quiet"]) == 0
    summary = json.loads((tmp_path / "cut" / "rec" / "summary.json").read_text())
    assert summary["algorithm"] == "codasca" and summary["iterations"] == 40
    assert_same_model(final_model(tmp_path / "cut" / "rec"), final_model(tmp_path / "whole" / "rec"))


# -- a run that fails before it trains leaves no folder behind --------------------------------------------------

def test_a_run_that_fails_during_set_up_leaves_no_folder_and_its_name_runs_again(tmp_path, monkeypatch, capsys):
    def broken(self, state):
        raise ValueError("client 1: sample 3 cannot be read")

    monkeypatch.setattr(Evaluator, "__call__", broken)
    assert main(["train", *args(tmp_path, run_name="again"), "--quiet"]) == 2
    assert "sample 3 cannot be read" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    monkeypatch.undo()
    assert main(["train", *args(tmp_path, run_name="again"), "--quiet"]) == 0


def test_a_folder_that_was_there_empty_stays_and_a_trained_one_is_kept(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(Evaluator, "__call__", lambda self, state: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError):
        run(cfg(tmp_path, run_name="empty"))
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    monkeypatch.undo()
    original = InlineExecutor.run_round

    def fail_in_round_3(self, state, plan, fold, clients=None):
        if plan.round == 3:
            raise RuntimeError("lost")
        return original(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", fail_in_round_3)
    with pytest.raises(RuntimeError):
        run(cfg(tmp_path, run_name="trained"))
    assert load_checkpoint(tmp_path / "trained" / "checkpoint.pt").loop.state.round == 2


# -- a full disk -----------------------------------------------------------------------------------------------

class FullDisk:
    """A file whose writes fail with ENOSPC once ``full`` is set."""

    full = False

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        if FullDisk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_previous_checkpoint_stays(tmp_path, monkeypatch,
                                                                                        capsys):
    real_fdopen = os.fdopen
    monkeypatch.setattr(checkpoint_module.os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    FullDisk.full = False
    original = InlineExecutor.run_round

    def fill_the_disk_in_round_3(self, state, plan, fold, clients=None):
        FullDisk.full = FullDisk.full or plan.round == 3
        return original(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", fill_the_disk_in_round_3)
    try:
        assert main(["train", *args(tmp_path, run_name="full"), "--quiet"]) == 1
    finally:
        FullDisk.full = False
    err = capsys.readouterr().err
    line = one_line(err)
    assert f"no space left on {tmp_path / 'full'}" in line and "previous one is kept" in line
    assert "unexpected pos" not in err and "Traceback" not in err
    assert load_checkpoint(tmp_path / "full" / "checkpoint.pt").loop.state.round == 2
    assert not [p for p in (tmp_path / "full").iterdir() if p.name.endswith(".tmp")]
    FullDisk.full = True
    try:  # from Python: a DiskFullError (an OSError) that names the folder
        with pytest.raises(DiskFullError, match=f"^no space left on {re.escape(str(tmp_path / 'full'))} "):
            checkpoint_module.save_checkpoint(tmp_path / "full" / "checkpoint.pt",
                                              load_checkpoint(tmp_path / "full" / "checkpoint.pt"))
    finally:
        FullDisk.full = False
    assert load_checkpoint(tmp_path / "full" / "checkpoint.pt").loop.state.round == 2
    monkeypatch.setattr(InlineExecutor, "run_round", original)
    assert resume(tmp_path / "full").state.iteration == 30


def test_a_full_disk_while_metrics_are_written_names_the_folder(tmp_path, monkeypatch):
    from fdam_ray.outputs.writer import RunWriter

    run(cfg(tmp_path, iterations=12))

    def full(self, rec):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunWriter, "_append_metrics", full)
    with pytest.raises(DiskFullError, match=f"^no space left on {re.escape(str(tmp_path / 'run'))} "):
        resume(tmp_path / "run", {"iterations": 24})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").loop.state.iteration == 12


# -- what a resume may change: one list, from the fields' own declarations --------------------------------------

def test_reduce_and_placement_timeout_may_change_on_resume(tmp_path):
    run(cfg(tmp_path, iterations=12))
    longer = resume(tmp_path / "run", {"iterations": 18, "reduce": "node", "placement_timeout_s": 5})
    assert longer.state.iteration == 18
    assert {"reduce", "placement_timeout_s", "transport", "channel_wait", "trackers"} <= RESUME_MAY_CHANGE


def test_the_readme_lists_exactly_the_fields_that_may_change_on_resume():
    readme = " ".join((Path(__file__).parents[2] / "docs/how-to/resume.md").read_text(encoding="utf-8").split())
    listed = re.search(r"may differ on resume \([^)]*\): (.*?)\. Anything else is refused", readme)
    assert listed is not None, "docs/how-to/resume.md's list of fields that may change on resume"
    names = re.findall(r"`(\w+)`", listed.group(1))
    assert names == [f.name for f in FIELDS if f.resume]


# -- the inline executor: its threads, and the Ray fields it ignores ---------------------------------------------

def threads_seen(monkeypatch) -> list[int]:
    seen: list[int] = []
    original = InlineExecutor.run_round

    def spy(self, state, plan, fold, clients=None):
        seen.append(torch.get_num_threads())
        return original(self, state, plan, fold, clients)

    monkeypatch.setattr(InlineExecutor, "run_round", spy)
    return seen


def test_the_inline_executor_runs_one_thread_unless_told_and_gives_the_callers_back(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = threads_seen(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = run(cfg(tmp_path, iterations=6), save=False)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        two = run(cfg(tmp_path, iterations=6, threads_per_actor=2), save=False)
        assert set(seen) == {2} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting is left alone
        run(cfg(tmp_path, iterations=6), save=False)
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)
    for key, value in one.model_state.items():  # the thread count changes no result here
        assert torch.equal(two.model_state[key], value), key


def test_ray_fields_an_inline_run_ignores_are_named_in_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        run(cfg(tmp_path, iterations=3, transport="compiled", client_resources=[{"site": 1}] * 3,
                 fold_order="client"), save=False)
    warnings = [r.getMessage() for r in caplog.records if "executor=inline ignores" in r.getMessage()]
    assert len(warnings) == 1
    assert "transport='compiled'" in warnings[0] and "client_resources=" in warnings[0]
    assert "fold_order='client'" in warnings[0] and "seed" not in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        run(cfg(tmp_path, iterations=3), save=False)
    assert "ignores" not in caplog.text


# -- a pooled test set that shrinks is reported ------------------------------------------------------------------

def test_a_pooled_test_set_that_shrinks_is_a_warning_and_each_record_keeps_its_size(caplog, monkeypatch):
    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(40, 5)).astype(np.float32), (rng.random(40) < 0.4).astype(np.float32))
             for _ in range(4)]
    original = InlineExecutor.evaluate
    calls = {"n": 0}

    def lose_client_3_after_the_first_evaluation(self, state):
        calls["n"] += 1
        parts = original(self, state)
        return parts if calls["n"] == 1 else [p for p in parts if p.client_id != 3]

    monkeypatch.setattr(InlineExecutor, "evaluate", lose_client_3_after_the_first_evaluation)
    config = dict(model="mlp", model_width=8, batch_size=8, local_steps=2, iterations=4, eval_every=2,
                  executor="inline", algorithm="codasca")
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        result = fdam_ray.train_arrays(config, pairs, None, client_tests=pairs)
    assert [h["test_samples"] for h in result.history] == [160, 120, 120]
    shrank = [r.getMessage() for r in caplog.records if "pooled test set" in r.getMessage()]
    assert len(shrank) == 1 and "120 samples at iteration 2, 160 at the evaluation before" in shrank[0]


# -- train_datasets writes the run folder its config names -------------------------------------------------------

def test_train_datasets_writes_the_run_folder_its_config_names(tmp_path):
    trains = [client_arrays(k, 2, "train") for k in range(2)]
    tests = [client_arrays(k, 2, "test") for k in range(2)]
    config = dict(executor="inline", batch_size=8, local_steps=2, iterations=4, eval_every=2, lr=0.5,
                  model="own_fixtures:bn_net", model_width=4, tensorboard=False)
    named = fdam_ray.train_datasets(dict(config, out_dir=str(tmp_path), run_name="own"),
                                    [PairDataset(*a) for a in trains], None,
                                    client_tests=[PairDataset(*a) for a in tests])
    assert named.run_dir == tmp_path / "own" and (tmp_path / "own" / "summary.json").is_file()
    unnamed = fdam_ray.train_datasets(config, [PairDataset(*a) for a in trains], None,
                                      client_tests=[PairDataset(*a) for a in tests])
    assert unnamed.run_dir is None


# -- plots of runs whose AUC is NaN -------------------------------------------------------------------------------

def test_plot_names_and_skips_a_run_whose_auc_is_nan_and_draws_the_others(tmp_path, capsys, caplog):
    run(cfg(tmp_path, run_name="good", iterations=12))
    run(cfg(tmp_path, run_name="nan", iterations=12, seed=1))
    metrics = tmp_path / "nan" / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "test_auc": float("nan")}) + "\n" for r in records))
    assert main(["plot", str(tmp_path / "good"), str(tmp_path / "nan"), "--out", str(tmp_path / "figs")]) == 0
    captured = capsys.readouterr()
    assert "auc_vs_iterations.png" in captured.out and "auc_vs_local_steps.png" in captured.out
    named = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(named) == 1 and f"'{tmp_path / 'nan'}'" in named[0] and "NaN" in named[0]
    assert "good" not in named[0] and "Traceback" not in captured.err
    assert (tmp_path / "figs" / "auc_vs_bytes.png").stat().st_size > 0
    assert main(["plot", str(tmp_path / "nan"), "--out", str(tmp_path / "none")]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    assert plot_runs([tmp_path / "good"], tmp_path / "one")


def test_fdam_train_says_that_pretraining_began_without_verbose(tmp_path, caplog, capsys):
    """Stage 1 is not silent until its first evaluation: `fdam train` shows the pre-training logger's lines
    (a line when it begins, then at most every 30 s) without -v; --quiet keeps them out."""
    assert main(["train", *args(tmp_path, **RECIPE)]) == 0
    assert "pre-training: stage 1 of 12 iterations begins" in caplog.text
