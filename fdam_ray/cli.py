"""The ``fdam`` command.

    fdam train [--config FILE.yaml] [--resume RUN_DIR] [--quiet] [key=value ...]
    fdam plot RUN_DIR [RUN_DIR ...] [--out DIR]
    fdam fields [SECTION | WORD ...]
    fdam --version
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from fdam_ray.features import interrupts
from fdam_ray.files.locations import where
from fdam_ray.settings.redact import clip, redact, redact_handlers
from fdam_ray.settings.sections import ConfigError

# Only light modules above: the command line and a config file are read and checked for form before torch (and
# the config module, whose sections import it) is imported, which takes tens of seconds on a loaded machine.

if TYPE_CHECKING:
    from fdam_ray.loop.summary import RunResult


def _version() -> str:
    from fdam_ray import __version__

    return __version__


def _print_record(rec: dict) -> None:
    from fdam_ray.outputs.progress import write_evaluation

    write_evaluation(rec)  # fitted to the terminal; keeps a progress bar, if one is shown, intact


def _print(text: str) -> None:
    """Print ``text`` to stdout, wrapped between its clauses to the terminal's width (never inside a number)."""
    from fdam_ray.outputs.progress import fit_text, line_width

    print("\n".join(fit_text(text, line_width(sys.stdout))), flush=True)


def _summary(summary: dict) -> str:
    mb = (summary["bytes_up"] + summary["bytes_down"]) / 1e6
    best = (f"best {summary['best_test_auc']:.4f}" if "best_val_auc" not in summary else
            f"selected by val AUC {summary['best_val_auc']:.4f}: test {summary['best_test_auc']:.4f}"
            if summary.get("selected_by") == "val_auc" else
            f"selected by {summary['selected_by']} {summary['best_' + summary['selected_by']]:.4f}: test "
            f"{summary['best_test_auc']:.4f}" if summary.get("selected_by", "last") != "last" else
            f"no val AUC defined, none selected: last test {summary['best_test_auc']:.4f}")
    return (f"final test AUC {summary['final_test_auc']:.4f} ({best} at iteration "
            f"{summary['best_iteration']}); {summary['rounds']} rounds, {summary['iterations']} iterations, "
            f"{mb:.1f} MB moved, {summary['wall_s']:.1f} s, {summary['samples_per_s']} samples/s")


def _train_or_resume(resume_dir: str | None, values: dict, **how: Any) -> RunResult:
    """Run the config ``values`` describe, or continue the run in ``resume_dir`` (``values`` may change it)."""
    from fdam_ray.assembly.recipe import resume, run
    from fdam_ray.config import build_config

    if resume_dir:
        print(f"fdam train: resuming {resume_dir}", flush=True)
        return resume(resume_dir, values, **how)
    config = build_config(values)
    _print(f"fdam train: {config.algorithm} on {config.dataset}, K={config.num_clients}, I={config.local_steps}, "
           f"{config.iterations} iterations, model {config.model}, executor {config.executor}")
    return run(config, **how)


def read_command_config(config_file: str | None, overrides: list[str]) -> dict[str, Any]:
    """The config file's mapping (empty without one), checked for form with light modules only: the file exists
    and is YAML holding a mapping, and every override is ``key=value``. Raises ConfigError in one line."""
    from fdam_ray.files.yamlfile import read_yaml_file

    for item in overrides or ():
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{clip(item, 80)}' is not of the form key=value")
    if not config_file:
        return {}
    data = read_yaml_file(config_file, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{clip(config_file)}' must hold a mapping of field: value, not "
                          f"{type(data).__name__}")
    return data


def check_field_names(values: dict[str, Any], overrides: list[str] | None) -> None:
    """Every key of the config file and the command line names a field, and the command line names each once,
    checked against the stored field table (no torch): the one-line error :func:`fdam_ray.config.build_config`
    would give, in a second rather than after the imports."""
    from fdam_ray.settings.catalog import stored_names
    from fdam_ray.settings.names import check_keys, once_each

    names = stored_names()
    once_each(overrides or (), names)
    check_keys(values, names)
    check_keys({item.partition("=")[0].strip(): None for item in overrides or ()}, names)


def cmd_train(args: argparse.Namespace) -> int:
    values = read_command_config(args.config, args.overrides)  # before torch: a config error in a second
    check_field_names(values, args.overrides)

    from fdam_ray.config import parse_overrides
    from fdam_ray.executors.errors import ClientError, PlacementError
    from fdam_ray.features.interrupts import RunStopped, clear_stop_request, request_stop
    from fdam_ray.loop.federation import DivergenceError

    values.update(parse_overrides(args.overrides))
    if args.address:
        values["address"] = args.address
    on_eval = None if args.quiet else _print_record
    progress = not args.quiet and not args.no_progress and sys.stderr.isatty()

    def on_first_signal(signum: int) -> None:
        if signum != signal.SIGTERM:
            raise interrupts.Interrupted(signum)  # Ctrl+C: at once, the last checkpoint kept
        request_stop("received SIGTERM")  # what Slurm, Kubernetes and spot reclaim send: at the next round end

    clear_stop_request()
    interrupts.set_first(on_first_signal)
    try:
        result = _train_or_resume(args.resume, values, on_eval=on_eval, progress=progress)
    except RunStopped as exc:
        print(f"fdam: {exc}", file=sys.stderr)
        return interrupts.exit_code(signal.SIGTERM)
    except DivergenceError as exc:
        print(f"fdam: run diverged: {exc}", file=sys.stderr)
        return 1
    except PlacementError as exc:  # names the clients, what they ask for and, mid-run, how to resume
        print(f"fdam: {exc}", file=sys.stderr)
        return 1
    except ClientError as exc:
        if isinstance(exc, ValueError):
            raise  # the client rejected its data or config: one line, like any bad input
        print(f"fdam: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(note, file=sys.stderr)
        return 1
    finally:
        clear_stop_request()
    _print(_summary(result.summary))
    if result.run_dir is not None:  # a run of fdam train always writes its folder
        print(f"run folder: {where(result.run_dir)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    read_command_config(None, args.overrides)  # before torch: a malformed override in a second
    from fdam_ray.config import parse_overrides
    from fdam_ray.tuning import load_space, run_sweep

    if args.resume:
        from fdam_ray.tuning.sweep import check_resume_trusted

        check_resume_trusted(args.resume, trust_storage=args.trust_storage)  # before anything is read from it
    if args.resume and not args.space:
        from fdam_ray.tuning import space_of_sweep

        space = space_of_sweep(args.resume)
    else:
        if not args.space:
            from fdam_ray.tuning.space import no_space_hint

            raise ConfigError(no_space_hint())
        space = load_space(args.space, parse_overrides(args.overrides))
    outcome = run_sweep(space, resume_dir=args.resume, address=args.address, trust_storage=args.trust_storage)
    out = outcome.path
    if outcome.storage:
        print(f"sweep stored:  {redact(outcome.storage)} (a copy of its results below)")
    print(f"sweep results: {where(out / 'sweep_results.md')}")
    if outcome.best_config is not None:
        print(f"best config:   {outcome.best_config}  (fdam train --config {outcome.best_config})")
    print(f"figure:        {out / 'top_trials.png'}")
    for trial, line in outcome.failed:
        print(f"fdam tune: trial {trial} failed: {redact(line)}", file=sys.stderr)
    if outcome.failed:
        print(f"fdam tune: {len(outcome.failed)} of {outcome.trials} trials failed; their errors in full: "
              f"{outcome.errors_file}", file=sys.stderr)
    if outcome.unfinished:
        print(f"fdam tune: the sweep was interrupted with {outcome.unfinished} of {outcome.trials} trials "
              "unfinished, so it has no best config yet; continue it with: fdam tune --resume "
              f"{redact(outcome.resume_from)}"
              + (" --trust-storage" if outcome.storage else ""),
              file=sys.stderr)
        return interrupts.exit_code(interrupts.received() or signal.SIGINT)
    if outcome.best_config is None:
        print("fdam tune: no trial finished without an error, so there is no best config", file=sys.stderr)
        return 1
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from fdam_ray.plots import plot_runs

    out = args.out or (args.runs[0] if len(args.runs) == 1 else "plots")
    for path in plot_runs(args.runs, out):
        print(path)
    return 0


def cmd_fields(args: argparse.Namespace) -> int:
    from fdam_ray.settings.catalog import describe_stored

    print(describe_stored(args.terms))  # the stored table: no torch, Ray or scikit-learn to import
    return 0


class _FieldsHelp(argparse.HelpFormatter):
    """``fdam fields -h``: the section names, read from the stored field table only when that help is shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and "{sections}" in text:
            from fdam_ray.settings.catalog import stored

            text = text.replace("{sections}", ", ".join(stored()[0]))
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fdam", description="Federated deep AUC maximization on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"fdam {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one federation",
                           description="Train one federation. With no arguments: CODASCA on digits-IH, K=4.")
    train.add_argument("--config", help="YAML file of config fields")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    train.add_argument("--quiet", action="store_true", help="print only the summary")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (evaluation lines only)")
    train.add_argument("--address", help="Ray cluster to connect to (the config field address; default: "
                       "RAY_ADDRESS, else a local Ray)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config fields (see `fdam fields`)")
    train.set_defaults(func=cmd_train)
    tune = sub.add_parser("tune", help="sweep hyper-parameters with Ray Tune; every trial is a whole federation")
    tune.add_argument("space", nargs="?", help="search-space YAML file (base / search / tune sections), or the "
                      "name of an example space shipped with fdam-ray (small, paper_grid)")
    tune.add_argument("overrides", nargs="*", metavar="key=value",
                      help="base config fields, or tune.OPTION=value for the tune section")
    tune.add_argument("--resume", metavar="DIR", help="continue the sweep stored in DIR (a folder or a storage URI)")
    tune.add_argument("--trust-storage", action="store_true",
                      help="resume from a storage URI (s3://...) whose writers cannot be checked from here")
    tune.add_argument("--address", help="Ray cluster to connect to (default: RAY_ADDRESS, else a local Ray)")
    tune.set_defaults(func=cmd_tune)
    plot = sub.add_parser("plot", help="draw PNG figures of one or several run folders")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", help="folder for the PNGs (default: the run folder, or ./plots for several runs)")
    plot.set_defaults(func=cmd_plot)
    fields = sub.add_parser("fields", help="list every config field with its default and meaning",
                            formatter_class=_FieldsHelp)
    fields.add_argument("terms", nargs="*", metavar="SECTION|WORD",
                        help="only the fields of a section ({sections}) or with this word in their name or meaning")
    fields.set_defaults(func=cmd_fields)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``fdam`` command; its exit code.

    SIGTERM and Ctrl+C stop it as :mod:`fdam_ray.features.interrupts` says. Called without ``argv`` (the ``fdam``
    command, ``python -m fdam_ray``) the process is the command's: the handlers stay for Ray's exit-time
    shutdown, where any signal exits at once. Called with ``argv`` (from a program or a test) the process's
    own handlers are given back when the command returns.
    """
    whole_process = argv is None
    interrupts.install()
    try:
        return _run_command(argv)
    finally:
        if whole_process:
            interrupts.command_returned()
        else:
            interrupts.uninstall()


def _run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value given after an option (fdam train --config f.yaml lr=0.1)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*(args.overrides or []), *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_handlers()  # no password of a URI or address reaches stderr through a log line
    if not getattr(args, "quiet", False):  # stage 1 of a two-stage run says where it is, -v or not
        logging.getLogger("fdam_ray.assembly.pretrain").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as exc:
        print(f"fdam: error: {redact(exc)}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:  # the machine, the cluster or a run that cannot go on
        if args.verbose:
            logging.getLogger("fdam_ray").exception("fdam %s failed", args.command)
        print(f"fdam: error: {type(exc).__name__}: {redact(exc)}"
              + ("" if args.verbose else " (-v for the traceback)"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl+C, or a stop signal in a wait with nothing to save
        print("fdam: interrupted", file=sys.stderr)
        return interrupts.exit_code(interrupts.received() or signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
