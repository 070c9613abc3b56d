"""What installing fdam-ray costs: the core against ``.[dev]``, in fresh virtual environments.

For each of the two installs (``pip install <checkout>`` with no extras, and
``pip install "<checkout>[dev]"``) the script makes a new venv in a temporary
folder and measures the wall time of the install, the size of its
site-packages, and how much of that is torch: torch itself, and the CUDA
libraries its Linux wheel brings (the ``nvidia`` packages, and ``triton``),
which the CPU-only torch wheel would not bring. In the core venv it then times
the light commands, each the median of several fresh processes: ``fdam
--version``, ``fdam fields`` and ``python -c "import fdam_ray.losses"``.

Installs read whatever package index pip is configured with (here a local
mirror, so the times are no network's); the torch they get is the one that
index serves. Writes ``results/install.md`` and ends with one ``RESULT`` line.
Run it from the project's venv (``nice python benchmarks/install_footprint.py``;
it takes minutes and several GB of disk under the temporary folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "install.md"
INSTALLS: dict[str, list[str]] = {"core": [str(ROOT)], "dev": [f"{ROOT}[dev]"]}
LIGHT_COMMANDS = {
    "fdam --version": ["{bin}/fdam", "--version"],
    "fdam fields": ["{bin}/fdam", "fields"],
    "import fdam_ray.losses": ["{bin}/python", "-c", "import fdam_ray.losses"],
}
# what the Linux torch wheel brings for CUDA, and a CPU-only torch does not
CUDA_PACKAGES = ("nvidia", "triton", "cuda")

log = logging.getLogger("install_footprint")


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            file = Path(dirpath, name)
            if not file.is_symlink():
                total += file.stat().st_size
    return total


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def footprint(venv: Path) -> dict[str, float]:
    """Sizes in MB: all of site-packages, torch, and the CUDA packages beside it."""
    site = site_packages(venv)
    cuda = sum(tree_bytes(p) for p in site.iterdir() if p.is_dir() and p.name.split("_")[0].split("-")[0]
               in CUDA_PACKAGES and not p.name.endswith((".dist-info", ".data")))
    torch_dir = site / "torch"
    return {"site_mb": tree_bytes(site) / 1e6, "torch_mb": tree_bytes(torch_dir) / 1e6 if torch_dir.is_dir() else 0.0,
            "cuda_mb": cuda / 1e6}


def install(name: str, targets: list[str], where: Path) -> dict[str, float | str]:
    """A fresh venv under ``where`` with ``targets`` installed: the install's wall time and the sizes."""
    venv = where / name
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log.info("%s: pip install %s", name, shlex.join(targets))
    start = time.perf_counter()
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *targets], check=True)
    seconds = time.perf_counter() - start
    torch_version = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    row: dict[str, float | str] = {"install_s": seconds, "torch": torch_version, **footprint(venv)}
    log.info("%s: %s", name, row)
    return row


def median_seconds(command: list[str], repeats: int) -> float:
    """The median wall time of ``repeats`` fresh runs of ``command`` (each checked to succeed)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_table(rows: dict[str, dict[str, float | str]], installs: dict[str, list[str]], light: dict[str, float],
                command: str, repeats: int) -> None:
    """The generated block of ``results/install.md``: one row per install, then the light commands."""
    table = [
        "| install | pip install (s) | site-packages (MB) | torch (MB) | CUDA packages of torch (MB) | "
        "without them (MB) | torch |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        spelled = shlex.join(installs[name]).replace(str(ROOT), "<checkout>")
        table.append(f"| {name} (`pip install {spelled}`) | {float(r['install_s']):.0f} | {float(r['site_mb']):.0f} | "
                     f"{float(r['torch_mb']):.0f} | {float(r['cuda_mb']):.0f} | "
                     f"{float(r['site_mb']) - float(r['cuda_mb']):.0f} | {r['torch']} |")
    body = [
        "Fresh venvs, pip reading this machine's configured package index.",
        "",
        *table,
        "",
        "CUDA packages: the `nvidia*` and `triton` folders the Linux torch wheel brings; a CPU-only torch (the wheel",
        "from PyTorch's CPU index) brings none of them, so \"without them\" approximates a CPU-only install. That",
        "index is not reachable from this machine: the core and dev rows use the torch its package index serves;",
        "the core-cpu row (with `--cpu-torch`) installs a CPU-only torch wheel found on this machine's disk first.",
        f"Times are wall seconds on {os.cpu_count()} cores that other work shared while this ran: read the sizes",
        "first; the times are upper bounds.",
        "",
        f"Light commands in the core venv (median of {repeats} fresh processes each):",
        "",
        "| command | seconds |",
        "|---|---:|",
        *[f"| `{name}` | {seconds:.3f} |" for name, seconds in light.items()],
    ]
    C.write_results(RESULTS, "Install footprint: core against dev", command, "\n".join(body))


def result(rows: dict[str, dict[str, float | str]], light: dict[str, float]) -> str:
    """The ``RESULT`` line: install seconds and sizes in MB, and the light commands' seconds."""
    core, dev = rows["core"], rows["dev"]
    values: dict[str, float] = {"core_install_s": float(core["install_s"]), "core_mb": float(core["site_mb"]),
                                "core_cuda_mb": float(core["cuda_mb"]), "dev_install_s": float(dev["install_s"]),
                                "dev_mb": float(dev["site_mb"])}
    if "core-cpu" in rows:
        values["core_cpu_mb"] = float(rows["core-cpu"]["site_mb"])
    keys = {"fdam --version": "version_s", "fdam fields": "fields_s", "import fdam_ray.losses": "losses_s"}
    values.update({keys[name]: seconds for name, seconds in light.items()})
    return C.result_line(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per light command (median)")
    parser.add_argument("--cpu-torch", metavar="WHEEL",
                        help="also install the core with this CPU-only torch wheel first (a third venv, 'core-cpu')")
    parser.add_argument("--keep", action="store_true", help="keep the venvs (their folder is logged)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    where = Path(tempfile.mkdtemp(prefix="fdam-install-"))
    try:
        installs = dict(INSTALLS)
        if args.cpu_torch:
            installs["core-cpu"] = [str(Path(args.cpu_torch).resolve()), str(ROOT)]
        rows = {name: install(name, targets, where) for name, targets in installs.items()}
        bin_dir = str(where / "core" / "bin")
        light = {name: median_seconds([part.format(bin=bin_dir) for part in cmd], args.repeats)
                 for name, cmd in LIGHT_COMMANDS.items()}
    finally:
        if args.keep:
            log.info("venvs kept in %s", where)
        else:
            shutil.rmtree(where, ignore_errors=True)
    command = shlex.join(["python", "benchmarks/install_footprint.py", *(argv if argv is not None else sys.argv[1:])])
    write_table(rows, installs, light, command, args.repeats)
    sys.stdout.write(result(rows, light) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
