"""How the ``fdam`` command stops on SIGTERM and Ctrl+C (SIGINT).

The first signal asks for a clean stop, each command its own way (see
:func:`install`): ``fdam train`` ends at the next round end with a checkpoint
on SIGTERM and at once on Ctrl+C; ``fdam tune`` stops its sweep the way Ray
Tune stops on Ctrl+C (the experiment state saved) and prints how to resume.
Inside a wait that has nothing to save (a tracker starting, a compiled graph
ending: :func:`interruptible`) the first signal ends the wait at once.

A second signal (a second Ctrl+C, a scheduler's follow-up SIGTERM) means now:
the process flushes its output and leaves with ``os._exit``, keeping what the
first one saved. Ray's exit-time shutdown is skipped: interrupted, it prints a
KeyboardInterrupt traceback, and its teardown of a compiled graph can crash the
process. A private local Ray whose driver is gone is ended by Ray's own reaper.
Once the command has returned (:func:`command_returned`) any signal exits so:
the state is saved by then.

DataLoader worker processes ignore both signals unless their parent sends them
(:func:`ignore_stop_signals`, their ``worker_init_fn``): a scheduler signals a
job's whole process group, and a worker killed mid-batch would fail the driver
before its own handler saved anything; the driver ends its workers when it
stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

FirstSignal = Callable[[int], None]


class Interrupted(KeyboardInterrupt):
    """A wait ended by a stop signal (:func:`interruptible`); a KeyboardInterrupt, so that what catches
    ``Exception`` lets it through.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupt(signum: int) -> None:
    raise Interrupted(signum)


class _State:
    """What the handlers know: the first signal, what a first signal does, whether a wait may be cut short."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.on_first: FirstSignal = _raise_interrupt
        self.waits = 0  # interruptible() blocks entered and not left
        self.returned = False
        self.previous: dict[int, Any] = {}  # the handlers install() replaced


_state = _State()


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum``: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


def _exit_now(signum: int) -> None:
    """Leave at once, quietly: one line, output flushed, no exit-time handlers (Ray's shutdown among them)."""
    name = signal.Signals(signum).name
    what = (f"{name} again: exiting now; what the first signal saved is kept" if _state.first is not None
            else f"{name} while exiting: exiting now")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(f"fdam: {what}", file=sys.stderr, flush=True)
    os._exit(exit_code(signum))


def _handle(signum: int, frame: Any) -> None:
    if _state.first is not None or _state.returned:
        _exit_now(signum)
    _state.first = signum
    if _state.waits:
        raise Interrupted(signum)
    _state.on_first(signum)


def install(on_first: FirstSignal = _raise_interrupt) -> bool:
    """Handle SIGTERM and SIGINT in this process from now on: the first calls ``on_first(signum)`` (which may
    raise, e.g. :class:`Interrupted`, to stop at once), a second exits at once. Returns False (and installs
    nothing) off the main thread, where Python allows no handler."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state.__init__()  # type: ignore[misc]  # a fresh command (main() called again in one process)
    _state.on_first = on_first
    for signum in STOP_SIGNALS:
        _state.previous[signum] = signal.signal(signum, _handle)
    return True


def uninstall() -> None:
    """Give SIGTERM and SIGINT back the handlers :func:`install` replaced (a caller of
    :func:`fdam_ray.cli.main` in its own process, a test, gets its process back as it was)."""
    if threading.current_thread() is threading.main_thread():
        for signum, handler in _state.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _state.__init__()  # type: ignore[misc]


def set_first(on_first: FirstSignal) -> None:
    """What a first signal does from now on (a command changes it as it goes: before and during a sweep)."""
    _state.on_first = on_first


def active() -> bool:
    """Whether this process's SIGTERM and SIGINT are handled here (:func:`install`)."""
    return bool(_state.previous)


@contextlib.contextmanager
def first_signal_does(on_first: FirstSignal) -> Iterator[None]:
    """Within the block a first signal calls ``on_first(signum)``; after it, what it did before."""
    before, _state.on_first = _state.on_first, on_first
    try:
        yield
    finally:
        _state.on_first = before


def received() -> int | None:
    """The first stop signal this command got, or None."""
    return _state.first


def command_returned() -> None:
    """The command has ended and its state is saved: any signal from now on (during Ray's exit-time shutdown)
    exits at once."""
    _state.returned = True


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A wait with nothing to save (a tracker starting, a compiled graph ending): a first stop signal inside it
    raises :class:`Interrupted` at once, where the command would otherwise stop only at its next round end
    (a second signal exits at once anywhere)."""
    _state.waits += 1
    try:
        yield
    finally:
        _state.waits -= 1


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: ignore Ctrl+C, and SIGTERM from anyone but the worker's parent.

    A scheduler's SIGTERM to the whole job must leave the workers to the driver, which stops at its next round
    end and then ends them itself. It ends them (and Python's exit ends a daemon process) with SIGTERM from
    the parent, which must still work, as it does with torch's own handler: SIGTERM is blocked here and a
    thread waits for it, leaving when the parent sent it and ignoring it otherwise.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on block it too
    threading.Thread(target=_leave_on_parents_sigterm, args=(parent,), name="fdam-sigterm", daemon=True).start()


def _leave_on_parents_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)  # as torch's worker handler does: the parent ends its worker, quietly
