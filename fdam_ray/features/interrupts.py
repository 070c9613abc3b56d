"""How the ``fdam`` command stops on SIGTERM and Ctrl+C (SIGINT).

The first signal asks for a clean stop, each command its own way (see
:func:`install`): ``fdam train`` ends at the next round end with a checkpoint
on SIGTERM and at once on Ctrl+C; ``fdam tune`` stops its sweep the way Ray
Tune stops on Ctrl+C (the experiment state saved) and prints how to resume.
Inside a wait that has nothing to save (a tracker starting, a compiled graph
ending: :func:`interruptible`) the first signal ends the wait at once.

A second signal (a second Ctrl+C, a scheduler's follow-up SIGTERM) means now:
the process flushes its output and leaves with ``os._exit``, keeping what the
first one saved. "Now" holds while the main thread is inside a long native call
(a Ray wait, Ray's exit-time shutdown), where Python runs no signal handler
until the call returns: a thread of its own reads the signals from Python's
wakeup file descriptor (:func:`signal.set_wakeup_fd`) as they arrive, counts
the stop signals and leaves on the second. Ray's exit-time shutdown is skipped: interrupted, it prints a
KeyboardInterrupt traceback, and its teardown of a compiled graph can crash the
process. A private local Ray whose driver is gone is ended by the kernel (its server processes die with
the driver) and by pid (what is left in their sessions:
:func:`fdam_ray.executors.ray.startup.end_private_sessions`, run by :func:`before_exit_now`).
Once the command has returned (:func:`command_returned`) any signal exits so:
the state is saved by then.

DataLoader worker processes ignore both signals unless their parent sends them
(:func:`ignore_stop_signals`, their ``worker_init_fn``): a scheduler signals a
job's whole process group, and a worker killed mid-batch would fail the driver
before its own handler saved anything; the driver ends its workers when it
stops.

A clean stop of ``fdam train`` is a flag (:func:`request_stop`, which its
SIGTERM handler calls): the run folder acts on it at the next round end, with
a checkpoint, and the waits outside rounds (placement, joining or starting a
Ray cluster) poll it (:func:`stop_requested`); each raises :class:`RunStopped`.
The flag lives here, below the Ray executor and the outputs that both read it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
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


_stop_reason: str | None = None


def request_stop(reason: str) -> None:
    """Ask every run of this process to stop at its next round end, with a checkpoint (safe in a signal handler).

    ``fdam train`` calls it on SIGTERM, what Slurm, Kubernetes and spot-instance reclaim send.
    """
    global _stop_reason
    _stop_reason = reason


def stop_requested() -> str | None:
    """Why a stop was asked for (:func:`request_stop`), or None; waits outside rounds (placement, joining a
    cluster) poll it, so that a stop is acted on while they wait too."""
    return _stop_reason


def clear_stop_request() -> None:
    global _stop_reason
    _stop_reason = None


class RunStopped(Exception):
    """A run stopped at a round end because it was asked to (:func:`request_stop`); its checkpoint is written.

    Attributes:
        run_dir: the run folder, to continue with ``--resume`` (None: stopped before a run folder was made).
    """

    def __init__(self, message: str, run_dir: Path | None) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class _State:
    """What the handlers know: the first signal, what a first signal does, whether a wait may be cut short."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.on_first: FirstSignal = _raise_interrupt
        self.waits = 0  # interruptible() blocks entered and not left
        self.returned = False
        self.previous: dict[int, Any] = {}  # the handlers install() replaced
        self.watch: _Watch | None = None  # the thread that sees signals while the main thread is in native code


_state = _State()


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum``: 128 + its number (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


_leaving = threading.Lock()  # one line, whichever of the main thread and the watch leaves first
_last: list[Callable[[], None]] = []  # quick clean-ups run before os._exit (before_exit_now)


def before_exit_now(clean_up: Callable[[], None]) -> None:
    """Run ``clean_up()`` (quick: it must not wait) when a second signal makes the process leave at once, which
    skips exit-time handlers (``atexit``)."""
    if clean_up not in _last:
        _last.append(clean_up)


def _exit_now(signum: int, again: bool | None = None) -> None:
    """Leave at once, quietly: one line, output flushed, no exit-time handlers (Ray's shutdown among them)."""
    _leaving.acquire()  # the other one, if it came second, waits here until the process is gone
    name = signal.Signals(signum).name
    again = _state.first is not None if again is None else again
    what = (f"{name} again: exiting now; what the first signal saved is kept" if again
            else f"{name} while exiting: exiting now")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(f"fdam: {what}", file=sys.stderr, flush=True)
    for clean_up in _last:
        with contextlib.suppress(Exception):
            clean_up()
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
    if _state.watch is not None:
        _state.watch.stop()
    _state.__init__()  # type: ignore[misc]  # a fresh command (main() called again in one process)
    _state.on_first = on_first
    for signum in STOP_SIGNALS:
        _state.previous[signum] = signal.signal(signum, _handle)
    _state.watch = _Watch.start()
    return True


def uninstall() -> None:
    """Give SIGTERM and SIGINT back the handlers :func:`install` replaced (a caller of
    :func:`fdam_ray.cli.main` in its own process, a test, gets its process back as it was)."""
    if threading.current_thread() is threading.main_thread():
        if _state.watch is not None:
            _state.watch.stop()
        for signum, handler in _state.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _state.__init__()  # type: ignore[misc]


class _Watch:
    """A daemon thread reading the signal numbers Python's C-level handler writes to the wakeup file descriptor
    the moment a signal arrives, whatever the main thread is doing: on the second stop signal, or on the first
    once the command has returned, it leaves at once (:func:`_exit_now`), as the main thread's handler would
    once it ran. Not started where the wakeup descriptor is someone else's already (an asyncio loop of the main
    thread): the handlers alone then act, when the main thread runs Python."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.stops = 0
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="fdam-signals", daemon=True)

    @classmethod
    def start(cls) -> _Watch | None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            before = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # pragma: no cover - not the main thread (install checks)
            before = -2
        if before != -1:  # another's: give it back
            if before >= 0:
                signal.set_wakeup_fd(before)
            os.close(read_fd)
            os.close(write_fd)
            return None
        watch = cls(read_fd, write_fd)
        watch.thread.start()
        return watch

    def _run(self) -> None:
        while True:
            try:
                got = os.read(self.read_fd, 64)
            except OSError:
                return
            if self.closing or not got:
                return
            for signum in got:
                if signum not in STOP_SIGNALS:
                    continue
                self.stops += 1
                if self.stops >= 2 or _state.returned:
                    _exit_now(signum, again=self.stops >= 2)

    def stop(self) -> None:
        """Give the wakeup descriptor back and end the thread (main thread only)."""
        with contextlib.suppress(ValueError):
            current = signal.set_wakeup_fd(-1)
            if current not in (self.write_fd, -1):  # someone put theirs in place of ours meanwhile: keep it
                signal.set_wakeup_fd(current)
        self.closing = True
        with contextlib.suppress(OSError):
            os.write(self.write_fd, b"\0")
        self.thread.join(1.0)
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


_mask_at_fork: list[set[int | signal.Signals]] = []  # the forking thread's signal mask, while a fork is under way


def _hold_stop_signals_for_fork() -> None:
    """Before a fork: hold SIGTERM and SIGINT in the forking thread, so that a stop signal sent to the process
    group as the child comes to life (DataLoader workers are forked every epoch) waits until the child has let go
    of the parent's wakeup descriptor, instead of being written into the parent's watch as a second signal."""
    _mask_at_fork.append(signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS))


def _release_stop_signals() -> None:
    if _mask_at_fork:
        signal.pthread_sigmask(signal.SIG_SETMASK, _mask_at_fork.pop())


def _forget_watch_in_child() -> None:
    """A forked child must not report its own signals into the parent's watch: it lets go of the wakeup
    descriptor. Where the fdam command's handlers are installed (:func:`install`), the child (a DataLoader
    worker: the command forks no other Python child) keeps SIGTERM and SIGINT held, so that the command's
    handler never runs in it: :func:`ignore_stop_signals`, its ``worker_init_fn``, takes them from there (a
    SIGTERM held meanwhile is one the job's group received, which the worker ignores). Elsewhere the child
    receives what was held during the fork."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    if _state.previous and _mask_at_fork:
        _mask_at_fork.pop()  # held until the child sets its own
        return
    _release_stop_signals()


os.register_at_fork(before=_hold_stop_signals_for_fork, after_in_parent=_release_stop_signals,
                    after_in_child=_forget_watch_in_child)


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
