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

INTERRUPTS = Path(fdam_ray.__file__).with_name("interrupts.py")

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
    from fdam_ray import interrupts

    before = signal.getsignal(signal.SIGINT)
    assert interrupts.install()
    try:
        assert interrupts._state.watch is not None and interrupts._state.watch.thread.is_alive()
        watch = interrupts._state.watch
    finally:
        interrupts.uninstall()
    assert not watch.thread.is_alive() and signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1  # nothing of ours left in place
