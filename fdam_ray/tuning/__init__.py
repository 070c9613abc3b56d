"""Ray Tune sweeps whose trials are whole federations (``fdam tune``).

    space.py   the search-space file: sections, validation, Ray Tune's distributions
    trial.py   one trial: a federation assembled by fdam_ray.assembly.recipe, reporting to Tune with checkpoints
    sweep.py   the sweep: Tune's searcher, scheduler and per-trial placement groups; resume
    report.py  the results: table, best config, figure
    callbacks.py  Ray Tune's MLflow and W&B logger callbacks for the sweep's trackers

For a ``ray.tune.Tuner`` of your own (any searcher, scheduler, callback): [`trainable`][fdam_ray.tuning.trainable]
(whole federations as trials, each in its placement group) and [`tracker_callbacks`][fdam_ray.tuning.tracker_callbacks]
(the config's trackers as Tune callbacks).
"""

from __future__ import annotations

from fdam_ray.tuning.callbacks import tracker_callbacks
from fdam_ray.tuning.space import Space, TuneOptions, load_space, make_space, param_space, space_of_sweep
from fdam_ray.tuning.sweep import run_sweep
from fdam_ray.tuning.trial import federation_trial, trainable

__all__ = ["Space", "TuneOptions", "federation_trial", "load_space", "make_space", "param_space", "run_sweep",
           "space_of_sweep", "tracker_callbacks", "trainable"]
