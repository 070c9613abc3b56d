"""The config cut into what a part below the assembly takes: the parts know their own sections, not the config.

Most parts are given ``XSection.of(config)``; what needs fields of several sections gets a small value object cut
here, once, for every caller at the top (a run's recipe, a Flower server's run folder, a sweep's callbacks).
"""

from __future__ import annotations

import torch

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.assembly.plugs import run_plug
from fdam_ray.config import Config
from fdam_ray.core.schedules import ScheduleSection
from fdam_ray.data import DataSource
from fdam_ray.data.balanced import objective_positive_ratio
from fdam_ray.executors.base import Executor, ExecutorSetup
from fdam_ray.executors.deadlines import ReplaySection
from fdam_ray.executors.rebuilds import read_replay, refuse_unreplayable
from fdam_ray.loop.federation import Federation
from fdam_ray.outputs import Observer, OutputSection
from fdam_ray.outputs.trackers import TrackedRun
from fdam_ray.privacy.section import PrivacySection


def tracked_run(config: Config) -> TrackedRun:
    """What the experiment trackers know of the run of ``config``."""
    return TrackedRun(outputs=OutputSection.of(config), algorithm=config.algorithm, dataset=config.dataset,
                      params=config.to_dict())


def federation(config: Config, *, source: DataSource, executor: Executor, driver_device: torch.device,
               observer: Observer) -> Federation:
    """The federation of ``config`` (a run's recipe, a Flower server): the algorithm built, the executor's setup
    cut, the plugs the config asks for, a participation record read and checked, the objective's fixed p."""
    setup = ExecutorSetup.cut(config, build_algorithm(AlgorithmSection.of(config)), executor.section)
    record = config.participation_record
    forced, rebuilds = ({}, {}) if record is None else read_replay(record, ReplaySection.of(config),
                                                                   ScheduleSection.of(config))
    refuse_unreplayable(rebuilds, executor)
    return Federation(source=source, executor=executor, setup=setup, schedule=ScheduleSection.of(config),
                      eval_every=config.eval_every, driver_device=driver_device, observer=observer,
                      plug=run_plug(config), histogram_bins=PrivacySection.of(config).histogram_bins,
                      forced=forced, rebuilds=rebuilds, positive_ratio=objective_positive_ratio(config),
                      select_by=config.select_by)
