"""A second stop signal exits at once even while the main thread is inside a long native call (a Ray wait, Ray's
exit-time shutdown), where Python runs no signal handler until the call returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fdam_ray

INTERRUPTS = Path(fdam_ray.__file__).parent / "features" / "interrupts.py"

# the handlers installed, then the main thread blocked in C for good: a default mutex locked twice by one thread
STUCK = f"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("interrupts", {str(INTERRUPTS)!r})
interrupts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupts)
stops = []
interrupts.install(stops.append)
mutex = ctypes.create_string_buffer(128)
libc = ctypes.CDLL(None)
libc.pthread_mutex_lock(mutex)
print("stuck", flush=True)
libc.pthread_mutex_lock(mutex)
"""


def test_a_second_ctrl_c_exits_at_once_while_the_main_thread_is_in_native_code():
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "stuck"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None  # the first asks for a stop, which the main thread acts on when it can
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 130 and took < 3, (rc, took)
    assert proc.stderr.read().strip() == "fdam: SIGINT again: exiting now; what the first signal saved is kept"


def test_the_signal_watch_is_given_back_with_the_handlers():
    from fdam_ray.features import interrupts

    before = signal.getsignal(signal.SIGINT)
    assert interrupts.install()
    try:
        assert interrupts._state.watch is not None and interrupts._state.watch.thread.is_alive()
        watch = interrupts._state.watch
    finally:
        interrupts.uninstall()
    assert not watch.thread.is_alive() and signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1  # nothing of ours left in place


# a fork while the watch runs (DataLoader workers are forked every epoch): the child's signals never reach it
FORKS = f"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("interrupts", {str(INTERRUPTS)!r})
interrupts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupts)
interrupts.install(lambda signum: None)
interrupts._hold_stop_signals_for_fork()  # what the fork hook does before a fork
held = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
interrupts._release_stop_signals()
for _ in range(20):
    pid = os.fork()
    if pid == 0:  # the child: no longer the watch's; stop signals held for the worker's own handling (a
        # DataLoader worker's ignore_stop_signals), so a SIGTERM to it neither runs the command's handler nor
        # reaches the parent's watch
        ok = signal.set_wakeup_fd(-1) == -1 and signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.kill(os.getpid(), signal.SIGTERM)
        ok = ok and signal.SIGTERM in signal.sigpending() and interrupts._state.first is None
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
released = signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
print(held, released, interrupts._state.watch.stops, flush=True)
"""


def test_a_forked_childs_signals_are_held_through_the_fork_and_never_reach_the_parents_watch():
    """A SIGTERM to the process group as a DataLoader worker is forked must not count as a second signal in the
    driver (it made `fdam train` exit at once, without its checkpoint, in 5 runs of 12), nor run the command's
    handler in the worker: stop signals are held in the forking thread through the fork, and stay held in the
    child (the worker's ignore_stop_signals takes them)."""
    done = subprocess.run([sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "0"], done.stdout + done.stderr[-2000:]
