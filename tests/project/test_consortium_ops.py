"""The consortium's operating files agree with the code: every ``flower.X`` the docs name is a field of the flower
section, the guide, the systemd units and the Dockerfile name the files the certificate tool writes, and the units
work as written (Flower's files in a FLWR_HOME the unit may write, telemetry off, the service user the guide
creates, the expiry check run on files the SuperLink uses). systemd itself is not run; its command lines are
parsed."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from fdam_ray.executors.flower_section import FlowerSection

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "consortium"
GUIDE = ROOT / "docs" / "how-to" / "consortium.md"
UNITS = {"superlink": DEPLOY / "fdam-superlink.service", "supernode": DEPLOY / "fdam-supernode.service"}
CERT_FLAGS = ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--root-certificates",
              "--auth-supernode-private-key")


def unit(path: Path) -> dict[str, list[str]]:
    """A unit's ``Key=value`` lines (continuation lines joined), each key's values in order."""
    text = re.sub(r"\s*\\\n\s*", " ", path.read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def environment(u: dict[str, list[str]]) -> dict[str, str]:
    return dict(v.split("=", 1) for v in u.get("Environment", []))


def commands(text: str) -> list[list[str]]:
    """Every flower-superlink / flower-supernode command in ``text`` (comment marks dropped, lines joined)."""
    joined = re.sub(r"\s*\\\n\s*", " ", re.sub(r"(?m)^#", "", text))
    return [shlex.split(line[re.search(r"flower-super(link|node) --", line).start():].replace("${", "{"))
            for line in joined.splitlines() if re.search(r"flower-super(link|node) --", line)]


def test_every_flower_field_the_docs_name_exists():
    fields = {f.name for f in dataclasses.fields(FlowerSection)}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(page.relative_to(ROOT).as_posix(), m) for page in pages
             for m in re.findall(r"(?<![\w./-])flower\.([a-z_]\w*)", page.read_text(encoding="utf-8"))}
    assert named, "the docs name no flower.X field: the pattern is broken"
    assert sorted((page, m) for page, m in named if m not in fields) == []
    assert "flower.site_keys" in GUIDE.read_text() and "replace_sites" not in GUIDE.read_text()


def test_the_guide_the_units_and_the_dockerfile_name_the_files_the_certificate_tool_writes(tmp_path, capsys):
    pytest.importorskip("cryptography")
    from fdam_ray.flower.certs import main

    assert main(["--folder", str(tmp_path / "c"), "--name", "localhost", "--sites", "3"]) == 0
    capsys.readouterr()
    written = {p.relative_to(tmp_path / "c").as_posix() for p in (tmp_path / "c").rglob("*") if p.is_file()}
    assert {"ca.crt", "server.pem", "server.key", "keys/site0", "keys/site2.pub"} <= written  # the oracle's shape
    seen = []
    for path in [*UNITS.values(), DEPLOY / "Dockerfile", GUIDE]:
        for command in commands(path.read_text()):
            for flag in CERT_FLAGS:
                if flag in command:
                    given = command[command.index(flag) + 1].replace("{FDAM_SITE}", "0")
                    # the file's name, and for a site key its folder too, as the tool writes them
                    tail = "/".join(Path(given).parts[-2:]) if flag == "--auth-supernode-private-key" else \
                        Path(given).name
                    assert tail in written, (path.name, flag, given)
                    seen.append(flag)
    assert set(seen) == set(CERT_FLAGS) and seen.count("--auth-supernode-private-key") == 3  # unit, image, guide
    assert "site.key" not in "".join(p.read_text() for p in [*UNITS.values(), DEPLOY / "Dockerfile", GUIDE])


def test_the_units_give_flower_a_home_they_may_write_and_the_guide_creates_their_user():
    guide = GUIDE.read_text()
    for role, path in UNITS.items():
        u = unit(path)
        env = environment(u)
        home = env["FLWR_HOME"]
        assert u["ProtectHome"] == ["yes"] and not home.startswith("/home")
        writable = [f"/var/lib/{d}" for d in u.get("StateDirectory", [])] + u.get("ReadWritePaths", [])
        assert any(home.startswith(w.rstrip("/") + "/") for w in writable), (role, home, writable)
        assert any(u["WorkingDirectory"][0] == w for w in writable), role
        user = u["User"][0]
        assert re.search(rf"useradd --system [^\n]*\b{user}\b", guide), user
        assert f"useradd --system --home-dir {u['WorkingDirectory'][0]}" in path.read_text()  # its own note
    supernode = unit(UNITS["supernode"])
    assert supernode["StateDirectory"] == ["fdam"] and environment(supernode)["FLWR_HOME"] == "/var/lib/fdam/flwr-home"
    # the site number the key's name takes is set in the env file the guide writes
    assert "${FDAM_SITE}" in supernode["ExecStart"][0] and "'FDAM_SITE=0'" in guide


def test_telemetry_is_off_in_the_units_and_the_image_under_the_name_flower_reads():
    name = "FLWR_TELEMETRY_ENABLED"
    spec = importlib.util.find_spec("flwr")
    if spec is not None and spec.origin:  # the installed Flower reads this very variable, and "0" turns it off
        source = (Path(spec.origin).parent / "supercore" / "telemetry.py").read_text()
        assert f'os.getenv("{name}", "1")' in source and f'{name} == "1"' in source
    for path in UNITS.values():
        assert environment(unit(path))[name] == "0", path.name
    assert re.search(rf"ENV {name}=0\b", (DEPLOY / "Dockerfile").read_text())
    assert f"{name}=0" in GUIDE.read_text() and "telemetry" in GUIDE.read_text().lower()


def test_the_units_check_the_certificates_their_flower_command_uses():
    pytest.importorskip("cryptography")
    from fdam_ray.flower.renewal import parsers

    for role, path in UNITS.items():
        u = unit(path)
        pre = shlex.split(u["ExecStartPre"][0].lstrip("-"))
        assert u["ExecStartPre"][0].startswith("-")  # a warning never stops the start
        python = Path(pre[0])
        start = shlex.split(u["ExecStart"][0].replace("${", "{"))
        assert python.parent == Path(start[0]).parent  # the same environment as Flower's command
        assert pre[1:4] == ["-m", "fdam_ray.flower.certs", "check"]
        checked = parsers()["check"].parse_args(pre[4:]).files
        used = [start[start.index(flag) + 1] for flag in ("--ssl-certfile", "--ssl-ca-certfile", "--root-certificates")
                if flag in start]
        assert sorted(checked) == sorted(used), role


def test_the_units_commands_take_only_options_the_installed_flower_takes():
    pytest.importorskip("flwr")
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    for role, parser in (("superlink", _parse_args_run_superlink), ("supernode", _parse_args_run_supernode)):
        start = shlex.split(unit(UNITS[role])["ExecStart"][0].replace("${", "{"))
        assert Path(start[0]).name == f"flower-{role}"
        args = parser().parse_args(start[1:])  # refuses an option it does not take
        assert args.root_certificates if role == "supernode" else args.ssl_certfile
