"""The certificate tool's refusals: one line, rc 2, nothing written (fdam_ray.flower.certs)."""

from __future__ import annotations

import os
import stat
import time

import pytest

pytest.importorskip("cryptography")

from fdam_ray.flower.certs import main


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_folder_under_a_file_is_one_line_naming_the_path(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    folder = tmp_path / "afile" / "certs"
    assert main(["--folder", str(folder), "--name", "localhost", "--sites", "2"]) == 2
    assert str(tmp_path / "afile") in _one_line_error(capsys)
    assert _files(tmp_path) == ["afile"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_folder_that_cannot_be_made_is_one_line_and_nothing_is_written(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert main(["--folder", str(locked / "certs"), "--name", "localhost", "--sites", "1"]) == 2
        assert str(locked / "certs") in _one_line_error(capsys)
        assert _files(locked) == []
    finally:
        locked.chmod(0o700)


def test_a_write_that_fails_half_way_leaves_no_file_behind(tmp_path, capsys, monkeypatch):
    from fdam_ray.flower import pki

    real, calls = pki._write_new, []

    def full_disk(path, data, *, private):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(path))
        real(path, data, private=private)

    monkeypatch.setattr(pki, "_write_new", full_disk)
    folder = tmp_path / "certs"
    assert main(["--folder", str(folder), "--name", "localhost", "--sites", "1"]) == 2
    assert "No space left" in _one_line_error(capsys)
    assert _files(tmp_path) == []


def test_a_huge_site_count_is_refused_at_once_before_anything_is_made(tmp_path, capsys):
    start = time.perf_counter()
    assert main(["--folder", str(tmp_path / "c"), "--name", "localhost", "--sites", "100000000"]) == 2
    assert time.perf_counter() - start < 1.0
    err = _one_line_error(capsys)
    assert "--sites" in err and "10000" in err
    assert _files(tmp_path) == []


@pytest.mark.parametrize("ip", ["0.0.0.0", "::", "224.0.0.1", "ff02::1"])
def test_an_unspecified_or_multicast_address_is_refused(tmp_path, capsys, ip):
    assert main(["--folder", str(tmp_path / "c"), "--ip", ip]) == 2
    assert ip in _one_line_error(capsys)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("name", ["h\u00f6st.example", "a" * 304, "a" * 65, "bad_name!.example", "a..b"])
def test_a_name_outside_the_dns_rules_is_refused_in_one_line_before_the_folder_is_made(tmp_path, capsys, name):
    assert main(["--folder", str(tmp_path / "c"), "--name", name, "--sites", "1"]) == 2
    err = _one_line_error(capsys)
    assert "--name" in err and "64" in err
    assert _files(tmp_path) == []


def test_certificate_folders_are_0700_whatever_the_umask(tmp_path, capsys):
    old = os.umask(0)
    try:
        assert main(["--folder", str(tmp_path / "c"), "--name", "a-b.example", "--name", "x" * 30 + "." + "y" * 33,
                     "--sites", "1"]) == 0
    finally:
        os.umask(old)
    for folder in [tmp_path / "c", tmp_path / "c" / "keys"]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
