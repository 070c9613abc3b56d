"""A metric row that cannot be written whole (a full disk mid-row) leaves no part of it in the metric files.

The kernel's own short write is used: with RLIMIT_FSIZE just past the file's end, a write crossing the limit
writes the bytes up to it and the next fails (EFBIG), as a write crossing the last free page of a full disk does
(ENOSPC).
"""

from __future__ import annotations

import contextlib
import csv
import json
import resource
import signal

import pytest

from fdam_ray.outputs.writer import RunWriter


def row(i: int) -> dict:
    return {"iteration": 10 * i, "round": i, "stage": 1, "lr": 0.1, "train_loss": 0.5 / (i + 1), "test_auc": 0.75,
            "test_samples": 100, "client_auc": {"0": 0.7, "1": 0.8}, "bytes_up": 1000 * i, "bytes_down": 2000 * i,
            "wall_s": 1.5 * i, "samples_per_s": 100.0}


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("name", ["metrics.jsonl", "metrics.csv"])
def test_a_row_cut_short_by_the_disk_leaves_whole_rows_in_both_metric_files_and_the_next_row_follows(tmp_path,
                                                                                                     name):
    writer = RunWriter(tmp_path, tensorboard=False)
    try:
        writer.record(row(0))
        writer.record(row(1))
        before = {f: (tmp_path / f).read_bytes() for f in ("metrics.jsonl", "metrics.csv")}
        with file_size_limit(len(before[name]) + 40), pytest.raises(OSError):  # 40 bytes of the row fit
            writer.record(row(2))
        assert {f: (tmp_path / f).read_bytes() for f in before} == before  # nothing of row 2, in either file
        writer.record(row(3))  # space again: the run (or its resume) goes on writing whole rows
    finally:
        writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [0, 1, 3]
    with open(tmp_path / "metrics.csv", newline="") as fh:
        assert [r["round"] for r in csv.DictReader(fh)] == ["0", "1", "3"]
