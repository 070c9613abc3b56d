"""The ServerApp's run folder on the SuperLink host, and a study resumed from it after the server stopped.

A consortium's server writes what every fdam-ray run writes (``config.yaml``,
``metrics.csv``/``metrics.jsonl``, ``summary.json``, ``model.pt``,
``checkpoint.pt``, the trackers the config names) into a run folder of its own
host. The sites keep their own states (c^k, sampler position, the stage's
centre) in their state files; the checkpoint holds what the server needs to
take them back: the run's key at the sites, the stage count they were told and
the last round of each site the server folded (:class:`ResumableExecutor`).

Why a checkpoint after every round: a site adopts its state of round r only
when the server's next message says it counted round r, and that message
follows the checkpoint of round r. With a checkpoint at every round end, no
site ever holds a state the last checkpoint does not know of, except the
pending state of the round the server stopped in, which the resumed server's
first message (it counted nothing of that round) makes the site drop. A study
stopped anywhere and resumed from its folder is then the uninterrupted study,
bit for bit (tests/flower/test_flower_server.py). The config's
``checkpoint_every`` is kept as given in its record; on Flower it has no effect.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fdam_ray.assembly.cuts import tracked_run
from fdam_ray.assembly.recipe import check_may_change, stored_result
from fdam_ray.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from fdam_ray.config import RESUME_MAY_CHANGE, Config, ConfigError, build_config
from fdam_ray.core.state import ClientState
from fdam_ray.files.runlock import check_not_in_use
from fdam_ray.flower.executor import FlowerExecutor
from fdam_ray.loop.summary import RunResult
from fdam_ray.outputs import Observer, RunFolder
from fdam_ray.outputs.agreement import check_one_run
from fdam_ray.outputs.observer import RunStart
from fdam_ray.outputs.trackers import make_trackers

log = logging.getLogger(__name__)

SITES_KEY = "flower_sites"  # the checkpoint's executor state: what the server needs to take the sites back


class ResumableExecutor(FlowerExecutor):
    """A :class:`FlowerExecutor` whose checkpoints say where the sites are, and that takes them back from one.

    Args:
        kept: the ``flower_sites`` entry of the checkpoint a resumed run starts from (None: a fresh run).
    """

    def __init__(self, *args: Any, kept: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept = None if kept is None else dict(kept)

    def _start_sites(self) -> Any:
        # before the first message of a resumed run: the run key the sites keep their states under (a resumed
        # run's config may differ in the fields a resume may change), the stage count they were told, and the
        # last round of each that was folded (a site drops a later, uncounted round's state)
        if self.kept is not None:
            self.run_key, self.stage = str(self.kept["run_key"]), int(self.kept["stage"])
            counted = [int(r) for r in self.kept["counted"]]
            if len(counted) != self.num_sites:
                raise CheckpointError(f"the checkpoint knows {len(counted)} sites, the run has {self.num_sites}")
            self.counted = dict(enumerate(counted))
        return super()._start_sites()

    def transfer_state(self) -> dict | None:
        sites = {"run_key": self.run_key, "stage": self.stage,
                 "counted": [self.counted[k] for k in range(self.num_sites)]}
        return {SITES_KEY: sites}

    def restore_transfer_state(self, state: dict | None) -> None:
        """The sites were taken back when they started (:meth:`_start_sites`); nothing else travels."""

    def restore_client_states(self, states: list[ClientState | None]) -> None:
        if any(s is not None for s in states):
            raise ValueError("a Flower run's checkpoint holds no site's state: the sites keep their own")


class EveryRoundFolder(RunFolder):
    """The run folder, with a checkpoint after every round (see the module docstring)."""

    def needs_state(self, round_: int) -> bool:
        return True


def resume_point(run_dir: Path, wanted: Config) -> Checkpoint | None:
    """The checkpoint ``run_dir`` holds, or None when it holds none (a fresh run is written there). The study sent
    now (``wanted``) must be the folder's but for the fields a resume may change."""
    if not (run_dir / "checkpoint.pt").exists():
        return None
    check_not_in_use(run_dir)
    checkpoint = load_checkpoint(run_dir / "checkpoint.pt")
    check_one_run(run_dir, checkpoint, may_differ=RESUME_MAY_CHANGE)
    try:
        saved = build_config(dict(checkpoint.config or {}))
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint '{run_dir / 'checkpoint.pt'}' holds a config that is not valid: {exc}"
                              ) from None
    transfer = checkpoint.loop.transfer or {}
    if SITES_KEY not in transfer:
        raise CheckpointError(f"run folder '{run_dir}' holds a run that did not run on Flower (its checkpoint "
                              "does not say where the sites are); continue it with: fdam train --resume "
                              f"{run_dir}")
    check_may_change(run_dir, saved, wanted, done=checkpoint.loop.state.iteration)
    log.info("resuming the study in %s at round %d (iteration %d)", run_dir, checkpoint.loop.state.round,
             checkpoint.loop.state.iteration)
    return checkpoint


def finished_result(run_dir: Path, checkpoint: Checkpoint, config: Config) -> RunResult | None:
    """The stored result of a run that is finished already (nothing is trained or rewritten), else None."""
    if checkpoint.loop.state.iteration < config.iterations:
        return None
    stored = stored_result(run_dir, checkpoint, config)
    if stored is not None:
        log.warning("the study in '%s' is finished already (iteration %d): nothing was trained or rewritten; to "
                    "train it further, send it with a larger iterations", run_dir, checkpoint.loop.state.iteration)
    return stored


class KeepBindings(Observer):
    """Once a new run folder exists (its ``start``), keep the sites' bindings to their nodes' keys in it."""

    def __init__(self, executor: FlowerExecutor, folder: RunFolder) -> None:
        self.executor, self.folder = executor, folder

    def start(self, run: RunStart) -> None:
        if self.folder.dir is not None:  # made by the run folder's own start, which runs first
            self.executor.keep_bindings_in(self.folder.dir)


def outputs(config: Config, run_dir: Path | None, executor: FlowerExecutor | None = None) -> list[Observer]:
    """The run folder (``run_dir``, or a new one under the config's ``out_dir``) and the config's trackers; with
    ``executor`` and no ``run_dir``, the sites' bindings go into the new folder once it is made."""
    folder = EveryRoundFolder(config, run_dir=run_dir)
    keep: list[Observer] = [KeepBindings(executor, folder)] if executor is not None and run_dir is None else []
    return [folder, *keep, *make_trackers(tracked_run(config), lambda: folder.dir)]
