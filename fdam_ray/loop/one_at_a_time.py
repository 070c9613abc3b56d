"""One federation at a time in a process: torch's random number generator is the whole process's.

A model's seeded initialisation and a driver's checkpointed RNG state draw from it, so two federations run at once
in threads of one process would draw in turns and each end other than alone; :func:`one_federation_at_a_time`
refuses the second in one line. One after another they are independent; nested in one thread (a two-stage
recipe runs its stage 1 inside the assembly of stage 2, :mod:`fdam_ray.assembly.pretrain`) they are sequential.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_ONE_AT_A_TIME = threading.Lock()  # guards the two below
_running_in: int | None = None  # the thread a federation of this process runs in
_depth = 0  # how deep (a two-stage recipe runs its stage 1 inside the assembly of stage 2)


@contextmanager
def one_federation_at_a_time() -> Iterator[None]:
    """While inside, this thread runs this process's federation; another thread's is refused in one line.

    torch's random number generator is one per process (a model's seeded initialisation, a driver's checkpointed
    RNG state): two federations at once in threads would draw from it in turns and each end other than alone.
    One after another they are independent; nested in one thread (stage 1 of a recipe) they are sequential."""
    global _running_in, _depth
    me = threading.current_thread()
    with _ONE_AT_A_TIME:
        if _running_in is not None and _running_in != me.ident:
            other = next((t.name for t in threading.enumerate() if t.ident == _running_in), str(_running_in))
            raise RuntimeError(f"another federation is running in this process (thread {other!r}); torch's random "
                               "number generator is shared by the whole process, so two runs at once would change "
                               "each other's results: run them one after another, or each in a process of its own")
        _running_in, _depth = me.ident, _depth + 1
    try:
        yield
    finally:
        with _ONE_AT_A_TIME:
            _depth -= 1
            if _depth == 0:
                _running_in = None
