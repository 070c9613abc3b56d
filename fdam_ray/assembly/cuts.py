"""The config cut into what a part below the assembly takes: the parts know their own sections, not the config.

Most parts are given ``XSection.of(config)``; what needs fields of several sections gets a small value object cut
here, once, for every caller at the top (a run's recipe, a Flower server's run folder, a sweep's callbacks).
"""

from __future__ import annotations

from fdam_ray.config import Config
from fdam_ray.outputs import OutputSection
from fdam_ray.outputs.trackers import TrackedRun


def tracked_run(config: Config) -> TrackedRun:
    """What the experiment trackers know of the run of ``config``."""
    return TrackedRun(outputs=OutputSection.of(config), algorithm=config.algorithm, dataset=config.dataset,
                      params=config.to_dict())
