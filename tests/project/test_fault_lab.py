"""The fault lab's bookkeeping (benchmarks/faults.py, benchmarks/_lab_common.py), without starting a process:
what counts as lost, the table and the RESULT line. The lab itself is a benchmark (real processes on netlab)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _lab_common as L  # noqa: E402
import faults as F  # noqa: E402


def rows(*rounds, auc=0.5):
    return [{"iteration": 10 * r, "round": r, "test_auc": auc + r / 100, "wall_s": 1.0 + r} for r in rounds]


def write(folder: Path, records) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_an_uninterrupted_folder_loses_nothing_even_with_other_times(tmp_path):
    reference = rows(0, 1, 2, 3)
    faulted = [dict(r, wall_s=r["wall_s"] + 40.0) for r in reference]  # time lost is not data lost
    assert L.audit(write(tmp_path, faulted), reference, checkpoint_round=3) == []


@pytest.mark.parametrize("records, checkpoint, found", [
    (rows(0, 1, 2, 2, 3), 3, "round 2's metric row written twice"),
    (rows(0, 1, 3), 3, "metric rows of rounds [2] missing"),
    (rows(0, 1, 2, 3, 4), 4, "metric rows of rounds [4] not in the uninterrupted study"),
    (rows(0, 2, 1, 3), 3, "out of order"),
    (rows(0, 1, 2, 3), 2, "the checkpoint holds round 2, older than the last completed round 3"),
    ([*rows(0, 1, 2), dict(rows(3)[0], test_auc=0.1)], 3, "round 3's metric row differs"),
])
def test_each_kind_of_loss_is_found(tmp_path, records, checkpoint, found):
    lost = L.audit(write(tmp_path, records), rows(0, 1, 2, 3), checkpoint_round=checkpoint)
    assert any(found in item for item in lost), lost


def test_a_replay_may_differ_in_its_figures_but_not_in_its_rounds(tmp_path):
    replay = [dict(r, test_auc=r["test_auc"] + 1e-7) for r in rows(0, 1, 2, 3)]
    assert L.audit(write(tmp_path, replay), rows(0, 1, 2, 3), same_training=False) == []
    assert L.audit(write(tmp_path, replay), rows(0, 1, 2, 3), same_training=True)


def test_a_seeded_point_repeats_per_seed_and_name_and_stays_in_range():
    a = L.seeded_point(0, "driver_kill", 3, 8)
    assert a == L.seeded_point(0, "driver_kill", 3, 8) and 3 <= a[0] <= 8 and 0 <= a[1] < 1
    drawn = {L.seeded_point(s, "driver_kill", 3, 8)[0] for s in range(40)}
    assert drawn == set(range(3, 9))  # every round of the range is drawn by some seed


def test_max_difference_is_zero_only_for_equal_arrays_and_inf_for_other_names():
    a = {"v": [1.0, 2.0], "w": [[0.5]]}
    assert L.max_difference(a, {"v": [1.0, 2.0], "w": [[0.5]]}) == 0.0
    assert L.max_difference(a, {"v": [1.0, 2.5], "w": [[0.5]]}) == 0.5
    assert L.max_difference(a, {"v": [1.0, 2.0]}) == float("inf")


def test_the_table_and_the_result_line_count_survivors_and_lost_items():
    faults = [L.Fault("driver_kill", "the driver SIGKILLed", "round 4 + 0.3", L.RESUMED, True, 12.25, [],
                      "run stopped", 0.0),
              L.Fault("link_cut_long", "site 1 cut 45 s", "round 3", "stopped, not resumed", False, 50.0,
                      ["metric rows of rounds [5] missing"], "", None)]
    assert F.summary_line(faults, 100.4) == "RESULT faults=2 survived=1 data_lost=1 wall_s=100"
    first, second = F.outcome_rows(faults)
    assert first[4] == "yes" and first[5] == "+12.2" and first[6] == "nothing" and first[7] == "0"
    assert '"run stopped"' in first[3]
    assert second[4] == "**no**" and second[6] == "metric rows of rounds [5] missing" and second[7] == ""


def test_the_lab_refuses_in_one_line_where_it_cannot_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as got:
        F.preflight(tmp_path)  # no netcluster.py there
    assert "--netlab" in str(got.value) and "\n" not in str(got.value)
    with pytest.raises(SystemExit):
        F.parse_args(["--netlab", str(tmp_path), "--faults", "disk_ful"])
    assert "unknown fault 'disk_ful'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        F.parse_args(["--netlab", str(tmp_path), "--soak", "0"])
    assert "--soak: 0 minutes is not allowed" in capsys.readouterr().err


def test_a_study_name_used_before_gets_a_fresh_folder_and_a_stop_line_ends_the_wait(tmp_path):
    """A study submitted into a folder holding a checkpoint continues it (a finished one returns at once), so a
    name that ran before gets ``-2``, ``-3``; the wait for a result ends on the server's ``run stopped:`` line."""
    from types import SimpleNamespace

    import _lab_flower as LF

    lab = SimpleNamespace(folder=tmp_path)
    assert LF.LabConsortium.fresh_name(lab, "supernode_kill") == "supernode_kill"
    (tmp_path / "runs" / "supernode_kill").mkdir(parents=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "supernode_kill-2.npz").write_bytes(b"")
    assert LF.LabConsortium.fresh_name(lab, "supernode_kill") == "supernode_kill-3"

    run_dir = tmp_path / "runs" / "study"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("12:00:00 INFO round 3\n12:01:00 ERROR run stopped: round 4: no site's "
                                       "update reached the server (sites [0, 1, 2] were asked)\n")
    assert LF.stop_lines(run_dir) == ["12:01:00 ERROR run stopped: round 4: no site's update reached the server "
                                      "(sites [0, 1, 2] were asked)"]
    waiter = SimpleNamespace(consortium=SimpleNamespace(folder=tmp_path))
    line = LF.LabConsortium.wait_result(waiter, tmp_path / "never.npz", 5.0, run_dir=run_dir, seen=0)
    assert line is not None and line.endswith("were asked)")
    with pytest.raises(TimeoutError):  # a stop line seen before the submission does not end the wait
        LF.LabConsortium.wait_result(waiter, tmp_path / "never.npz", 1.0, run_dir=run_dir, seen=1)


def test_the_soak_bounds_the_drivers_peaks_across_studies_and_gives_a_trend():
    import _lab_soak as S

    hour = 3600.0
    assert S.slope_mb_per_hour([(0.0, 0), (hour, 2**20 * 6)]) == pytest.approx(6.0)
    assert S.slope_mb_per_hour([(0.0, 5 * 2**20)]) != S.slope_mb_per_hour([(0.0, 5 * 2**20)])  # nan: one time
    mb = 2**20
    # drivers before minute 5 do not count; of the six after it, the last third's median over the first third's
    peaks = [(10.0, 900 * mb), *[(S.WARMUP_S + 60 * i, (400 + (50 if i >= 4 else 0)) * mb) for i in range(6)]]
    grown = S.driver_growth(peaks)
    assert grown["drivers"] == 6 and grown["rss_growth"] == pytest.approx(0.125) and grown["peak_mb"] == 450
    assert S.driver_growth(peaks[:3]) is None  # two after minute 5: too few to tell a trend


def test_the_soak_reads_a_live_drivers_peak_and_keeps_only_those_that_finished():
    import subprocess

    import _lab_soak as S

    grow = "b = bytearray(60 * 2**20); import time; time.sleep(1.5)"
    ok = subprocess.Popen([sys.executable, "-c", grow])
    failed = subprocess.Popen([sys.executable, "-c", grow + "; raise SystemExit(3)"])
    sampler = S.Sampler(dict, lambda: [ok, failed])
    import time

    time.sleep(1.0)
    sampler.sample_drivers()
    ok.wait(), failed.wait()
    peaks = sampler.driver_peaks()
    assert len(peaks) == 1 and peaks[0][1] > 60 * 2**20  # the bytearray is resident; the failed driver is left out


def test_a_long_lived_processs_trend_is_its_floor_not_the_studies_peaks():
    import _lab_soak as S

    mb = 2**20
    # 100 MB rising 16 KiB every 10 s (5.6 MB an hour), with a 500 MB study below it every 70 s
    points = [(300.0 + 10 * i, 100 * mb + (500 * mb if i % 7 == 0 else 0) + i * 2**14) for i in range(150)]
    assert S.slope_mb_per_hour(S.floors(points)) == pytest.approx(5.76, abs=0.5)
    assert [round(v / mb) for _, v in S.floors(points)] == [100, 100, 101, 101, 102]
