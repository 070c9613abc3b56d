"""The paper's outer loop and what it carries: the federation (stages, rounds, evaluation), a client's state apart
from the replica that trains it, the state vectors, checkpoints, schedules, evaluation and the run's summary."""
