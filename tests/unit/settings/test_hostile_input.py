"""Hostile and damaged input: credentials in URIs never shown, files read with bounds, values never shown whole.

Each case is what a user or a hostile file gives fdam-ray: a password in a URI or
address, a config path that is ``/dev/zero``, a FIFO or a folder, a YAML alias
bomb, a key that is not text, a ``run_name`` that is a path or 50 MB long. Each is
one short line naming the file or field; nothing is read without bound.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from fdam_ray.cli import main
from fdam_ray.config import ConfigError, build_config, load_config_file, parse_overrides
from fdam_ray.files.locations import where
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.outputs import RunWriter
from fdam_ray.settings.redact import MASK, RedactingFilter, clip, redact, short
from fdam_ray.settings.yamlio import MAX_FILE_BYTES, load_yaml
from fdam_ray.tuning.space import load_space, make_space

SECRET = "SECRETPW42"


# -- redaction ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kept", [
    (f"http://user:{SECRET}@tracking.example:5000/api", "http://user:***@tracking.example:5000/api"),
    (f"s3://AKIAKEY:{SECRET}@bucket/sweeps", "s3://AKIAKEY:***@bucket/sweeps"),
    (f"ray://admin:{SECRET}@10.0.0.5:10001", "ray://admin:***@10.0.0.5:10001"),
    (f"mlflow at 'https://u:{SECRET}@h/x' failed", "mlflow at 'https://u:***@h/x' failed"),
    (f"https://u:p@ss{SECRET}@h/x", "https://u:***@h/x"),  # a raw '@' in the password
    (f"https://h/x?sig={SECRET}&sv=2020", "https://h/x?sig=***&sv=2020"),
    (f"https://h/x?token={SECRET}", "https://h/x?token=***"),
    (f"gs://b/o?X-Goog-Signature={SECRET}&X-Goog-Date=1", "gs://b/o?X-Goog-Signature=***&X-Goog-Date=1"),
    (f"endpoint access_key={SECRET} region=eu", "endpoint access_key=*** region=eu"),
    (f"WANDB_API_KEY={SECRET}", "WANDB_API_KEY=***"),
    (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),
    (f"https://{SECRET}{SECRET}@github.com/x", "https://***@github.com/x"),  # a token as the user
])
def test_redact_replaces_the_credentials_of_uris_addresses_and_secret_parameters(text, kept):
    assert redact(text) == kept
    assert SECRET not in redact(text)


@pytest.mark.parametrize("text", [
    "10.0.0.5:6379", "ray://10.0.0.5:10001", "http://127.0.0.1:5000/api/2.0", "s3://bucket/sweeps/a",
    "sqlite:///mlflow.db", "file:///tmp/x", "override 'x' is not of the form key=value", "git@github.com:x/y",
    "config field 'lr': 'abc' is not allowed (a number)", "ssh://git@host/repo",
])
def test_redact_leaves_texts_without_credentials_as_they_are(text):
    assert redact(text) == text


def test_redact_keeps_advice_that_names_secret_settings():
    from fdam_ray.executors.ray.session import AUTH_HELP

    assert "RAY_AUTH_MODE=token" in AUTH_HELP and redact(AUTH_HELP) == AUTH_HELP
    assert redact("set WANDB_API_KEY=$KEY or password=<yours>") == "set WANDB_API_KEY=$KEY or password=<yours>"


def test_redact_replaces_secrets_the_environment_holds_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a mode, not a secret: left alone
    text = f"login failed for key 0123456789abcdef0123 (password {SECRET}); auth is disabled"
    assert redact(text) == f"login failed for key {MASK} (password {MASK}); auth is disabled"


def test_where_shows_a_storage_uri_without_its_password():
    assert where(f"s3://key:{SECRET}@bucket/runs") == "s3://key:***@bucket/runs"


def test_the_log_filter_redacts_a_records_message_its_arguments_and_its_traceback():
    record = logging.LogRecord("fdam_ray.x", logging.WARNING, __file__, 1, "tracker at %s failed", (
        f"http://u:{SECRET}@h",), None)
    try:
        raise ValueError(f"cannot reach http://u:{SECRET}@h")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    assert RedactingFilter().filter(record)
    line = logging.Formatter().format(record)
    assert "tracker at http://u:***@h failed" in line and "ValueError" in line and SECRET not in line


# -- values shown in messages --------------------------------------------------------------------------------------

def test_short_never_shows_a_whole_value():
    assert short("abc") == "'abc'"
    big = "x" * 50_000_000
    start = time.perf_counter()
    text = short(big)
    assert len(text) < 120 and text.endswith("(50000000 characters)")
    bomb: list = [1] * 9
    for _ in range(30):  # 9 ** 30 values once expanded: a repr would never end
        bomb = [bomb] * 9
    assert len(short(bomb)) <= 80
    assert short(10 ** 10_000).startswith("<a int>") or len(short(10 ** 10_000)) <= 80
    assert short(f"ray://u:{SECRET}@h") == "'ray://u:***@h'"
    assert time.perf_counter() - start < 2
    assert clip("a" * 500, 50) == "a" * 47 + "..."


def test_a_config_error_shows_a_huge_value_shortened():
    with pytest.raises(ConfigError) as caught:
        build_config(lr="9" * 10_000_000 + "x")
    assert len(str(caught.value)) < 300 and "config field 'lr'" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        build_config({"x" * 1_000_000: 1})
    assert len(str(caught.value)) < 300 and "unknown config field" in str(caught.value)


@pytest.mark.parametrize("given", ["key", "model", "dataset", "algorithm", "run_name"])
def test_a_20_mb_key_or_name_is_refused_at_once_in_a_short_line(given):
    huge = "q" * 20_000_000
    start = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        build_config({huge: 1} if given == "key" else {given: huge})
    assert time.perf_counter() - start < 1.5 and len(str(caught.value)) < 400


def test_a_field_holding_a_password_is_shown_redacted_in_its_error():
    with pytest.raises(ConfigError) as caught:
        build_config(seed=f"http://u:{SECRET}@h")
    assert SECRET not in str(caught.value) and "http://u:***@h" in str(caught.value)


# -- files read with bounds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, kind", [("/dev/zero", "a device"), ("/dev/urandom", "a device")])
def test_a_config_path_that_is_a_device_is_refused_without_reading_it(path, kind):
    if not Path(path).exists():
        pytest.skip(f"no {path} here")
    with pytest.raises(ConfigError, match=f"^config file '{path}' is {kind}, not a regular file"):
        load_config_file(path)


def test_a_config_path_that_is_a_fifo_or_a_folder_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)  # opening it would wait for a writer for ever
    with pytest.raises(ConfigError, match="is a FIFO, not a regular file"):
        load_config_file(str(fifo))
    with pytest.raises(ConfigError, match="is a folder, not a regular file"):
        load_config_file(str(tmp_path))
    with pytest.raises(ConfigError, match=r"search space .* is a FIFO"):
        read_yaml_file(f"file://{fifo}", "search space")


def test_a_file_over_the_size_limit_is_refused_saying_the_limit(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_FILE_BYTES + "\nlr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^config file '.*big.yaml' is larger than 1 MiB"):
        load_config_file(str(path))
    path.write_text("# " + "x" * (MAX_FILE_BYTES - 100) + "\nlr: 0.1\n")  # just under: read
    assert load_config_file(str(path)) == {"lr": 0.1}


BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                 + [f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)]
                 + ["lr: *i"])


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)  # about 400 bytes; 9 ** 9 values once expanded
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="aliases expand to more than 1,000,000 values") as caught:
        load_config_file(str(path))
    assert time.perf_counter() - start < 5 and len(str(caught.value)) < 300
    path.write_text("a: &a [*a]\n")
    with pytest.raises(ConfigError, match="contains itself"):
        load_config_file(str(path))
    path.write_text("a: " + "[" * 50_000 + "]" * 50_000)
    with pytest.raises(ConfigError, match="nests deeper than can be read"):
        load_config_file(str(path))
    path.write_text("seed: " + "1" * 100_000)
    with pytest.raises(ConfigError, match="a value cannot be read"):
        load_config_file(str(path))


def test_aliases_that_stay_small_still_work():
    assert load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}


def test_an_alias_bomb_given_as_key_value_is_refused_in_one_short_line():
    bomb = "[" + ", ".join(["[" + ", ".join(["1"] * 9) + "]"] * 9) + "]"
    with pytest.raises(ConfigError) as caught:
        build_config(parse_overrides([f"positive_classes={bomb}"]))
    assert len(str(caught.value)) < 300


# -- keys that are not text ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, shown", [
    ("1: 2\n", "key 1 on line 1 is an integer"),
    ("lr: 0.1\nnull: x\n", "key null on line 2 is null"),
    ("[a]: b\n", "key ['a'] on line 1 is a list"),
    ("model:\n  2024-01-01: x\n", "key datetime.date(2024, 1, 1) on line 2 is a date"),
    ("true: 1\n", "key True on line 1 is true/false"),
])
def test_a_yaml_key_that_is_not_text_is_one_line_naming_it(tmp_path, text, shown):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config_file(str(path))
    message = str(caught.value)
    assert message.startswith(f"config file '{path}': {shown}, not a name") and "\n" not in message


def test_a_key_that_is_not_text_in_a_space_file_is_one_line(tmp_path):
    for text in ("1: 2\n", "base:\n  null: x\n", "search:\n  3: {grid: [1]}\n", "tune:\n  [a]: 1\n"):
        path = tmp_path / "space.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="not a name") as caught:
            load_space(str(path))
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="key 1 is an integer, not a name"):
        make_space({"base": {}, "search": {1: {"grid": [1]}}})
    with pytest.raises(ConfigError, match="key None is null, not a name"):
        make_space({None: 1, "base": {}})


def test_a_key_that_is_not_text_given_in_python_is_one_line():
    with pytest.raises(ConfigError, match=r"^config key 1 is an integer, not a field name"):
        build_config({1: 2})
    with pytest.raises(ConfigError, match=r"^config key None in section 'model' is null"):
        build_config({"model": {None: "x"}})


def test_the_cli_says_one_line_and_exits_2_for_hostile_config_files(tmp_path, capsys):
    (tmp_path / "keys.yaml").write_text("1: 2\n")
    (tmp_path / "bomb.yaml").write_text(BOMB)
    for config in ("/dev/zero", str(tmp_path / "keys.yaml"), str(tmp_path / "bomb.yaml"), str(tmp_path)):
        if not Path(config).exists():
            continue
        assert main(["train", "--config", config, "executor=inline"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fdam: error: config file") and err.count("\n") == 1 and len(err) < 400, err


# -- run_name is one folder name ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a/b", "../escape", "..", ".", "x\x00y", "line\nbreak", "a\\b", "n" * 101])
def test_a_run_name_that_is_not_one_folder_name_is_refused(name):
    with pytest.raises(ConfigError, match=r"^config field 'run_name': .* is not allowed \(one folder name of at "
                                          r"most 100 characters"):
        build_config(run_name=name)


def test_a_huge_run_name_is_refused_in_a_short_line(capsys):
    assert main(["train", "executor=inline", "run_name=" + "r" * 5_000_000]) == 2
    err = capsys.readouterr().err
    assert "run_name" in err and "(5000000 characters)" in err and len(err) < 400


def test_good_run_names_are_kept():
    for name in ("n" * 100, "exp-1.2_b", "007", "n" * 100 + "-pretrain"):
        assert build_config(run_name=name).run_name == name


# -- the run folder's files ---------------------------------------------------------------------------------------

def test_the_config_and_the_log_of_a_run_folder_are_the_owners_only_and_the_log_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SECRET}@127.0.0.1:9")
    (tmp_path / "train.log").write_text("earlier session\n")
    os.chmod(tmp_path / "train.log", 0o644)  # as an earlier version left it
    writer = RunWriter(tmp_path, tensorboard=False)
    try:
        writer.write_config({"lr": 0.1, "address": None})
        writer.event("tracker at %s is gone", f"http://user:{SECRET}@127.0.0.1:9")
        logging.getLogger("fdam_ray.outputs.trackers").warning("mlflow: http://user:%s@127.0.0.1:9 refused", SECRET)
    finally:
        writer.close()
    for name in ("train.log", "config.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    log = (tmp_path / "train.log").read_text()
    assert "earlier session" in log and "tracker at http://user:***@127.0.0.1:9 is gone" in log
    assert "mlflow: http://user:***@127.0.0.1:9 refused" in log and SECRET not in log


def test_a_storage_uri_that_cannot_be_opened_is_named_without_its_password():
    from fdam_ray.files.locations import RemoteFolder

    with pytest.raises(OSError) as caught:
        RemoteFolder(f"nosuchfs://user:{SECRET}@127.0.0.1/sweeps")
    assert "storage 'nosuchfs://user:***@127.0.0.1/sweeps' cannot be opened" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_rays_own_log_lines_are_redacted_once_fdam_uses_ray():
    import logging

    import ray  # noqa: F401  (Ray installs its own stderr handler on import)

    from fdam_ray.settings.redact import redact_handlers

    handlers = logging.getLogger("ray").handlers
    assert handlers  # Ray's stderr handler: what prints Ray's own lines
    redact_handlers(logging.getLogger("ray"))
    for handler in handlers:
        record = logging.LogRecord("ray.x", logging.WARNING, __file__, 1,
                                   "connecting to %s", ("ray://user:PLANTEDPW@127.0.0.1:10001",), None)
        assert handler.filter(record)
        assert "PLANTEDPW" not in record.getMessage() and "127.0.0.1:10001" in record.getMessage()
