"""The paper's outer loop: the federation (stages, rounds, evaluation), the plug interface it calls at its hooks,
evaluation and the run's summary. What it carries lives below it: the state vectors and the schedule in
:mod:`fdam_ray.core`, a client in :mod:`fdam_ray.clients`, checkpoints in :mod:`fdam_ray.checkpoint`."""
