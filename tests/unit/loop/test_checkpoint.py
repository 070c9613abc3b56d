"""The checkpoint file: schema 1 as fdam-ray wrote it before checkpoints were typed still resumes, the writer keeps
that layout, and a file of another schema, or with state this fdam-ray does not know, is one line naming it.

``fixtures/checkpoint_v1.pt`` was written by ``fdam_ray.outputs.RunWriter.checkpoint`` as it was before
:class:`fdam_ray.checkpoint.Checkpoint` existed (an untyped payload): the run of its config (synthetic data, mlp of
width 8, 3 clients, codasca, 30 iterations, stages of 12, checkpoints every 4 rounds) stopped in round 7, so it holds
the state after round 4.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fdam_ray.assembly.recipe import resume, run
from fdam_ray.checkpoint import FORMAT, SCHEMA, CheckpointError, load_checkpoint, save_checkpoint
from fdam_ray.cli import main
from fdam_ray.config import build_config
from fdam_ray.core.state import GlobalState

OLD_CHECKPOINT = Path(__file__).parents[2] / "fixtures" / "checkpoint_v1.pt"
TIMING = {"wall_s", "samples_per_s"}


def old_run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copy(OLD_CHECKPOINT, folder / "checkpoint.pt")
    return folder


def raw(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def same_tree(a, b, where="") -> None:
    """``a`` and ``b`` hold the same keys, kinds and values all the way down."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_checkpoint_written_before_checkpoints_were_typed_resumes_to_the_uninterrupted_run(tmp_path):
    folder = old_run_folder(tmp_path)
    recorded = load_checkpoint(folder / "checkpoint.pt")
    assert recorded.loop.state.round == 4 and recorded.loop.position.round == 4
    straight = run(build_config({**recorded.config, "out_dir": str(tmp_path / "straight")}))
    resumed = resume(folder)
    assert resumed.state.round == straight.state.round == 10
    for f in dataclasses.fields(GlobalState):  # every state vector, bit for bit
        got, want = getattr(resumed.state, f.name), getattr(straight.state, f.name)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f.name)
    without_timing = [[{k: v for k, v in h.items() if k not in TIMING} for h in r.history] for r in (resumed, straight)]
    assert without_timing[0] == without_timing[1]
    assert resumed.summary["bytes_up"] == straight.summary["bytes_up"]
    # the resumed run's own checkpoints are of the schema it writes, and read back
    assert raw(folder / "checkpoint.pt")["format"] == FORMAT
    assert load_checkpoint(folder / "checkpoint.pt").loop.state.round == 10


def test_the_writer_keeps_schema_1s_layout(tmp_path):
    # the layout is unchanged, so the schema stays 1: a checkpoint read and written again is the same file content
    assert SCHEMA == 1 and FORMAT == "fdam-ray-checkpoint/1"
    save_checkpoint(tmp_path / "again.pt", load_checkpoint(OLD_CHECKPOINT))
    same_tree(raw(tmp_path / "again.pt"), raw(OLD_CHECKPOINT))


def test_every_field_of_the_global_state_is_written_by_name():
    state = raw(OLD_CHECKPOINT)["payload"]["loop"]["state"]
    assert list(state) == [f.name for f in dataclasses.fields(GlobalState)]


@pytest.mark.parametrize("version, why", [(2, "a newer fdam-ray wrote it; upgrade fdam-ray"),
                                          (0, "an older fdam-ray wrote it, and this one no longer reads")])
def test_a_checkpoint_of_another_schema_is_one_line_naming_the_file_and_the_versions(tmp_path, capsys, version, why):
    folder = old_run_folder(tmp_path)
    data = raw(folder / "checkpoint.pt")
    data["format"] = f"fdam-ray-checkpoint/{version}"
    torch.save(data, folder / "checkpoint.pt")
    before = (folder / "checkpoint.pt").read_bytes()
    with pytest.raises(CheckpointError) as got:
        load_checkpoint(folder / "checkpoint.pt")
    assert str(got.value) == (f"checkpoint '{folder / 'checkpoint.pt'}' has schema version {version}, which this "
                              f"fdam-ray does not read (it reads version 1): {why}" + str(got.value).split(why)[1])
    assert main(["train", "--resume", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"fdam: error: checkpoint '{folder / 'checkpoint.pt'}' has schema version {version}")
    assert (folder / "checkpoint.pt").read_bytes() == before and sorted(p.name for p in folder.iterdir()) == [
        "checkpoint.pt"]


def test_a_file_without_an_fdam_ray_format_tag_is_refused(tmp_path):
    for data in ({"weights": torch.zeros(2)}, {"format": "fdam-ray-checkpoint/x", "payload": {}}, [1, 2]):
        torch.save(data, tmp_path / "c.pt")
        with pytest.raises(CheckpointError, match=r"is not an fdam-ray checkpoint \(fdam-ray-checkpoint/1\)"):
            load_checkpoint(tmp_path / "c.pt")


def edited(tmp_path: Path, edit) -> Path:
    data = raw(OLD_CHECKPOINT)
    edit(data["payload"])
    torch.save(data, tmp_path / "c.pt")
    return tmp_path / "c.pt"


def test_a_state_field_missing_from_the_file_takes_its_default(tmp_path):
    # what an older file of the same schema looks like to an fdam-ray whose GlobalState gained a field
    path = edited(tmp_path, lambda p: p["loop"]["state"].pop("c_alpha"))
    assert load_checkpoint(path).loop.state.c_alpha is None
    assert load_checkpoint(OLD_CHECKPOINT).loop.state.c_alpha is not None


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["loop"]["state"].update(w_extra=torch.zeros(2)),
     "holds global state this fdam-ray does not know: w_extra"),
    (lambda p: p["loop"]["state"].pop("v"), "is damaged: its global state lacks v"),
    (lambda p: p["loop"].pop("reference"), "is damaged: its server state lacks reference"),
    (lambda p: p["loop"].update(rounds_left=3), "holds run state this fdam-ray does not know: rounds_left"),
    (lambda p: p["loop"]["position"].pop("round"), "is damaged: its schedule position lacks round"),
    (lambda p: p["loop"].pop("bytes_up"), "is damaged: its run state lacks bytes_up"),
    (lambda p: p["loop"].pop("ref_count"), "is damaged: its server state lacks ref_count"),
    (lambda p: p["loop"].update(history={}), "is damaged: its run state's 'history' entry is missing or not a list"),
    (lambda p: p.pop("torch_rng"), "is damaged: its 'torch_rng' entry is missing or not a Tensor"),
])
def test_a_payload_that_is_not_a_runs_state_is_one_line_naming_the_file(tmp_path, edit, message):
    path = edited(tmp_path, edit)
    with pytest.raises(CheckpointError) as got:
        load_checkpoint(path)
    assert str(got.value).startswith(f"checkpoint '{path}' ") and message in str(got.value)
    assert "\n" not in str(got.value)


def test_a_checkpoint_is_written_with_its_config(tmp_path):
    ck = load_checkpoint(OLD_CHECKPOINT)
    with pytest.raises(ValueError, match="with the run's config"):
        save_checkpoint(tmp_path / "c.pt", dataclasses.replace(ck, config=None))
    assert not (tmp_path / "c.pt").exists()
    assert ck.unplaced_clients() == [] and ck.with_config({"x": 1}).config == {"x": 1}


def test_a_full_disk_is_found_behind_torchs_error_and_the_old_file_stays(tmp_path):
    import errno
    import io

    from fdam_ray.checkpoint import DiskFullError, disk_full, write_atomically

    class Full(io.BufferedIOBase):
        writes = 0

        def writable(self):
            return True

        def write(self, data):
            self.writes += 1
            if self.writes > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(data)

    with pytest.raises(RuntimeError) as info:  # torch's zip writer reports the failed write as "unexpected pos"
        torch.save({"x": torch.zeros(1000)}, Full())
    assert disk_full(info.value) is not None and disk_full(RuntimeError("other")) is None
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def fill(fh):
        fh.write(b"new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=f"^no space left on {tmp_path} .*the previous one is kept") as full:
        write_atomically(path, fill, "a file")
    assert full.value.errno == errno.ENOSPC and isinstance(full.value, OSError)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    write_atomically(path, lambda fh: fh.write(b"new"), "a file")
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777  # umask


class _RunsCode:
    """A pickle that would run a command when unpickled with full unpickling."""

    def __reduce__(self):
        import os

        return (os.system, ("echo unpickled",))


def test_a_checkpoint_that_is_a_device_or_foreign_pickle_is_one_line_without_unsafe_advice(tmp_path):
    import os
    import pickle

    os.symlink("/dev/zero", tmp_path / "zero.pt")  # read whole, it would never end
    with pytest.raises(CheckpointError, match=r"zero.pt' is not a regular file$"):
        load_checkpoint(tmp_path / "zero.pt")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "evil.pt")
    message = str(info.value)
    assert "could run code" in message and "weights_only" not in message and "\n" not in message


def test_under_a_scratch_folder_no_temporary_file_appears_in_the_written_folder(tmp_path):
    """Ray Tune copies a trial's folder while the trial writes it; a temporary file listed there and renamed
    before the copy reads it fails that copy. Under a scratch folder the written folder only ever holds whole
    files."""
    from fdam_ray.checkpoint import scratch_folder, write_atomically

    run, scratch = tmp_path / "driver_artifacts" / "trial" / "run", tmp_path / ".scratch" / "trial"
    run.mkdir(parents=True)
    seen: dict[str, list[str]] = {}

    def write(fh):
        seen["run"] = sorted(p.name for p in run.iterdir())
        seen["scratch"] = sorted(p.name for p in scratch.iterdir())
        fh.write(b"whole")

    with scratch_folder(scratch):
        write_atomically(run / "summary.json", write, "the summary")
    assert seen["run"] == [] and len(seen["scratch"]) == 1 and seen["scratch"][0].startswith(".summary.json.")
    assert (run / "summary.json").read_bytes() == b"whole" and list(scratch.iterdir()) == []
    write_atomically(run / "model.pt", write, "the model")  # outside the block: beside the file, as before
    assert seen["run"][1] == "summary.json" and seen["run"][0].startswith(".model.pt.")


def test_a_trials_scratch_folder_is_outside_what_tune_copies():
    from fdam_ray.tuning.trial import trial_scratch

    trial = Path("/tmp/ray/session_x/artifacts/ts/live/driver_artifacts/trial_0001")
    scratch = trial_scratch(trial)
    assert trial.parent not in scratch.parents and scratch.parents[1] == trial.parent.parent
