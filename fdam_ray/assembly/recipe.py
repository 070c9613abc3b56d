"""The one way a config becomes a running federation.

Every entry point assembles its federation here: ``fdam train`` and
[`fdam_ray.train`][fdam_ray.api.train] ([`run`][fdam_ray.assembly.recipe.run]),
[`fdam_ray.train_arrays`][fdam_ray.api.train_arrays] ([`run`][fdam_ray.assembly.recipe.run] with in-memory data), ``fdam
train --resume`` ([`resume`][fdam_ray.assembly.recipe.resume]), every Ray Tune trial (`fdam_ray.tuning.trial`) and the
benchmarks. `federate` does, in order:

1. the data source (the config's dataset, or the one given); for your own
   Datasets, the sample shape and number of tasks the network is built for,
   read where client 0 runs when the driver holds none of the data
   (`describe_data`);
2. the initial network weights, for a run that does not resume: the weights
   given, else the ``model_weights`` file, else the seeded initialisation; then,
   with ``pretrain_iterations`` > 0, stage 1 of the two-stage recipe (a BCE
   federation assembled by this same function, `fdam_ray.assembly.pretrain`), whose
   body with a fresh head becomes the initial weights;
3. the executor (the config's, or the one given);
4. the outputs, as one observer: the run folder, the progress bar, a callback
   per evaluation, the experiment trackers the config names (`fdam_ray.outputs.trackers`)
   and any observer the caller adds (a Tune trial's reports);
5. the `Federation`, run from the start or from a
   `Checkpoint`, which then holds the whole state:
   initial weights and pre-training are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fdam_ray.assembly.capacity import check_capacity
from fdam_ray.assembly.cuts import federation, tracked_run
from fdam_ray.assembly.pretrain import (
    RECIPE_FILE,
    PretrainProgress,
    Stage2Folder,
    pretrain_config,
    pretrain_source,
    pretrained_body,
    read_recipe,
    recipe_record,
)
from fdam_ray.assembly.weights import load_weights, read_weights
from fdam_ray.checkpoint import Checkpoint, CheckpointError, check_fits, load_checkpoint
from fdam_ray.clients.client import resolve_device
from fdam_ray.config import RENAMED_PER_ACTOR, RESUME_MAY_CHANGE, Config, ConfigError, build_config
from fdam_ray.data import DataSource, make_source
from fdam_ray.data.datasets import DatasetsSource, check_shippable, describe_client
from fdam_ray.data.rooted import check_data_here
from fdam_ray.executors import Executor, make_executor
from fdam_ray.executors.errors import PlacementError
from fdam_ray.executors.inline import InlineExecutor, ignored_fields
from fdam_ray.executors.ray_section import RayExecutorSection
from fdam_ray.features.interrupts import RunStopped
from fdam_ray.files.runlock import check_not_in_use
from fdam_ray.files.torchload import safe_load
from fdam_ray.loop.one_at_a_time import one_federation_at_a_time
from fdam_ray.loop.summary import RunResult
from fdam_ray.models import model_name
from fdam_ray.outputs import EvalCallback, Observer, Observers, OutputSection, Progress, RunFolder
from fdam_ray.outputs.agreement import check_one_run, check_same_config
from fdam_ray.outputs.records import read_summary
from fdam_ray.outputs.run_folder import check_new_run_dir
from fdam_ray.outputs.trackers import check_usable as trackers_usable
from fdam_ray.outputs.trackers import make_trackers
from fdam_ray.privacy.section import PrivacySection, check_resume
from fdam_ray.settings.factories import PYTHON_PREFIX

log = logging.getLogger(__name__)


def federate(
    config: Config,
    *,
    source: DataSource | None = None,
    executor: Executor | None = None,
    initial_model_state: dict[str, torch.Tensor] | None = None,
    resume: Checkpoint | None = None,
    save: bool = True,
    run_dir: Path | None = None,
    checkpoints: bool = True,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    observers: Sequence[Observer] = (),
    pretrained: RunResult | None = None,
    files: dict[str, dict] | None = None,
) -> RunResult:
    """Assemble the federation ``config`` describes and run it (see the module docstring).

    Args:
        config: a validated config.
        source: the data (default: the dataset the config names).
        executor: how clients run (default: the config's ``executor``); shut down at the end.
        initial_model_state: network weights to start from (default: ``model_weights``, else seeded).
        resume: a checkpoint to continue from (initial weights and pre-training are then skipped).
        save: write a run folder (:class:`~fdam_ray.outputs.RunFolder`).
        run_dir: the run folder to write (a resumed run's); None makes a new one under ``out_dir``.
        checkpoints: write ``checkpoint.pt`` into the run folder.
        on_eval: called with every evaluation record as it is made.
        progress: show a progress bar over iterations.
        observers: more observers of the run (e.g. a Tune trial's reports); stage 1 of pre-training
            reports only to its own run folder and progress bar.
        pretrained: stage 1 of the two-stage recipe, already run (a resumed recipe's); None runs it here.
        files: more YAML files for a fresh run folder (stage 1's ``recipe.yaml``).
    """
    with one_federation_at_a_time():  # a second one in another thread is refused before it makes or reads anything
        return _federate(config, source=source, executor=executor, initial_model_state=initial_model_state,
                         resume=resume, save=save, run_dir=run_dir, checkpoints=checkpoints, on_eval=on_eval,
                         progress=progress, observers=observers, pretrained=pretrained, files=files)


def _federate(config: Config, *, source: DataSource | None, executor: Executor | None,
              initial_model_state: dict[str, torch.Tensor] | None, resume: Checkpoint | None, save: bool,
              run_dir: Path | None, checkpoints: bool, on_eval: Callable[[dict], None] | None, progress: bool,
              observers: Sequence[Observer], pretrained: RunResult | None, files: dict[str, dict] | None,
              ) -> RunResult:
    trackers_usable(config.trackers)  # before any data is read or client started
    if resume is None and save and run_dir is None:
        check_new_run_dir(OutputSection.of(config))  # a name in use is refused now, not after pre-training
    source = source if source is not None else make_source(config, executor=config.executor, address=config.address)
    if source.num_clients != config.num_clients:
        raise ValueError(f"the data has {source.num_clients} clients but num_clients={config.num_clients}")
    # every missing folder or file at once, before Ray or any client starts
    check_data_here(source, config.dataset, executor=config.executor, address=config.address)
    describe_data(source, config, executor)
    if not config.pretrain_iterations or resume is not None:  # a two-stage run's warning comes with stage 1
        warn_ignored(config)
    weights, weights_from, pretrained = _initial_weights(config, source, initial_model_state, resume, pretrained,
                                                         save=save, progress=progress)
    outputs: list[Observer] = []
    folder = RunFolder(config, run_dir=run_dir, checkpoints=checkpoints, files=files) if save else None
    if folder is not None:
        outputs.append(folder)
        if pretrained is not None and pretrained.run_dir is not None:
            outputs.append(Stage2Folder(pretrained.run_dir, config, lambda: folder.dir))
    if progress:
        outputs.append(Progress())
    if on_eval is not None:
        outputs.append(EvalCallback(on_eval))
    # after the run folder
    outputs.extend(make_trackers(tracked_run(config), lambda: None if folder is None else folder.dir))
    outputs.extend(observers)
    executor = executor if executor is not None else make_executor(config.executor)
    # Under Ray the driver's replica only loads states and, with eval_on=driver, scores: it stays on the CPU,
    # outside Ray's GPU accounting (the clients hold the GPU shares).
    driver_device = resolve_device(config.device) if config.executor == "inline" else torch.device("cpu")
    with executor:
        fed = federation(config, source=source, executor=executor, driver_device=driver_device,
                         observer=Observers(outputs))
        check_capacity(config, fed.replica.flat.state_size)
        if resume is not None:  # before a client is started: an entry of another size or kind is a damaged file
            check_fits(resume, "checkpoint.pt" if run_dir is None else run_dir / "checkpoint.pt",
                       fed.replica.flat.initial_state())
        if weights is not None:
            load_weights(fed.replica.flat.model, weights, source=weights_from)
        result = fed.run(resume=resume)
    result.config = config
    result.pretrain = pretrained
    return result


def warn_ignored(config: Config) -> None:
    """One warning naming the Ray executor's fields that ``executor=inline`` ignores, when any is set."""
    if config.executor == "inline":
        ignored = ignored_fields(RayExecutorSection.of(config))
        if ignored:
            log.warning("executor=inline ignores %s (fields of the Ray executor, which have no effect on an inline "
                        "run)", ", ".join(ignored))


def _initial_weights(config: Config, source: DataSource, weights: dict[str, torch.Tensor] | None,
                     resume: Checkpoint | None, pretrained: RunResult | None, *, save: bool, progress: bool,
                     ) -> tuple[dict[str, torch.Tensor] | None, str, RunResult | None]:
    """(the weights a fresh run starts from, where they come from, stage 1's run when there is one).

    With ``pretrain_iterations``, stage 1 runs here (it starts from the given weights or ``model_weights``, as
    any run does) unless ``pretrained`` is its run already; its folder records the whole recipe
    (:data:`~fdam_ray.assembly.pretrain.RECIPE_FILE`), so resuming it continues into stage 2."""
    if resume is not None:
        return weights, "initial_model_state", None
    if config.pretrain_iterations:
        if pretrained is None:
            stage1 = pretrain_config(config)
            log.info("pre-training: %d iterations of %s with bce on %s", stage1.iterations, stage1.algorithm,
                     "every client" if stage1.num_clients > 1 else "client 0")
            pretrained = federate(stage1, source=pretrain_source(stage1, source), initial_model_state=weights,
                                  save=save, progress=progress, files={RECIPE_FILE: recipe_record(config)},
                                  observers=[PretrainProgress()])  # its progress in the log
            log.info("pre-training done: test AUC %.4f", pretrained.summary["final_test_auc"])
        return pretrained_body(pretrained.model_state, config, source), "pre-trained weights", pretrained
    if weights is None and config.model_weights:
        return read_weights(config.model_weights), f"model_weights '{config.model_weights}'", None
    return weights, "initial_model_state", None


def describe_data(source: DataSource, config: Config, executor: Executor | None) -> None:
    """Read the sample shape and number of tasks of your own Datasets where client 0 runs, if not known yet.

    Inline, that is this process; under Ray, a task of its own (no CPU reserved), so that under Ray the
    driver never reads a client's data. Under Ray, first refuse in one line a model factory or client entry
    that Ray could not send to the clients' processes.
    """
    on_ray = config.executor == "ray" if executor is None else not isinstance(executor, InlineExecutor)
    if on_ray:
        from fdam_ray.executors.ray.shipping import unpicklable

        # your own code that Ray cannot send: one line, before Ray starts
        check_shippable(config.model, source, unpicklable)
    if not isinstance(source, DatasetsSource) or source.described:
        return
    if not on_ray:
        source.describe_here()
        return
    from fdam_ray.executors.ray.session import run_task

    actors = -(-config.num_clients // config.clients_per_actor)
    try:
        found = run_task(describe_client, source.for_client(0), address=config.address,
                         cpus_needed=actors * config.cpus_per_actor, timeout_s=config.ray_timeout_s)
    except TimeoutError:
        raise RuntimeError(f"reading client 0's first sample took longer than ray_timeout_s="
                           f"{config.ray_timeout_s:g} s") from None
    if isinstance(found, str):
        raise ValueError(found)
    source.set_shapes(*found)


def run(
    config: Config,
    *,
    source: DataSource | None = None,
    executor: Executor | None = None,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    initial_model_state: dict[str, torch.Tensor] | None = None,
) -> RunResult:
    """Train one federation as ``config`` says and return its `RunResult`.

    Args:
        config: a validated [`fdam_ray.config.Config`][fdam_ray.config.Config].
        source: the data (default: the dataset the config names).
        executor: how clients run (default: the config's ``executor``).
        save: write a run folder (see `fdam_ray.outputs`) under ``config.out_dir``.
        on_eval: called with every evaluation record as it is made.
        progress: show a progress bar over iterations.
        initial_model_state: network weights to start from (a ``state_dict``; default: the
            ``model_weights`` file if set, else the seeded initialisation). With
            ``pretrain_iterations`` > 0 they start the pre-training run (`fdam_ray.assembly.pretrain`),
            and this run starts from its body with a fresh classifier head.

    Returns:
        The finished run: the final model, the history of evaluations, the summary and the run folder.
    """
    return federate(config, source=source, executor=executor, save=save, on_eval=on_eval, progress=progress,
                    initial_model_state=initial_model_state)


def resume(
    run_dir: str | Path,
    changes: dict | None = None,
    *,
    source: DataSource | None = None,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    model: str | Callable | None = None,
) -> RunResult:
    """Continue the run in ``run_dir`` from its last checkpoint.

    A run that is finished is not trained again: its stored result is returned and nothing in its folder is
    rewritten. Stage 1's folder of a two-stage run (`fdam_ray.assembly.pretrain`)
    continues the whole recipe: stage 1 to its end, then stage 2.

    Args:
        run_dir: the run folder.
        changes: fields to change, only those in
            [`RESUME_MAY_CHANGE`][fdam_ray.config.RESUME_MAY_CHANGE] (how the run executes, or a longer
            ``iterations``); anything else means a different run and is refused, and so is an ``iterations``
            short of where the run is already (its record would no longer match its metrics).
        source: the data of a run made by [`train_arrays`][fdam_ray.api.train_arrays] or
            [`train_datasets`][fdam_ray.api.train_datasets], the same data given again as those build it:
            ``ArraysSource(clients, test, client_tests)`` (``fdam_ray.data.arrays``) or
            ``DatasetsSource(clients, test, client_tests)`` (``fdam_ray.data.datasets``).
        on_eval: called with every evaluation record as it is made.
        progress: show a progress bar over iterations.
        model: the model factory of a run that was given one in Python which cannot be imported by name (its
            run folder records only its name, ``python:module.name``); it must have that same name.

    Returns:
        The finished run, as [`run`][fdam_ray.assembly.recipe.run] returns it.

    Raises:
        ValueError: one line, before anything in the folder is written: not a run folder, a change that is
            not allowed, a run of your own data without ``source``, a damaged checkpoint.
    """
    with one_federation_at_a_time():  # (a finished run's resume sets the process's torch RNG as the run left it)
        return _resume(Path(run_dir), changes, source=source, on_eval=on_eval, progress=progress, model=model)


def _resume(run_dir: Path, changes: dict | None, *, source: DataSource | None,
            on_eval: Callable[[dict], None] | None, progress: bool, model: str | Callable | None) -> RunResult:
    if not run_dir.is_dir():
        raise ValueError(f"--resume: '{run_dir}' is not a run folder")
    if not (run_dir / "checkpoint.pt").exists():
        raise ValueError(f"--resume: '{run_dir}' has no checkpoint.pt (not a run folder, or its run stopped "
                         "before the first checkpoint)")
    check_not_in_use(run_dir)  # at once, not after the clients have started
    checkpoint = load_checkpoint(run_dir / "checkpoint.pt")
    check_one_run(run_dir, checkpoint, may_differ=RESUME_MAY_CHANGE)  # before anything in the folder is written
    saved = _saved_config(run_dir, dict(checkpoint.config or {}), model, run_dir / "checkpoint.pt")
    recipe = read_recipe(run_dir)
    if recipe is not None:
        return _resume_recipe(run_dir, checkpoint, saved, recipe, changes, source=source, on_eval=on_eval,
                              progress=progress, model=model)
    wanted = _wanted(run_dir, saved, changes, done=checkpoint.loop.state.iteration)
    return _continue(run_dir, checkpoint, saved, wanted, source=source, on_eval=on_eval, progress=progress)


def _saved_config(run_dir: Path, recorded: dict, model: str | Callable | None, holder: Path) -> Config:
    """The config a run folder records (in ``holder``), with a Python model factory given again as ``model``."""
    saved_model = recorded.get("model")
    if model is not None:
        given = model_name(model)
        if given != saved_model:
            raise ConfigError(f"cannot resume '{run_dir}' with a different config (model: {saved_model!r} -> "
                              f"{given!r})")
        recorded["model"] = model
    elif isinstance(saved_model, str) and saved_model.startswith(PYTHON_PREFIX):
        raise ConfigError(f"--resume: '{run_dir}' was trained with a model factory given in Python "
                          f"({saved_model}), which its run folder cannot rebuild; resume it from Python: "
                          f"fdam_ray.resume('{run_dir}', model=<that factory>), or next time give the factory as "
                          "an import path module:attr")
    try:
        return build_config(recorded)
    except ConfigError as exc:
        what = "checkpoint" if holder.name == "checkpoint.pt" else "file"
        raise CheckpointError(f"{what} '{holder}' holds a config that is not valid: {exc}") from None


def _wanted(run_dir: Path, saved: Config, changes: dict | None, *, done: int | None) -> Config:
    """``saved`` with ``changes``, refused unless every change is one a resume may make (``done``: the iterations
    the run has trained, None before it started)."""
    changes = dict(changes or {})
    renamed = {RENAMED_PER_ACTOR[k] for k in changes if k in RENAMED_PER_ACTOR}  # an old name overrides its field
    kept = {k: v for k, v in dataclasses.asdict(saved).items() if k not in renamed}  # a Python factory kept as is
    wanted = build_config({**kept, **changes})
    check_may_change(run_dir, saved, wanted, done=done)
    return wanted


def check_may_change(run_dir: Path, saved: Config, wanted: Config, *, done: int | None) -> None:
    """Refuse a resume of ``saved`` as ``wanted`` that changes what the run computes, or that would end it before
    the ``done`` iterations it has trained (its metrics would then go past the ``iterations`` its config says)."""
    check_resume(PrivacySection.of(saved), PrivacySection.of(wanted))  # dp_max_epsilon: raised only
    before, after = saved.to_dict(), wanted.to_dict()
    differ = [k for k in before if before[k] != after[k] and k not in RESUME_MAY_CHANGE]
    if differ:
        detail = ", ".join(f"{k}: {getattr(saved, k)!r} -> {getattr(wanted, k)!r}" for k in differ)
        raise ConfigError(f"cannot resume '{run_dir}' with a different config ({detail}); only "
                          f"{', '.join(sorted(RESUME_MAY_CHANGE))} may change")
    if done is not None and wanted.iterations < done:
        raise ConfigError(f"cannot resume '{run_dir}' with iterations={wanted.iterations}: the run's iterations is "
                          f"{saved.iterations} and it has trained {done} already; a resume cannot end a run before "
                          f"where it is (its record would no longer match its metrics): give iterations >= {done}, "
                          "or leave it out")


def _continue(run_dir: Path, checkpoint: Checkpoint, saved: Config, wanted: Config, *,
              source: DataSource | None, on_eval: Callable[[dict], None] | None, progress: bool) -> RunResult:
    """Continue one run folder as ``wanted``; a finished run (and no longer ``iterations``) is returned as it is."""
    done = checkpoint.loop.state.iteration
    if done >= wanted.iterations:
        stored = stored_result(run_dir, checkpoint, saved)
        if stored is not None:
            log.warning("run '%s' is already finished (iteration %d of iterations=%d): nothing was trained or "
                        "rewritten; to train it further, resume it with a larger iterations", run_dir, done,
                        saved.iterations)
            torch.set_rng_state(checkpoint.torch_rng)  # as the run left it (a recipe's stage 2 goes on from it)
            return stored
    try:
        return federate(wanted, source=source, resume=checkpoint, run_dir=run_dir, on_eval=on_eval,
                        progress=progress)
    except (PlacementError, RunStopped) as exc:  # stopped before a round (placement, joining): say how to go on
        if exc.args and "--resume" not in str(exc.args[0]):
            exc.args = (f"{exc.args[0]}; its last checkpoint is kept: continue with: fdam train --resume {run_dir}",)
        raise


def stored_result(run_dir: Path, checkpoint: Checkpoint, config: Config) -> RunResult | None:
    """The result of the finished run in ``run_dir``, read from its files (None when they are not all there)."""
    try:
        summary = read_summary(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
        model = safe_load(run_dir / "model.pt")
        model_state, a, b = model["model"], model["a"].numpy(), model["b"].numpy()
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError):
        return None  # not finished writing: the resume writes them
    if not isinstance(summary, dict) or summary.get("iterations") != checkpoint.loop.state.iteration:
        return None  # (a summary of an earlier, shorter session of the run)
    state = checkpoint.loop.state
    cv = None if state.c_v is None or state.c_alpha is None else (state.c_v, state.c_alpha)
    return RunResult(config, model_state, a, b, state.alpha.copy(), cv, checkpoint.loop.history, summary, state,
                     run_dir)


def _resume_recipe(run_dir: Path, checkpoint: Checkpoint, saved_stage1: Config, recipe: dict,
                   changes: dict | None, *, source: DataSource | None, on_eval: Callable[[dict], None] | None,
                   progress: bool, model: str | Callable | None) -> RunResult:
    """Continue a two-stage run from stage 1's folder: stage 1 to its end, then stage 2 (or, when stage 2 has a
    checkpoint already, stage 2 from it)."""
    recorded = _saved_config(run_dir, dict(recipe["config"]), model, run_dir / RECIPE_FILE)
    check_same_config(run_dir, RECIPE_FILE, pretrain_config(recorded).to_dict(), dict(checkpoint.config or {}),
                      may_differ=RESUME_MAY_CHANGE)  # the recipe's stage 1 is this folder's run
    whole = _wanted(run_dir, recorded, changes, done=None)  # stage 2 has not begun
    stage2_dir = recipe.get("stage2_dir")
    if stage2_dir and (Path(stage2_dir) / "checkpoint.pt").exists():
        log.info("pre-training in '%s' is finished; continuing stage 2 in '%s'", run_dir, stage2_dir)
        return resume(stage2_dir, changes, source=source, on_eval=on_eval, progress=progress, model=model)
    stage1 = pretrain_config(whole)
    check_may_change(run_dir, saved_stage1, stage1, done=checkpoint.loop.state.iteration)
    source = source if source is not None else make_source(whole, executor=whole.executor, address=whole.address)
    describe_data(source, whole, None)
    first = _continue(run_dir, checkpoint, saved_stage1, stage1, source=pretrain_source(stage1, source),
                      on_eval=None, progress=progress)
    log.info("pre-training done: test AUC %.4f; stage 2 begins", first.summary["final_test_auc"])
    return federate(whole, source=source, pretrained=first, on_eval=on_eval, progress=progress)
