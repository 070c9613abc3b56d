"""Arrays fetched from Ray's object store are read-only. The modules that only read them (copy sources) must not
print torch's warning about wrapping a read-only array in every actor's log; anything else still warns."""

from __future__ import annotations

import subprocess
import sys
import textwrap

READERS = ("fdam_ray.core.flat", "fdam_ray.clients.client", "fdam_ray.algorithms.local", "fdam_ray.executors.transfer",
           "fdam_ray.loop.federation")


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (torch prints this warning once a process) with UserWarnings as errors."""
    return subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


PREAMBLE = """
    import numpy as np, torch
    x = np.arange(4, dtype=np.float32)
    x.flags.writeable = False  # as ray.get returns it
"""


def test_loading_a_read_only_state_into_the_model_is_silent_and_each_reading_module_silences_it_for_itself():
    """One fresh interpreter (torch warns once a process; a test's own warning filters are reset after it, and
    a module registers its filter once, when imported)."""
    done = _run(PREAMBLE + f"""
    import importlib, warnings
    from fdam_ray.core.flat import HostLink
    t = torch.zeros(4)
    HostLink(torch.device("cpu")).upload([(x, t)])
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    for module in {READERS!r}:
        importlib.import_module(module)
        mine = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
                and "not writable" in f[1].pattern and f[3] is not None and f[3].match(module)]
        assert mine, module + ": no filter"
        assert not any(f[3].match("fdam_ray.api") or f[3].match(module + "_other") for f in mine), module
    """)
    assert done.returncode == 0, done.stderr


def test_the_warning_is_still_raised_outside_those_modules():
    """The premise: without the module's filter, the same wrap warns (here an error)."""
    done = _run(PREAMBLE + """
    import fdam_ray.core.flat
    torch.from_numpy(x)
    """)
    assert done.returncode != 0 and "The given NumPy array is not writable" in done.stderr
